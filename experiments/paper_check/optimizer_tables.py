"""The inner-optimizer study's tables (docs/results.md, Which inner optimizer keeps its DP advantage as K
grows) from the flagship sweep's tuned comparison and the alignment runs at the lrs it found.

    muloco sweep configs/sweeps/inner_optimizers.yaml --jobs 2            # -> runs/sweeps/inner_optimizers
    muloco sweep configs/sweeps/inner_optimizers_alignment.yaml --jobs 2  # diagnostics.alignment: true
    python experiments/paper_check/optimizer_tables.py [--json out.json]

Table 1 is `muloco report`'s tuned comparison (runs/sweeps/inner_optimizers/tuned.json: each optimizer at
its best lr per K, DP at its own best lr, paired seeds) laid out one row per optimizer; table 2 the
alignment measures (mean over the second half of the syncs) beside the K = 4 and K = 8 gaps.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from muloco.run.metrics import read_jsonl
from muloco.tools.runs import load_runs

ROOT = Path("runs/sweeps")
ORDER = ["adamw", "muon", "lion", "ademamix", "Adafactor"]
ALIGNMENT_FIELDS = {
    "pseudograd_cosine": "pairwise cos",
    "cos_to_union": "cos to union",
    "norm_retention": "norm kept",
    "top_sv_retention": "sigma_1 kept",
    "erank_workers": "erank workers",
}


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(map(str, row)) + " |" for row in rows)])


def own_lr(cell: dict) -> str:
    """The best value of the optimizer's own lr (inner.adamw.lr for the built-in adamw)."""
    key = "inner.adamw.lr" if cell["settings"]["inner.optimizer"] == "adamw" else "inner.lr"
    warning = any(w.startswith(key) for w in cell["warnings"])
    return f"{cell['best'][key]:g}{' (edge)' if warning else ''}"


def gaps(rows: list[dict]) -> tuple[str, dict]:
    by = {(r["cell"]["settings"]["inner.optimizer"], r["cell"]["settings"]["workers"]): r for r in rows}
    ks = sorted({k for _, k in by})
    out, data = [], {}
    for optimizer in [o for o in ORDER if any(o == key[0] for key in by)]:
        cells, lrs, losses = [], [], []
        for k in ks:
            r = by.get((optimizer, k))
            if r is None or r["pct_over_dp"] is None:
                cells.append("-")
                continue
            spread = r["pct_over_dp_per_seed"]
            cells.append(f"{r['pct_over_dp']:+.2f}% ({min(spread):+.2f}..{max(spread):+.2f})")
            lrs.append(own_lr(r["cell"]))
            losses.append(f"{r['final_val_loss']:.4f}")
            data[f"{optimizer}_k{k}"] = {
                "gap": r["pct_over_dp"],
                "gaps": spread,
                "loss": r["final_val_loss"],
                "dp": r["dp_final_val_loss"],
                "lr": r["cell"]["best"],
                "dp_lr": r["dp"]["best"],
            }
        dp = next(r for (o, _), r in by.items() if o == optimizer)
        out.append(
            [
                optimizer,
                *cells,
                " / ".join(losses),
                f"{dp['dp_final_val_loss']:.4f} ({own_lr(dp['dp'])})",
                " / ".join(lrs),
            ]
        )
    header = [
        "inner optimizer",
        *(f"gap K = {k}" for k in ks),
        f"loss K = {' / '.join(map(str, ks))}",
        "DP loss (lr)",
        f"best lr K = {' / '.join(map(str, ks))}",
    ]
    return table(header, out), data


def alignment(directory: Path, gap_data: dict) -> tuple[str, dict]:
    rows, data = [], {}
    done = [r for r in load_runs(directory) if r.completed]
    runs = sorted(done, key=lambda r: (ORDER.index(r.group), r.config["workers"]))
    for r in runs:
        syncs = [s for s in read_jsonl(r.path / "metrics.jsonl") if s.get("kind") == "sync"]
        later = syncs[len(syncs) // 2 :]  # the second half: past the first rounds' transient
        values = {f: statistics.mean(s[f] for s in later if s.get(f) is not None) for f in ALIGNMENT_FIELDS}
        k = r.config["workers"]
        gap = gap_data.get(f"{r.group}_k{k}", {}).get("gap")
        gap_text = "-" if gap is None else f"{gap:+.2f}%"
        rows.append([r.group, k, *(f"{v:.3f}" for v in values.values()), gap_text])
        data[f"{r.group}_k{k}"] = values
    header = ["inner optimizer", "K", *ALIGNMENT_FIELDS.values(), "gap to DP (table 1)"]
    return table(header, rows), data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    tuned = json.loads((args.root / "inner_optimizers" / "tuned.json").read_text())
    gap_table, gap_data = gaps(tuned["rows"])
    print(f"### Gap to DP, each at its own best lr\n\n{gap_table}\n")
    align_dir = args.root / "inner_optimizers_alignment"
    align_data = {}
    if align_dir.is_dir():
        align_table, align_data = alignment(align_dir, gap_data)
        print(f"### Alignment (mean over the second half of the syncs)\n\n{align_table}\n")
    if args.json:
        args.json.write_text(json.dumps({"gaps": gap_data, "alignment": align_data}, indent=1))


if __name__ == "__main__":
    main()
