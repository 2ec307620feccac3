"""Regression fixture: the global parameters after a few outer steps of tiny runs, recorded once per kind
of CPU (tests/sync/regression.json) and compared bit for bit, so that moving code never moves numbers.

Bits depend on the machine as well as the code: oneDNN/MKL take other kernels on another vendor or ISA
(an AMD EPYC with AVX512-BF16 gives other last bits than the machine the first records came from, even
for fp32 AdamW). So the fixture holds one table per machine signature (torch version, CPU vendor, ISA,
native bf16), and a run must equal this machine's table, or, on a machine without one, one of the
tables recorded so far.

Re-record only on purpose (a deliberate change of the maths, or a new kind of machine with the code
unchanged: record on the last commit whose tables pass elsewhere), and say why in the commit:
    python tests/sync/test_regression.py --record
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "regression.json"
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import TINY  # noqa: E402
from test_helpers import run_muloco  # noqa: E402

from muloco.checkpoint.plain import list_checkpoints, load_checkpoint  # noqa: E402
from muloco.config import load_config  # noqa: E402
from muloco.optim.newton_schulz import default_ns_dtype  # noqa: E402
from muloco.run.trainer import Trainer  # noqa: E402

STAT4_EF = ["compression.scheme=statistical", "compression.bits=4", "compression.error_feedback=true"]
CASES = {
    # 4 outer steps of H = 3 each (12 inner steps), K = 2 simulated workers unless said otherwise.
    "diloco_adamw_fp32": ["workers=2", "inner.optimizer=adamw"],
    "muloco_4bit_ef": ["workers=2", "inner.optimizer=muon", *STAT4_EF],
    "streaming_p3_tau2_alpha05": [
        "workers=2",
        "model.n_layers=3",
        "train.total_tokens=9216",
        "sync.every=9",
        "sync.fragments=3",
        "sync.overlap=2",
        "sync.alpha=0.5",
    ],
    "dp": ["workers=2", "method=dp"],
    # reduce-scatter: K = 4 parts, owners' means at 8 bits (the default) with their own error feedback
    # (recorded when sync.transport was added; the cases above were unchanged by it).
    "muloco_4bit_ef_reduce_scatter_k4": [
        "workers=4",
        "inner.optimizer=muon",
        *STAT4_EF,
        "sync.transport=reduce_scatter",
    ],
}
GLOO_CASE = "gloo_2_processes"
GLOO_OVERRIDES = ["workers=2", "inner.optimizer=muon", *STAT4_EF]


def fingerprint(params: list[torch.Tensor]) -> dict:
    """A hash of every byte of the parameters, plus a few values to read when the hash differs."""
    digest = hashlib.sha256()
    for p in params:
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    first, middle, last = params[0].flatten(), params[len(params) // 2].flatten(), params[-1].flatten()
    return {
        "sha256": digest.hexdigest(),
        "first": first[:4].tolist(),
        "middle": middle[:4].tolist(),
        "last": last[-4:].tolist(),
        "numel": sum(p.numel() for p in params),
    }


def checkpoint_global_params(state: dict) -> list[torch.Tensor]:
    """The global parameters of a final checkpoint (format 1: "outer"; format 2: the engine's state)."""
    if state["format"] == 1:
        return state["outer"]["params"]
    return state["engine"]["outer"]["params"]


def run_in_process(name: str, overrides: list[str], out: Path) -> dict:
    cfg = load_config(None, [*TINY, *overrides, f"run.output_dir={out}", f"run.name={name}"])
    Trainer(cfg).run()
    state = load_checkpoint(list_checkpoints(out / name / "checkpoints")[-1])
    if cfg.method == "dp":
        return fingerprint(list(state["replicas"][0]["model"].values()))
    return fingerprint(checkpoint_global_params(state))


def run_two_processes(out: Path) -> dict:
    config = out / "defaults.yaml"
    config.write_text("{}\n")  # the schema's defaults, as load_config(None, ...) in-process
    overrides = [*TINY, *GLOO_OVERRIDES, f"run.output_dir={out}", f"run.name={GLOO_CASE}"]
    result = run_muloco("launch", "--nproc", 2, config, *overrides, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    state = load_checkpoint(list_checkpoints(out / GLOO_CASE / "checkpoints")[-1])
    return fingerprint(checkpoint_global_params(state))


def machine() -> str:
    """What the bits depend on besides the code: torch, the CPU's vendor, its ISA, native bf16."""
    vendor = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        text = cpuinfo.read_text()
        vendor = next(
            (line.split(":")[1].strip() for line in text.splitlines() if "vendor_id" in line), vendor
        )
    bf16 = "native bf16" if default_ns_dtype(torch.device("cpu")) == torch.bfloat16 else "no bf16"
    return f"torch {torch.__version__}, {vendor}, {torch.backends.cpu.get_cpu_capability()}, {bf16}"


def recorded() -> dict[str, dict]:
    """{machine signature: {case: fingerprint}}."""
    return json.loads(FIXTURE.read_text())["machines"]


def assert_unchanged(name: str, got: dict) -> None:
    tables = recorded()
    mine = tables.get(machine())
    candidates = [mine] if mine is not None else list(tables.values())
    assert any(got == table[name] for table in candidates), (
        f"{name}: the global parameters moved on {machine()!r} (see this file's docstring)"
    )


@pytest.mark.parametrize("name", list(CASES))
def test_global_parameters_are_unchanged(tmp_path, name):
    assert_unchanged(name, run_in_process(name, CASES[name], tmp_path))


@pytest.mark.slow
def test_global_parameters_over_gloo_are_unchanged(tmp_path):
    assert_unchanged(GLOO_CASE, run_two_processes(tmp_path))


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    import tempfile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        table = {name: run_in_process(name, overrides, Path(tmp)) for name, overrides in CASES.items()}
        table[GLOO_CASE] = run_two_processes(Path(tmp))
    tables = recorded() if FIXTURE.is_file() else {}
    tables[machine()] = table
    FIXTURE.write_text(json.dumps({"machines": tables}, indent=1) + "\n")
    print(f"recorded {len(table)} cases for {machine()!r} in {FIXTURE}")
