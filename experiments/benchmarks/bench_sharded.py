"""Sharded workers (sharding=fsdp) against replicated ones: memory per rank, step time, bytes per rank.

K = 2 workers of R = 1, 2, 4 ranks train a 57M-parameter GPT (the base preset with 8 blocks: d768, seq 64,
byte vocabulary) for 4 inner steps (2 outer steps) with MuLoCo's defaults (Muon inside, fp32 sync), once
with `sharding: replicate` and once with `sharding: fsdp`, as `muloco launch` runs on gloo over
127.0.0.1 (one thread per rank; this machine's 2 cores are shared by all K x R ranks, so step times are
relative figures, not throughput). The layouts alternate over --repeats so background load hits all alike.

Per run, from rank 0's summary.json:
  state   its parameters + gradients + inner optimizer state + outer state (fp32 global copy, outer
          momentum), in bytes (summary's state_bytes_rank0, counted from the tensors it holds)
  rss     its peak resident memory (everything: the above, activations, the data, torch itself)
  step    one inner step's compute (worker_compute_s / inner steps)
  sent    the bytes it sent across workers itself (bytes_sent_by_rank0)
Ratios are fsdp over replicate at the same R, medians of the repeats [min-max].
Targets (issue 20): state <= 0.6x at R = 2, <= 0.35x at R = 4; sent 1/R of the replicated lead's.

    python experiments/benchmarks/bench_sharded.py [--ranks 1 2 4] [--repeats 3] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "sharded.json"
TARGETS = {2: 0.6, 4: 0.35}  # state ratio, issue 20
MODEL = ["model.preset=base", "model.n_layers=8", "model.seq_len=64"]


def run(R: int, sharding: str, out: Path, timeout: float) -> dict:
    """One `muloco launch` of K = 2 workers x R ranks; rank 0's summary."""
    name = f"{sharding}-R{R}"
    overrides = [
        *MODEL,
        "workers=2",
        f"ranks_per_worker={R}",
        f"sharding={sharding}",
        "backend.kind=torch",
        "backend.torch.timeout_s=600",
        "data.source=builtin",
        "train.batch_tokens=512",  # 4 sequences of 64 per worker step: one micro-batch per rank at R = 4
        "train.micro_batch_tokens=64",
        "train.total_tokens=2048",  # 4 inner steps
        "train.warmup_steps=1",
        "train.eval_every=1000",
        "train.eval_tokens=64",
        "sync.every=2",
        "checkpoint.every=1000",
        "logging.progress=off",
        f"run.output_dir={out}",
        f"run.name={name}",
    ]
    cmd = [sys.executable, "-m", "muloco", "launch", "--nproc", str(2 * R), "configs/quickstart.yaml"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*cmd, *overrides], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    summary = json.loads((out / name / "summary.json").read_text())
    state = summary["state_bytes_rank0"]
    return {
        "state": sum(state.values()),
        "state_parts": state,
        "rss": summary["peak_rss_bytes_rank0"],
        "step_s": summary["worker_compute_s"] / summary["inner_steps"],
        "sent": summary["bytes_sent_by_rank0"],
        "params": summary["params"],
    }


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    runs: dict[tuple[int, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for R in args.ranks:
                for sharding in ("replicate", "fsdp"):
                    out = Path(tmp) / f"repeat{repeat}"
                    runs.setdefault((R, sharding), []).append(run(R, sharding, out, args.timeout))
                    print(f"repeat {repeat} R={R} {sharding}: done", file=sys.stderr)

    rows = []
    for R in args.ranks:
        rep, fsdp = runs[(R, "replicate")], runs[(R, "fsdp")]
        ratio = {
            key: spread([f[key] / r[key] for f, r in zip(fsdp, rep, strict=True) if r[key]])
            for key in ("state", "rss", "step_s", "sent")
        }
        rows.append(
            {
                "R": R,
                "params": rep[0]["params"],
                "replicate": {k: spread([r[k] for r in rep]) for k in ("state", "rss", "step_s", "sent")},
                "fsdp": {k: spread([f[k] for f in fsdp]) for k in ("state", "rss", "step_s", "sent")},
                "state_parts": {"replicate": rep[0]["state_parts"], "fsdp": fsdp[0]["state_parts"]},
                "ratio": ratio,
                "target_state": TARGETS.get(R),
                "met": R not in TARGETS or ratio["state"]["max"] <= TARGETS[R],
            }
        )

    mb = 1 / 2**20
    print(f"{'R':>2} {'layout':>9} {'state MB':>9} {'rss MB':>8} {'step s':>7} {'sent MB':>8}")
    for row in rows:
        for layout in ("replicate", "fsdp"):
            m = {k: v["median"] for k, v in row[layout].items()}
            print(
                f"{row['R']:>2} {layout:>9} {m['state'] * mb:>9.0f} {m['rss'] * mb:>8.0f} "
                f"{m['step_s']:>7.2f} {m['sent'] * mb:>8.1f}"
            )
    print("\nfsdp / replicate, median [min-max] of", args.repeats, "repeats:")
    for row in rows:
        parts = []
        for key in ("state", "rss", "step_s", "sent"):
            r = row["ratio"][key]
            parts.append(f"{key} {r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}]")
        target = f"  target state <= {row['target_state']}: {'met' if row['met'] else 'NOT met'}"
        print(f"R={row['R']}: " + ", ".join(parts) + (target if row["target_state"] else ""))

    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()}
    args.out.write_text(json.dumps({"machine": machine, "repeats": args.repeats, "rows": rows}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
