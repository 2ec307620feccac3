"""Throughput of simulated DiLoCo/MuLoCo workers vs the data-parallel baseline at the same global batch.

Each configuration runs in its own subprocess (so peak RSS is its own), in interleaved order, repeated
`--repeats` times; the table reports the median training tokens/s (evals excluded) and the ratio to DP.

    python experiments/benchmarks/bench_simulation.py --steps 30 --inner muon
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BASE = [
    "model.preset=nano",
    "model.seq_len=128",
    "train.batch_tokens=8192",  # 64 sequences: 8 per worker at K = 8
    "train.eval_every=0",
    "train.eval_tokens=1024",
    "train.warmup_steps=5",
    "sync.every=15",
    "logging.progress=off",
    "checkpoint.every=0",
]


def cases(inner: str) -> list[tuple[str, list[str]]]:
    out = [("dp K=8", ["method=dp", "workers=8"])]
    for k in (1, 2, 4, 8):
        out.append((f"diloco K={k}", ["method=diloco", f"workers={k}"]))
    for k in (1, 8):
        out.append((f"diloco K={k} offload", ["method=diloco", f"workers={k}", "simulation.offload=true"]))
    return [(name, [*o, f"inner.optimizer={inner}"]) for name, o in out]


def run_one(overrides: list[str]) -> dict:
    """In the child: train once and report throughput and peak memory."""
    import torch

    from muloco.config import load_config
    from muloco.trainer import Trainer

    cfg = load_config(None, overrides)
    summary = Trainer(cfg).run()
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peak_cuda_mb = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    return {
        "train_tokens_per_s": summary["train_tokens_per_s"],
        "final_val_loss": summary["final_val_loss"],
        "peak_rss_mb": round(peak_rss_mb, 1),
        "peak_cuda_mb": peak_cuda_mb,
        "device": summary["device"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30, help="inner steps per run")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--inner", default="muon", choices=["adamw", "muon"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=None, help="default: results/bench_simulation_<inner>.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return

    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, overrides in cases(args.inner):
                full = [
                    *BASE,
                    *overrides,
                    f"train.total_tokens={8192 * args.steps}",
                    f"device={args.device}",
                    f"run.output_dir={tmp}",
                    f"run.name=r{repeat}-{name.replace(' ', '_')}",
                ]
                out = subprocess.run(
                    [sys.executable, __file__, "--one", json.dumps(full)],
                    capture_output=True,
                    text=True,
                    check=True,
                    env=os.environ,
                )
                results.setdefault(name, []).append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"  done {name} repeat={repeat}", file=sys.stderr, flush=True)

    dp = statistics.median(r["train_tokens_per_s"] for r in results["dp K=8"])
    rows = []
    for name, runs in results.items():
        tps = statistics.median(r["train_tokens_per_s"] for r in runs)
        rows.append(
            {
                "case": name,
                "train_tokens_per_s": tps,
                "ratio_to_dp": round(tps / dp, 3),
                "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
                "peak_cuda_mb": runs[0]["peak_cuda_mb"],
                "final_val_loss": runs[0]["final_val_loss"],
            }
        )
    device = next(iter(results.values()))[0]["device"]
    print(
        f"\nsimulated workers vs DP, inner={args.inner}, device={device}, steps={args.steps}, "
        f"global batch 8192 tokens, repeats={args.repeats}"
    )
    print(f"{'case':<22}{'tokens/s':>10}{'vs DP':>8}{'peak RSS MB':>13}{'peak CUDA MB':>14}{'val loss':>10}")
    for r in rows:
        cuda = f"{r['peak_cuda_mb']:.0f}" if r["peak_cuda_mb"] is not None else "-"
        print(
            f"{r['case']:<22}{r['train_tokens_per_s']:>10.0f}{r['ratio_to_dp']:>8.3f}{r['peak_rss_mb']:>13.0f}"
            f"{cuda:>14}{r['final_val_loss']:>10.3f}"
        )
    out = Path(args.out or f"experiments/benchmarks/results/bench_simulation_{args.inner}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "device": device, "rows": rows, "raw": results}, indent=2))


if __name__ == "__main__":
    main()
