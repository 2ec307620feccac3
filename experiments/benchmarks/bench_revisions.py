"""Training throughput of two git revisions of muloco, side by side: does a change (a refactor) cost speed?

Each revision is checked out in a temporary git worktree and run as `python -m muloco train` with that
worktree first on PYTHONPATH, one subprocess per run, the revisions and configurations interleaved,
`--repeats` times. The table reports the median training tokens/s (evals excluded: summary.json's
train_tokens_per_s) of each, the spread (min-max), and the ratio new / old.

    python experiments/benchmarks/bench_revisions.py --old 74597f6 --new HEAD --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE = [
    "model.preset=nano",
    "model.seq_len=128",
    "train.batch_tokens=4096",
    "train.total_tokens=184320",  # 45 steps: 3 outer steps of H = 15
    "train.eval_every=0",
    "train.eval_tokens=1024",
    "train.warmup_steps=5",
    "sync.every=15",
    "logging.progress=off",
    "checkpoint.every=0",
    "train.threads=1",
]
CASES = {
    "MuLoCo K=4": ["workers=4", "inner.optimizer=muon"],
    "MuLoCo K=4 stat4+EF": [
        "workers=4",
        "compression.scheme=statistical",
        "compression.bits=4",
        "compression.error_feedback=true",
    ],
    "streaming P=3 tau=2": ["workers=4", "sync.fragments=3", "sync.overlap=2", "sync.alpha=0.5"],
    "dp K=4": ["workers=4", "method=dp"],
}


def worktree(rev: str, where: Path) -> Path:
    path = where / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(path), rev], check=True)
    return path


def run(tree: Path, overrides: list[str], out: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "muloco", "train", str(tree / "configs/quickstart.yaml"), *BASE, *overrides]
    cmd += [f"run.output_dir={out}", "run.name=bench", "checkpoint.resume=never"]
    # cwd: `python -m` puts the working directory before PYTHONPATH on sys.path.
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=900, cwd=tree)
    return json.loads((out / "bench" / "summary.json").read_text())["train_tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the reference revision")
    parser.add_argument("--new", default="HEAD", help="the revision under test")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=str(ROOT / "experiments/benchmarks/results/revisions.json"))
    args = parser.parse_args()
    results: dict[str, dict[str, list[float]]] = {name: {"old": [], "new": []} for name in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"old": worktree(args.old, Path(tmp)), "new": worktree(args.new, Path(tmp))}
        try:
            for repeat in range(args.repeats):
                for name, overrides in CASES.items():
                    order = ("old", "new") if repeat % 2 == 0 else ("new", "old")  # interleaved
                    for which in order:
                        out = Path(tmp) / f"runs_{which}_{repeat}_{len(results[name][which])}"
                        results[name][which].append(run(trees[which], overrides, out))
                        tokens_per_s = results[name][which][-1]
                        print(f"repeat={repeat} case={name!r} rev={which} tokens_per_s={tokens_per_s}")
        finally:
            for tree in trees.values():
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False
                )
    rows = []
    print(f"\n| case | {args.old} tokens/s (min-max) | {args.new} tokens/s (min-max) | new / old |")
    print("|---|---|---|---|")
    for name, r in results.items():
        old, new = statistics.median(r["old"]), statistics.median(r["new"])
        rows.append({"case": name, "old": r["old"], "new": r["new"], "ratio": new / old})
        print(
            f"| {name} | {old:.0f} ({min(r['old']):.0f}-{max(r['old']):.0f}) | "
            f"{new:.0f} ({min(r['new']):.0f}-{max(r['new']):.0f}) | {new / old:.3f} |"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"old": args.old, "new": args.new, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
