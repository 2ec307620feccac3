"""Markdown tables of the paper-check studies (docs/results.md) from runs/paper_check/<study>.json.

python experiments/paper_check/tables.py engine
python experiments/paper_check/tables.py compression diloco_k muloco_k   # skip the engine's runs
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def table(study: str, root: str = "runs/paper_check", skip: tuple[str, ...] = ()) -> str:
    runs = json.loads((Path(root) / f"{study}.json").read_text())["runs"]
    runs = {name: s for name, s in runs.items() if not name.startswith(skip)}
    lines = [
        "| run | method | inner | K | H | bits | EF | final val loss | vs own DP | bits/param "
        "| MB sent per worker |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in runs.items():
        gap = s.get("pct_over_dp")
        bits = s.get("effective_bits_per_param")
        lines.append(
            f"| {name} | {s['method']} | {s['inner_optimizer']} | {s['workers']} | {s['sync_every']} "
            f"| {s['bits']} "
            f"| {'yes' if s.get('error_feedback') else '-'} | {s['final_val_loss']:.4f} "
            f"| {'-' if gap is None else f'{gap:+.2f}%'} | {'-' if bits is None else f'{bits:.2f}'} "
            f"| {s['bytes_sent_per_worker'] / 1e6:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1], skip=tuple(sys.argv[2:])))
