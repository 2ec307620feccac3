"""Regression fixture: the global parameters after a few outer steps of tiny runs, recorded per kind of
CPU (tests/sync/regression.json), so that moving code never moves numbers.

Bits depend on the machine as well as the code: oneDNN/MKL take other kernels on another vendor or ISA
(an AMD EPYC with AVX512-BF16 gives other last bits than the machine the first records came from, even
for fp32 AdamW), and Muon's Newton-Schulz runs in bf16 only where the CPU has native bf16. So:

- on a machine whose signature (torch, vendor, ISA, native bf16) has a table: bit for bit;
- elsewhere: Newton-Schulz in fp32, and per-tensor norms and sums within a tolerance (TOLERANCE_FP32,
  TOLERANCE_QUANTIZED) of a no-bf16 table, which allows another CPU's last bits but not a change of the
  maths (the negative tests below make one-line changes to the outer step, the codec and the schedule,
  and each must fail it).

Tables marked "emulated" were recorded here with another CPU's kernels forced (EMULATE_AVX2); they are
references for the tolerance only, never a machine's own table.

Re-record only on purpose (a deliberate change of the maths, or a new kind of machine with the code
unchanged: record on the last commit whose tables pass elsewhere), and say why in the commit:
    python tests/sync/test_regression.py --record                 # this machine's table
    env ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        python tests/sync/test_regression.py --record             # the emulated AVX2, no-bf16 table
    python tests/sync/test_regression.py --spread                 # deviations from the same-class tables
"""

from __future__ import annotations

import hashlib
import json
import math
import os
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
from muloco.optim.orthogonalize import default_ns_dtype  # noqa: E402
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
# The tables were recorded when RMSNorm was the built-in GPT's default (model.norm became layernorm, the
# exportable one, with issue 39): the cases keep the maths they were recorded with.
RECORDED_WITH = ["model.norm=rmsnorm"]
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
        # Per tensor [L2 norm, sum, numel] in float64: what another CPU's tables are compared on.
        "tensors": [[p.double().norm().item(), p.double().sum().item(), p.numel()] for p in params],
    }


def checkpoint_global_params(state: dict) -> list[torch.Tensor]:
    """The global parameters of a final checkpoint (format 1: "outer"; format 2: the engine's state)."""
    if state["format"] == 1:
        return state["outer"]["params"]
    return state["engine"]["outer"]["params"]


def run_in_process(name: str, overrides: list[str], out: Path) -> dict:
    extra = [*RECORDED_WITH, *numerics_overrides(), f"run.output_dir={out}", f"run.name={name}"]
    cfg = load_config(None, [*TINY, *overrides, *extra])
    Trainer(cfg).run()
    state = load_checkpoint(list_checkpoints(out / name / "checkpoints")[-1])
    if cfg.method == "dp":
        return fingerprint(list(state["replicas"][0]["model"].values()))
    return fingerprint(checkpoint_global_params(state))


def run_two_processes(out: Path) -> dict:
    config = out / "defaults.yaml"
    config.write_text("{}\n")  # the schema's defaults, as load_config(None, ...) in-process
    overrides = [
        *TINY,
        *GLOO_OVERRIDES,
        *RECORDED_WITH,
        *numerics_overrides(),
        f"run.output_dir={out}",
        f"run.name={GLOO_CASE}",
    ]
    result = run_muloco("launch", "--nproc", 2, config, *overrides, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    state = load_checkpoint(list_checkpoints(out / GLOO_CASE / "checkpoints")[-1])
    return fingerprint(checkpoint_global_params(state))


# What the emulation of another CPU sets (on an AVX-512 machine: AVX2 kernels, no native bf16).
EMULATE_AVX2 = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}

# Another CPU's tables are compared with Newton-Schulz in fp32 (as on a CPU without native bf16: the
# references are that class's tables): bf16's rounding flips on last-bit differences and moves Muon's
# parameters by up to 3.4e-3 of their norm between two kernel sets of one CPU, as much as a real change.
# Measured with `--spread` on this AMD EPYC, Newton-Schulz in fp32 (docs/records/benchmarks.md "Regression
# fixture"): fp32 cases at most 4.7e-7 of a tensor's norm apart between kernel sets (ATen AVX2 / AVX-512 /
# none, oneDNN AVX2 / AVX-512); cases with 4-bit codes at most 2.7e-4 (a code at a bin's edge flips). The
# bounds leave ~20x and ~4x; the one-line changes in the negative tests move them by 5x the bound or
# more (5x for a 5% change of the codec's range; a 1% change moves muloco_4bit_ef by 2.3e-3, not enough).
TOLERANCE_FP32 = 1e-5
TOLERANCE_QUANTIZED = 1e-3


def tolerance(name: str) -> float:
    overrides = CASES.get(name, GLOO_OVERRIDES)
    return TOLERANCE_QUANTIZED if "compression.scheme=statistical" in overrides else TOLERANCE_FP32


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


def signature() -> str:
    """machine(), marked as emulated when EMULATE_AVX2's variables are set (a reference table, not a
    machine's own)."""
    forced = {k: v for k, v in EMULATE_AVX2.items() if os.environ.get(k) == v}
    if not forced:
        return machine()
    return machine() + " (emulated: " + " ".join(f"{k}={v}" for k, v in forced.items()) + ")"


def recorded() -> dict[str, dict]:
    """{machine signature: {case: fingerprint}}."""
    return json.loads(FIXTURE.read_text())["machines"]


def native_bf16(sig: str) -> bool:
    return "native bf16" in sig


def deviation(got: dict, reference: dict) -> float:
    """The largest per-tensor difference, relative to the reference tensor's norm: of the norms, and of
    the sums (scaled by sqrt(numel), a sum's typical size for a tensor of that norm)."""
    worst = 0.0
    for (norm, total, numel), (ref_norm, ref_total, ref_numel) in zip(
        got["tensors"], reference["tensors"], strict=True
    ):
        assert numel == ref_numel, (numel, ref_numel)
        scale = max(ref_norm, 1e-12)
        worst = max(worst, abs(norm - ref_norm) / scale, abs(total - ref_total) / (scale * math.sqrt(numel)))
    return worst


def own_table() -> dict | None:
    return recorded().get(signature())


def numerics_overrides() -> list[str]:
    """On a machine without its own table the cases run with Newton-Schulz in fp32 (what auto gives on a
    CPU without native bf16), so they compare with the no-bf16 references."""
    return [] if own_table() is not None else ["inner.ns_dtype=fp32"]


def references(name: str) -> list[dict]:
    """The no-bf16 tables that carry per-tensor statistics for `name`."""
    return [
        table[name]
        for other, table in recorded().items()
        if not native_bf16(other) and "tensors" in table.get(name, {})
    ]


def assert_unchanged(name: str, got: dict) -> None:
    tables, sig = recorded(), signature()
    if sig in tables:  # this machine's own kernels: bit for bit
        assert got["sha256"] == tables[sig][name]["sha256"], (
            f"{name}: the global parameters moved on {sig!r} (see this file's docstring)"
        )
        return
    if any(got["sha256"] == table[name]["sha256"] for table in tables.values()):
        return  # bit for bit with another machine's table: its kernels too
    assert within_tolerance(name, got), (
        f"{name}: the global parameters moved by {closest_deviation(name, got):.2e} of their norm on "
        f"{sig!r}, more than another CPU's kernels do ({tolerance(name):.0e}; see this file's docstring)"
    )


def closest_deviation(name: str, got: dict) -> float:
    refs = references(name)
    assert refs, f"{name}: no no-bf16 table with per-tensor statistics to compare with"
    return min(deviation(got, ref) for ref in refs)


def within_tolerance(name: str, got: dict) -> bool:
    return closest_deviation(name, got) <= tolerance(name)


@pytest.mark.parametrize("name", list(CASES))
def test_global_parameters_are_unchanged(tmp_path, name):
    assert_unchanged(name, run_in_process(name, CASES[name], tmp_path))


@pytest.mark.slow
def test_global_parameters_over_gloo_are_unchanged(tmp_path):
    assert_unchanged(GLOO_CASE, run_two_processes(tmp_path))


def _outer_step_without_nesterov(original):
    # nesterov_outer_step(params, pseudogradients, momentum_buffers, lr, momentum, nesterov=True)
    return lambda *args, **kwargs: original(*args[:5], nesterov=False)


# One-line changes to the maths: each must move its case beyond the tolerance (the tolerance would let a
# real change through otherwise). Each: (case, object, attribute, replacement built from the original).
ONE_LINE_CHANGES = {
    "outer step without Nesterov": (
        "diloco_adamw_fp32",
        "muloco.sync.outer",
        "nesterov_outer_step",
        _outer_step_without_nesterov,
    ),
    "statistical codec's range x 1.05": (
        "muloco_4bit_ef",
        "muloco.compress.statistical.StatisticalQuantizer",
        "_stat_range",
        lambda original: lambda self: 1.05 * original(self),
    ),
    "streaming fragments one step later": (
        "streaming_p3_tau2_alpha05",
        "muloco.sync.fragments.SyncSchedule",
        "offset",
        lambda original: lambda self, fragment: (original(self, fragment) + 1) % self.every,
    ),
}


@pytest.mark.parametrize("change", list(ONE_LINE_CHANGES))
def test_the_tolerance_catches_a_one_line_change(tmp_path, monkeypatch, change):
    """Run as another CPU would be (Newton-Schulz in fp32, compared with the no-bf16 tables): unchanged,
    within the tolerance; with the change, beyond it."""
    import importlib

    name, module_path, attribute, replace = ONE_LINE_CHANGES[change]
    module_name, _, owner_name = module_path.rpartition(".")
    try:
        owner = getattr(importlib.import_module(module_name), owner_name)
    except (ImportError, AttributeError):
        owner = importlib.import_module(module_path)
    fp32 = ["inner.ns_dtype=fp32"]
    unchanged = run_in_process(name, [*CASES[name], *fp32], tmp_path / "unchanged")
    assert within_tolerance(name, unchanged), closest_deviation(name, unchanged)
    monkeypatch.setattr(owner, attribute, replace(getattr(owner, attribute)))
    changed = run_in_process(name, [*CASES[name], *fp32], tmp_path / "changed")
    assert not within_tolerance(name, changed), (change, closest_deviation(name, changed))


def run_all(out: Path) -> dict[str, dict]:
    torch.set_num_threads(1)
    table = {name: run_in_process(name, overrides, out) for name, overrides in CASES.items()}
    table[GLOO_CASE] = run_two_processes(out)
    return table


if __name__ == "__main__" and sys.argv[1:] in (["--record"], ["--spread"]):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        table = run_all(Path(tmp))
    if sys.argv[1] == "--spread":  # what a tolerance must allow: this run against the tables it is held to
        fp32_ns = bool(numerics_overrides()) or not native_bf16(machine())
        for other, recorded_table in recorded().items():
            if native_bf16(other) != fp32_ns and other != signature():
                spread = {
                    n: deviation(table[n], recorded_table[n]) for n in table if "tensors" in recorded_table[n]
                }
                cases = " ".join(f"{n}={d:.1e}" for n, d in spread.items())
                print(f"{other!r}: {cases}")
        sys.exit(0)
    tables = recorded() if FIXTURE.is_file() else {}
    previous = tables.get(signature(), {})
    moved = [n for n in table if n in previous and previous[n]["sha256"] != table[n]["sha256"]]
    tables[signature()] = table
    FIXTURE.write_text(json.dumps({"machines": tables}, indent=1) + "\n")
    print(f"recorded {len(table)} cases for {signature()!r} in {FIXTURE}; hashes changed: {moved or 'none'}")
