"""muloco/sweep/spec.py: the sweep file's schema; every malformation is a one-line ConfigError."""

from pathlib import Path

import pytest

from muloco.errors import ConfigError
from muloco.sweep.expand import expand_grid, run_names
from muloco.sweep.spec import parse_sweep

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"grid": {"workers": [1]}, "base": None}, "missing `base:`"),
        ({"base": "nope.yaml"}, "base config not found"),
        ({"grid": [1, 2]}, "grid must be a mapping"),
        ({"grid": {"workers": 4}}, "grid.workers must be a non-empty list"),
        ({"grid": {"workers": []}}, "grid.workers must be a non-empty list"),
        ({"grid": {"workers": [1, 1]}}, "lists a value twice"),
        (
            {"grid": {"workers": [1, 1], "sync.every": [5, 5]}, "zip": [["workers", "sync.every"]]},
            "same row twice",
        ),
        (
            {"grid": {"workers": [1, 2], "sync.every": [10]}, "zip": [["workers", "sync.every"]]},
            "same length",
        ),
        ({"grid": {"workers": [1, 2]}, "zip": [["workers", "nope"]]}, "zip key 'nope' is not in grid"),
        ({"grid": {"workers": [1, 2]}, "exclude": [{"wrkers": 1}]}, "exclude[0] key 'wrkers'"),
        ({"grid": {"workers": [1, 2]}, "exclude": {"workers": 1}}, "exclude must be a list"),
        ({"grdi": {"workers": [1]}}, "did you mean 'grid'"),
        ({"grid": {"workers": [1]}, "fixed": {"workers": 2}}, "both in fixed and in grid"),
        ({"grid": {"run.name": ["a", "b"]}}, "run.name is set by the sweep"),
        ({"baselines": "yes"}, "baselines must be 'auto'"),
        ({"name": "a/b"}, "plain directory name"),
    ],
)
def test_malformed_sweep_files_are_clear_errors(tmp_path, body, needle):
    body = {"base": str(QUICKSTART), **body}
    if body["base"] is None:
        del body["base"]
    with pytest.raises(ConfigError) as info:
        parse_sweep(body, tmp_path / "s.yaml")
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_zipped_rows_may_repeat_a_value_each_method_at_its_own_lr(tmp_path):
    grid = {"inner.optimizer": ["adamw", "adamw", "muon"], "inner.lr": [0.003, 0.006, 0.02]}
    spec = parse_sweep({"base": str(QUICKSTART), "grid": grid, "zip": [list(grid)]}, tmp_path / "s.yaml")
    runs = expand_grid(spec.grid, spec.zip_groups)
    assert [(r["inner.optimizer"], r["inner.lr"]) for r in runs] == list(zip(*grid.values(), strict=True))
    assert len(set(run_names(runs))) == 3
