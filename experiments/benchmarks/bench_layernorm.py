"""What the thread-independent LayerNorm costs (muloco/models/norms.py): its forward+backward against
torch's nn.LayerNorm at the pico and quickstart shapes, and a whole GPT forward+backward of each regime's
model with either norm (and RMSNorm, the other built-in choice, for scale), at 1 and 2 torch threads.

Each timing is the median of many timed calls; repeats interleave every case (drift on a shared machine
hits all alike); the table reports the median over repeats with their min-max spread and the ratio to
nn.LayerNorm at the same threads.

    python experiments/benchmarks/bench_layernorm.py --repeats 5   # writes results/bench_layernorm.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from muloco.config import ModelConfig  # noqa: E402
from muloco.models import build_model  # noqa: E402
from muloco.models.norms import LayerNorm  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_layernorm.json"
# (name, preset, sequences, seq_len): pico's DP step (2048 tokens of context 64, configs/pico.yaml) and a
# quickstart worker's step at workers=2 (4096 / 2 tokens of context 128, configs/quickstart.yaml).
REGIMES = [("pico", "pico", 32, 64), ("quickstart", "nano", 16, 128)]
NORM_DIMS = {"pico": 64, "quickstart": 128, "quickstart-rows-768": 768}  # the last: GPT-2 small's width
NORMS: dict[str, Callable[[int], nn.Module]] = {
    "muloco": lambda d: LayerNorm(d, bias=False),
    "torch": lambda d: nn.LayerNorm(d, bias=False),
}


def time_ms(fn: Callable[[], None], iters: int) -> float:
    """The median ms of `iters` calls, each timed, after 2 warm-up calls: a call that another process on
    the machine preempted moves the mean, not the median."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def norm_case(kind: str, dim: int, rows: tuple[int, int]) -> Callable[[], None]:
    norm = NORMS[kind](dim)
    x = torch.randn(*rows, dim, requires_grad=True)
    dy = torch.randn(*rows, dim)

    def step() -> None:
        norm(x).backward(dy)

    return step


def gpt_case(kind: str, preset: str, seqs: int, seq_len: int) -> Callable[[], None]:
    norm = "rmsnorm" if kind == "rmsnorm" else "layernorm"
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset=preset, seq_len=seq_len, norm=norm), 256)
    if kind == "torch":  # the same model with torch's own LayerNorm in each norm's place
        for module in list(model.modules()):
            for name, child in module.named_children():
                if isinstance(child, LayerNorm):
                    setattr(module, name, nn.LayerNorm(child.normalized_shape, bias=False))
    x = torch.randint(0, 256, (seqs, seq_len))
    y = torch.randint(0, 256, (seqs, seq_len))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x, y).backward()

    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats (median reported)")
    parser.add_argument("--norm-iters", type=int, default=200, help="norm forward+backward calls per timing")
    parser.add_argument("--step-iters", type=int, default=20, help="GPT steps per timing")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    cases: dict[tuple[str, str, int], tuple[Callable[[], None], int]] = {}
    for threads in args.threads:
        for shape, dim in NORM_DIMS.items():
            rows = (16, 128) if shape.startswith("quickstart") else (32, 64)
            for kind in NORMS:
                cases[(f"norm {shape} {rows[0] * rows[1]}x{dim}", kind, threads)] = (
                    norm_case(kind, dim, rows),
                    args.norm_iters,
                )
        for name, preset, seqs, seq_len in REGIMES:
            for kind in (*NORMS, "rmsnorm"):
                cases[(f"GPT step {name} ({preset}, {seqs}x{seq_len})", kind, threads)] = (
                    gpt_case(kind, preset, seqs, seq_len),
                    args.step_iters,
                )
    times: dict[tuple[str, str, int], list[float]] = {key: [] for key in cases}
    saved = torch.get_num_threads()
    try:
        for _ in range(args.repeats):
            for key, (fn, iters) in cases.items():
                torch.set_num_threads(key[2])
                times[key].append(time_ms(fn, iters))
    finally:
        torch.set_num_threads(saved)

    rows = []
    print(f"{'case':<44} {'norm':<8} {'thr':>3} {'ms':>8} {'spread':>15} {'vs torch':>8}")
    for (case, kind, threads), ms in times.items():
        median = statistics.median(ms)
        base = statistics.median(times[(case, "torch", threads)])
        rows.append(
            {
                "case": case,
                "norm": kind,
                "threads": threads,
                "ms": ms,
                "median_ms": median,
                "vs_torch": median / base,
            }
        )
        spread = f"{min(ms):.3f}-{max(ms):.3f}"
        print(f"{case:<44} {kind:<8} {threads:>3} {median:8.3f} {spread:>15} {median / base:7.3f}x")
    meta = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"args": {**vars(args), "out": str(args.out)}, **meta, "rows": rows}, indent=1)
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
