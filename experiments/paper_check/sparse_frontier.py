"""Loss against bytes for every codec (issue 61): final val loss and bytes per worker of DiLoCo and MuLoCo
with fp32, statistical 4-bit, 2-bit + error feedback and chunked top-k pseudogradients, and of SparseLoCo as
published and with Muon inside, from the sweep sparse_frontier (docs/results.md, "Sparse pseudogradients";
the plot in docs/img). Each row runs at the best lr of its tune (sparse_tune.yaml, sparseloco_tune.yaml).

    muloco sweep configs/sweeps/sparse_tune.yaml --jobs 2       # the sparse rows' outer lr (K = 4, seed 0)
    muloco sweep configs/sweeps/sparseloco_tune.yaml --jobs 2   # SparseLoCo's outer lr and beta
    muloco sweep configs/sweeps/sparse_frontier.yaml --jobs 2   # every row at its tuned lr, K = 4, 8, 2 seeds
    python experiments/paper_check/sparse_frontier.py \
        --json experiments/paper_check/sparse_frontier_results.json --plot docs/img/sparse_frontier.png

A row is one setting of the frontier sweep, with its seeds. "vs fp32" is (loss / same method's fp32
loss - 1) x 100 for the same seed, then the mean over the seeds; "message" is fp32's payload per sync
over the row's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from muloco.tools.runs import RunRecord, load_runs

SWEEP = "sparse_frontier"
# Keys that name a run or say where it ran, not what it trained: runs that differ only in these are one row.
NOT_SETTINGS = ("run.seed", "run.name", "run.output_dir", "logging.", "checkpoint.", "train.threads")
METHODS = ("DiLoCo", "MuLoCo", "SparseLoCo", "SparseLoCo + Muon")


def method_of(config: dict[str, Any]) -> str:
    """SparseLoCo is the sparse codec under its outer rule (plain SGD, no momentum: arXiv 2508.15706)."""
    muon = config.get("inner.optimizer") == "muon"
    sparse_rule = config.get("compression.scheme") == "topk" and not config.get("outer.momentum")
    if sparse_rule:
        return "SparseLoCo + Muon" if muon else "SparseLoCo"
    return "MuLoCo" if muon else "DiLoCo"


def codec_of(config: dict[str, Any]) -> str:
    scheme = config.get("compression.scheme", "none")
    if scheme == "none":
        return "fp32"
    if scheme == "topk":
        chunk = config.get("compression.topk_chunk")
        where = f"of {chunk}" if chunk else "per tensor"
        percent = 100 * float(config["compression.topk_fraction"])
        return f"top-k {percent:g}% {where}, {config['compression.topk_value_bits']}-bit"
    ef = " + EF" if config.get("compression.error_feedback") else ""
    return f"{config.get('compression.bits')}-bit{ef}"


def settings(run: RunRecord) -> str:
    kept = {k: v for k, v in run.config.items() if not k.startswith(NOT_SETTINGS)}
    return json.dumps(kept, sort_keys=True, default=str)


def frontier_rows(root: Path) -> list[dict[str, Any]]:
    """One row per setting the frontier sweep ran, with every seed it ran it at."""
    by_setting: dict[str, list[RunRecord]] = {}
    for run in load_runs(root / SWEEP):
        if run.completed and run.loss is not None:
            by_setting.setdefault(settings(run), []).append(run)
    rows = []
    for key in by_setting:
        seeds: dict[int, RunRecord] = {}
        for run in by_setting[key]:
            seeds.setdefault(int(run.config.get("run.seed", 0)), run)
        first = next(iter(seeds.values()))
        rows.append(
            {
                "method": method_of(first.config),
                "codec": codec_of(first.config),
                "workers": int(first.config["workers"]),
                "outer_lr": first.config.get("outer.lr"),
                "outer_momentum": first.config.get("outer.momentum"),
                "ef_decay": first.config.get("compression.ef_decay"),
                "seeds": sorted(seeds),
                "losses": [seeds[s].loss for s in sorted(seeds)],
                "mb_per_worker": first.summary["bytes_sent_per_worker"] / 1e6,
                "payload_bytes_per_sync": first.summary["payload_bytes_per_sync"],
                "bits_per_param": first.summary.get("effective_bits_per_param"),
                "runs": [seeds[s].name for s in sorted(seeds)],
            }
        )
    add_comparisons(rows)
    return sorted(rows, key=lambda r: (r["workers"], METHODS.index(r["method"]), -r["mb_per_worker"]))


def add_comparisons(rows: list[dict[str, Any]]) -> None:
    """Each row against the fp32 row of its inner optimizer at its K: loss per seed, and message size."""
    fp32 = {(r["workers"], r["method"]): r for r in rows if r["codec"] == "fp32"}
    for row in rows:
        inner = "MuLoCo" if row["method"] in ("MuLoCo", "SparseLoCo + Muon") else "DiLoCo"
        base = fp32.get((row["workers"], inner))
        row["vs_fp32_pct"], row["message_x"] = None, None
        if base is None:
            continue
        base_loss = dict(zip(base["seeds"], base["losses"], strict=True))
        pairs = zip(row["seeds"], row["losses"], strict=True)
        diffs = [100 * (loss / base_loss[s] - 1) for s, loss in pairs if s in base_loss]
        row["vs_fp32_pct"] = diffs
        row["message_x"] = base["payload_bytes_per_sync"] / row["payload_bytes_per_sync"]


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| K | method | codec | outer lr | MB / worker | message | loss (per seed) | vs fp32 (per seed) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        losses = " / ".join(f"{v:.4f}" for v in r["losses"])
        diffs = r["vs_fp32_pct"]
        vs = (
            f"{statistics.mean(diffs):+.2f}% ({' / '.join(f'{d:+.2f}' for d in diffs)})"
            if diffs and r["codec"] != "fp32"
            else ""
        )
        message = f"{r['message_x']:.1f}x" if r["message_x"] else ""
        lines.append(
            f"| {r['workers']} | {r['method']} | {r['codec']} | {r['outer_lr']:g} | "
            f"{r['mb_per_worker']:.2f} | {message} | {losses} | {vs} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = sorted({r["workers"] for r in rows})
    fig, axes = plt.subplots(1, len(workers), figsize=(6 * len(workers), 4.5), squeeze=False)
    for ax, K in zip(axes[0], workers, strict=True):
        for method in METHODS:
            points = sorted(
                (r["mb_per_worker"], statistics.mean(r["losses"]), min(r["losses"]), max(r["losses"]))
                for r in rows
                if r["workers"] == K and r["method"] == method
            )
            if not points:
                continue
            xs, ys, lo, hi = zip(*points, strict=True)
            err = [[y - a for y, a in zip(ys, lo, strict=True)], [b - y for y, b in zip(ys, hi, strict=True)]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=method)
        ax.set_xscale("log")
        ax.set_xlabel("MB sent per worker over the run")
        ax.set_ylabel("final val loss (mean over seeds, range)")
        ax.set_title(f"pico, K = {K}, 100 outer steps")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("runs/sweeps"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    rows = frontier_rows(args.root)
    if not rows:
        print(f"no completed run of sweep sparse_frontier under {args.root}: run this file's commands first")
        return 2
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.plot is not None:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
