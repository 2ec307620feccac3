"""Link rates that give this machine the communication/compute ratio of a named deployment (issue 36, item 3).

A deployment is characterized by DDP's all-reduce time over its compute time per step. Worked out for a
~1B-parameter model trained by 4 sites (fp32 gradients, ring all-reduce, K = 4):

    gradient 4 GB; each site sends 2 (K-1)/K x 4 GB = 6 GB per all-reduce = 48 Gbit
    over 1 Gbit/s (95.7% of it TCP payload): ~50 s; over 10 Gbit/s: ~5 s
    compute per step: ~0.5M tokens per site x 6 x 1e9 FLOP/token = 3e15 FLOP on 8 GPUs at ~400 TFLOP/s
      effective = ~0.94 s
    ratio: ~50 at 1 Gbit/s, ~5 at 10 Gbit/s; a compute-bound link: <= 0.5

This script measures the compute time per DDP step of CONFIG here (K processes of `muloco launch`, on
loopback, each with its share of the cores: as the testbed runs them) and solves, for each ratio, the link
rate R at which the all-reduce of this model's gradients takes ratio x that time by the planner's model
(muloco.net.wan.allreduce_seconds: the longer of its bytes and its round trips, 2K for pico):

    ratio x compute = 8 x 2 (K-1)/K x G / (0.957 R),  with 2K x 2 x latency <= ratio x compute / 2

so that, as in the deployment, the all-reduce's time is its bytes, its round trips at most half of it and
hidden behind them. Where the latency's round trips exceed that, the ratio cannot be reached at that
latency: it says so, with the compute per step it would need and the largest latency that reaches it.
`link_for` asks the model for both terms (its bytes' time falls as 1 / R, its round trips' grows with the
latency) rather than restating it.

    python experiments/wan/calibrate_links.py [--config configs/pico.yaml] [--workers 4] [--latency-ms 25]
        [--ratios 50 5 0.5] [--steps 60] [KEY=VALUE ...]

Run it on a quiet machine. Prints a table and writes experiments/wan/results/calibrate_links.json.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

from muloco.comm.base import ring_allreduce_bytes
from muloco.config import load_config
from muloco.net.wan import Link, allreduce_seconds

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).parent / "results" / "calibrate_links.json"


def compute_per_step(config: str, workers: int, steps: int, overrides: list[str]) -> tuple[float, int]:
    """(compute seconds per DDP step per worker, parameters): a short `method: dp` run of K processes."""
    cfg = load_config(config, [*overrides, "method=dp", f"workers={workers}"])
    tokens = steps * cfg.train.batch_tokens
    with tempfile.TemporaryDirectory(prefix="muloco-calibrate-") as out:
        args = [*overrides, "method=dp", f"workers={workers}", f"train.total_tokens={tokens}"]
        args += [f"train.warmup_steps={min(cfg.train.warmup_steps, steps)}", "logging.progress=off"]
        args += [f"run.output_dir={out}", "run.name=calibrate", f"train.eval_every={10 * steps}"]
        cmd = [sys.executable, "-m", "muloco", "launch", "--nproc", str(workers), config, *args]
        subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
        summary = json.loads((Path(out) / "calibrate" / "summary.json").read_text())
    return summary["worker_compute_s"] / summary["inner_steps"], summary["params"]


def link_for(ratio: float, compute_s: float, payload_bytes: float, workers: int, latency_ms: float) -> dict:
    """The rate (Mbit/s) at which the all-reduce of `payload_bytes` (fp32 gradients) over K workers takes
    ratio x compute_s by muloco.net.wan's model, its bytes setting the time: its round trips at
    `latency_ms` one way at most half of it; else no rate, the compute that ratio needs and the largest
    whole-ms latency that reaches it."""
    target_s = ratio * compute_s
    # The model's two terms, each alone: the bytes' time on a 1 Mbit/s link with no latency (it falls as
    # 1 / rate), the round trips' on a link of unbounded rate (it grows with the latency).
    bytes_s_at_1_mbit = allreduce_seconds(Link(1.0), payload_bytes, workers)
    round_trips_s = allreduce_seconds(Link(math.inf, latency_ms), payload_bytes, workers)
    if round_trips_s > target_s / 2:
        per_ms = allreduce_seconds(Link(math.inf, 1.0), payload_bytes, workers)
        return {
            "ratio": ratio,
            "allreduce_s": target_s,
            "rate_mbit": None,
            "why": f"its round trips take {round_trips_s:.3f} s > half of {target_s:.3f} s",
            "compute_s_needed": 2 * round_trips_s / ratio,
            "latency_ms_max": math.floor(target_s / 2 / per_ms),  # one way, whole ms
        }
    rate = bytes_s_at_1_mbit / target_s
    share = round_trips_s / target_s
    return {"ratio": ratio, "allreduce_s": target_s, "rate_mbit": rate, "latency_share": share}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/pico.yaml"))
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--latency-ms", type=float, default=25.0, help="one way, every link")
    parser.add_argument("--ratios", type=float, nargs="+", default=[50.0, 5.0, 0.5])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE for the config")
    args = parser.parse_args()

    compute_s, params = compute_per_step(args.config, args.workers, args.steps, args.overrides)
    K = args.workers
    ring_bytes = ring_allreduce_bytes(4 * params, K)  # fp32 gradients, what each worker sends
    rows = [link_for(r, compute_s, 4 * params, K, args.latency_ms) for r in args.ratios]
    print(
        f"{Path(args.config).name} {' '.join(args.overrides)}: {params:,} parameters, K = {K}, "
        f"ring all-reduce {ring_bytes / 1e6:.3f} MB per worker, "
        f"compute {compute_s * 1e3:.1f} ms per DDP step, {args.latency_ms:g} ms one way"
    )
    print("| ratio | all-reduce time | link rate | note |")
    print("|---|---|---|---|")
    for row in rows:
        if row["rate_mbit"] is None:
            needed = f"{row['compute_s_needed'] * 1e3:.0f} ms"
            note = (
                f"not reachable: {row['why']}; needs >= {needed} of compute per step, or at most "
                f"{row['latency_ms_max']} ms one way"
            )
            print(f"| {row['ratio']:g} | {row['allreduce_s']:.3f} s | - | {note} |")
        else:
            note = f"round trips {row['latency_share']:.0%} of the all-reduce (hidden by its bytes)"
            print(
                f"| {row['ratio']:g} | {row['allreduce_s']:.3f} s | {row['rate_mbit']:.1f} Mbit/s | {note} |"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "config": args.config,
        "overrides": args.overrides,
        "workers": K,
        "latency_ms": args.latency_ms,
        "params": params,
        "ring_allreduce_bytes": ring_bytes,
        "compute_s_per_step": compute_s,
        "rows": rows,
    }
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
