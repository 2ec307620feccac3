"""The inner optimizer's config check (muloco/optim/check.py): outside the schema, run wherever a config is
loaded for a run (`muloco.load_config`, the CLI, a sweep's plan), with the schema's kind of one-line error."""

import subprocess
import sys

import pytest
from test_helpers import run_muloco_here

import muloco
from muloco.config import load_config
from muloco.errors import ConfigError
from muloco.optim.check import check_inner_optimizer, load_run_config

QS = "configs/quickstart.yaml"


def test_the_schema_alone_takes_any_name_and_the_check_refuses_it_naming_the_override():
    cfg = load_config(QS, ["inner.optimizer=bogus"])  # the schema knows no optimizer
    assert cfg.inner.optimizer == "bogus"
    with pytest.raises(ConfigError) as caught:
        check_inner_optimizer(cfg, QS, ["inner.optimizer=bogus"])
    blame = "override 'inner.optimizer=bogus': inner.optimizer: unknown optimizer 'bogus'"
    assert str(caught.value).startswith(blame)
    assert check_inner_optimizer(cfg := load_config(QS), QS) is cfg  # a valid one passes as it is
    kwargs = load_config(QS, ["inner.kwargs={amsgrad: true}"])  # a section-wide error: the file is named
    with pytest.raises(ConfigError, match=f"^{QS}: inner.kwargs is for optimizers that are not built in"):
        check_inner_optimizer(kwargs, QS, ["inner.kwargs={amsgrad: true}"])


def test_muloco_load_config_is_the_checked_loader():
    assert muloco.load_config is load_run_config
    assert muloco.load_config(QS, ["inner.optimizer=NAdam"]).inner.optimizer == "NAdam"
    with pytest.raises(ConfigError, match="NAdam cannot step|inner.kwargs.nope is not an argument of NAdam"):
        muloco.load_config(QS, ["inner.optimizer=NAdam", "inner.kwargs={nope: 1}"])


@pytest.mark.parametrize("command", ["config", "train", "launch"])
def test_the_cli_commands_that_load_a_config_exit_2_with_one_line_naming_the_field(command):
    args = ["--nproc", "2", QS] if command == "launch" else [QS]
    done = run_muloco_here(command, *args, "inner.optimizer=bogus")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "muloco: error: override 'inner.optimizer=bogus': inner.optimizer: unknown optimizer 'bogus'"
    ), done.stderr


def test_a_built_in_name_is_checked_without_importing_torch():
    code = (
        "import sys; from muloco.optim.check import load_run_config; "
        f"load_run_config({QS!r}, ['inner.optimizer=adamw']); "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
