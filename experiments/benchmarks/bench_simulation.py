"""Throughput of simulated DiLoCo/MuLoCo workers vs the data-parallel baseline at the same global batch.

Each configuration runs in its own subprocess (so peak RSS is its own); the cases of one repeat run in
turn and the repeats interleave, so slow phases of the machine hit every case alike. Each repeat's ratio
to DP is taken against the DP run of the same repeat; the table reports the median over repeats of the
training tokens/s (evals excluded) and of the ratio, with the ratio's min-max spread.

    python experiments/benchmarks/bench_simulation.py --steps 30 --repeats 3 --inner muon --seqs 4 8

--seqs: sequences of 128 tokens per worker at K = 8 (global batch = 8 x seqs sequences for every case).
"""

from __future__ import annotations

import argparse
import gc
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
    "train.eval_every=0",
    "train.eval_tokens=1024",
    "train.warmup_steps=5",
    "sync.every=15",
    "logging.progress=off",
    "checkpoint.every=0",
]


def cases(inner: str, device: str, ks: list[int]) -> list[tuple[str, list[str]]]:
    out = [("dp K=8", ["method=dp", "workers=8"])]
    for k in ks:
        if k == 1:
            out.append(("diloco K=1", ["method=diloco", "workers=1"]))
            continue
        out.append(
            (f"diloco K={k} sequential", ["method=diloco", f"workers={k}", "simulation.batched=false"])
        )
        out.append((f"diloco K={k} batched", ["method=diloco", f"workers={k}", "simulation.batched=true"]))
    if device == "cuda":  # offload does nothing on a CPU: replicas already live in host memory
        out.append(("diloco K=8 offload", ["method=diloco", "workers=8", "simulation.offload=true"]))
    return [(name, [*o, f"inner.optimizer={inner}"]) for name, o in out]


def run_one(overrides: list[str]) -> dict:
    """In the child: train once and report throughput and peak memory."""
    import torch

    from muloco.config import load_config
    from muloco.run.trainer import Trainer

    cfg = load_config(None, overrides)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    summary = Trainer(cfg).run()
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peak_cuda_mb = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "train_tokens_per_s": summary["train_tokens_per_s"],
        "final_val_loss": summary["final_val_loss"],
        "peak_rss_mb": round(peak_rss_mb, 1),
        "peak_cuda_mb": peak_cuda_mb,
        "device": summary["device"],
    }


def paired(args, seqs: int) -> list[dict]:
    """Inner steps only, in one process: DP, K=8 sequential and K=8 batched built side by side, then rounds
    of `--round-steps` steps of each in turn, so a slow phase of the machine hits all three alike. Each
    round's ratio is DP's time over the mode's (same tokens per step); median and spread over rounds."""
    import time

    import torch

    from muloco.config import load_config
    from muloco.run.trainer import Trainer

    batch_tokens = 8 * seqs * 128
    common = [
        *BASE,
        f"model.preset={args.preset}",
        *(f"model.{override}" for override in args.model),
        f"train.batch_tokens={batch_tokens}",
        f"train.total_tokens={batch_tokens * 10_000}",
        f"device={args.device}",
        f"inner.optimizer={args.inner}",
        "workers=8",
        "checkpoint.resume=never",
    ]
    modes = {
        "dp K=8": ["method=dp"],
        "diloco K=8 sequential": ["simulation.batched=false"],
        "diloco K=8 batched": ["simulation.batched=true"],
    }
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {
            name: Trainer(load_config(None, [*common, *extra, f"run.output_dir={tmp}", f"run.name={i}"]))
            for i, (name, extra) in enumerate(modes.items())
        }

        def advance(trainer: Trainer, steps: int) -> None:
            if trainer.dp is not None:
                for _ in range(steps):
                    trainer.dp.step(1.0, trainer.autocast)
            else:
                trainer._inner_steps(trainer.replicas[0].inner_steps + steps)
            if trainer.device.type == "cuda":
                torch.cuda.synchronize()

        times: dict[str, list[float]] = {name: [] for name in modes}
        for round_index in range(args.rounds + 1):  # round 0 warms up
            for name, trainer in trainers.items():
                t0 = time.perf_counter()
                advance(trainer, args.round_steps)
                if round_index > 0:
                    times[name].append(time.perf_counter() - t0)
    rows = []
    for name, t in times.items():
        ratios = [d / m for d, m in zip(times["dp K=8"], t, strict=True)]
        rows.append(
            {
                "case": name,
                "train_tokens_per_s": round(
                    statistics.median(batch_tokens * args.round_steps / x for x in t)
                ),
                "ratio_to_dp": round(statistics.median(ratios), 3),
                "ratio_min": round(min(ratios), 3),
                "ratio_max": round(max(ratios), 3),
            }
        )
    return rows


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    """Per case: median tokens/s, and the median and spread of the per-repeat ratio to that repeat's DP."""
    dp = [r["train_tokens_per_s"] for r in runs["dp K=8"]]
    rows = []
    for name, results in runs.items():
        ratios = [r["train_tokens_per_s"] / d for r, d in zip(results, dp, strict=True)]
        rows.append(
            {
                "case": name,
                "train_tokens_per_s": round(statistics.median(r["train_tokens_per_s"] for r in results)),
                "ratio_to_dp": round(statistics.median(ratios), 3),
                "ratio_min": round(min(ratios), 3),
                "ratio_max": round(max(ratios), 3),
                "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
                "peak_cuda_mb": results[0]["peak_cuda_mb"],
                "final_val_loss": results[0]["final_val_loss"],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30, help="inner steps per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--inner", default="muon", choices=["adamw", "muon"])
    parser.add_argument("--seqs", type=int, nargs="+", default=[4, 8], help="sequences per worker at K=8")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4, 8], help="K values besides DP")
    parser.add_argument("--preset", default="nano")
    parser.add_argument("--model", nargs="*", default=[], help="more model.* overrides, e.g. d_model=1024")
    parser.add_argument("--in-process", action="store_true", help="no subprocess per run (GPU checks)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=None, help="default: results/bench_simulation_<inner>.json")
    parser.add_argument(
        "--paired", action="store_true", help="inner steps only: DP, K=8 sequential, K=8 batched in turn"
    )
    parser.add_argument("--rounds", type=int, default=10, help="--paired: measured rounds")
    parser.add_argument("--round-steps", type=int, default=4, help="--paired: steps per mode per round")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    if args.paired:
        tables = {seqs: paired(args, seqs) for seqs in args.seqs}
        for seqs, rows in tables.items():
            print(
                f"\ninner steps, K=8 vs DP, inner={args.inner}, preset={args.preset}, {seqs} sequences of 128"
                f" per worker; median of {args.rounds} interleaved rounds of {args.round_steps} steps each"
            )
            print(f"{'case':<24}{'tokens/s':>10}{'vs DP':>8}{'spread':>14}")
            for r in rows:
                spread = f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f}"
                print(f"{r['case']:<24}{r['train_tokens_per_s']:>10}{r['ratio_to_dp']:>8.3f}{spread:>14}")
        out = Path(args.out or f"experiments/benchmarks/results/bench_simulation_paired_{args.inner}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps({"args": vars(args), "tables": {str(s): t for s, t in tables.items()}}, indent=2)
        )
        return

    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    results: dict[int, dict[str, list[dict]]] = {seqs: {} for seqs in args.seqs}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for seqs in args.seqs:
                batch_tokens = 8 * seqs * 128
                for name, overrides in cases(args.inner, device, args.workers):
                    full = [
                        *BASE,
                        *overrides,
                        f"model.preset={args.preset}",
                        *(f"model.{override}" for override in args.model),
                        f"train.batch_tokens={batch_tokens}",
                        f"train.total_tokens={batch_tokens * args.steps}",
                        f"device={args.device}",
                        f"run.output_dir={tmp}",
                        f"run.name=r{repeat}-s{seqs}-{name.replace(' ', '_')}",
                    ]
                    if args.in_process:  # peak RSS is then the process's, not the case's
                        result = run_one(full)
                    else:
                        out = subprocess.run(
                            [sys.executable, __file__, "--one", json.dumps(full)],
                            capture_output=True,
                            text=True,
                            check=True,
                            env=os.environ,
                        )
                        result = json.loads(out.stdout.strip().splitlines()[-1])
                    results[seqs].setdefault(name, []).append(result)
                    print(f"  done seqs={seqs} {name} repeat={repeat}", file=sys.stderr, flush=True)

    tables = {seqs: summarize(runs) for seqs, runs in results.items()}
    for seqs, rows in tables.items():
        print(
            f"\nsimulated workers vs DP, inner={args.inner}, preset={args.preset} {' '.join(args.model)}, "
            f"device={device}, "
            f"steps={args.steps}, global batch {8 * seqs} sequences of 128 ({seqs} per worker at K=8), "
            f"median of {args.repeats} interleaved repeats"
        )
        print(
            f"{'case':<24}{'tokens/s':>10}{'vs DP':>8}{'spread':>14}{'peak RSS MB':>13}"
            f"{'peak CUDA MB':>14}{'val loss':>10}"
        )
        for r in rows:
            cuda = f"{r['peak_cuda_mb']:.0f}" if r["peak_cuda_mb"] is not None else "-"
            spread = f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f}"
            print(
                f"{r['case']:<24}{r['train_tokens_per_s']:>10}{r['ratio_to_dp']:>8.3f}{spread:>14}"
                f"{r['peak_rss_mb']:>13.0f}{cuda:>14}{r['final_val_loss']:>10.3f}"
            )
    out = Path(args.out or f"experiments/benchmarks/results/bench_simulation_{args.inner}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"args": vars(args), "device": device, "tables": {str(s): t for s, t in tables.items()}}
    out.write_text(json.dumps({**payload, "raw": {str(s): r for s, r in results.items()}}, indent=2))


if __name__ == "__main__":
    main()
