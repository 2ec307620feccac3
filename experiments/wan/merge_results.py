"""Merge bench_wan.py results run one link at a time (`--ratios 50 --out A.json`, `--ratios 5 --out B.json`)
into one file, which `bench_wan.py --report-only --out merged.json [--plots DIR]` then renders as one table.

    python experiments/wan/merge_results.py experiments/wan/results/wan_headline_r*.json \
        --out experiments/wan/results/wan_headline.json

A row run again (`--ratios 50 --rows ddp,hivemind_4bit --out C.json`, e.g. after a fix) replaces the same
row on the same link with `--rerun C.json` (its DDP window is only its reference and is dropped).

    python experiments/wan/merge_results.py A.json B.json --rerun C.json --out merged.json

The runs must share their curves (the same --workdir, later ones with --reuse-curves): the target and each
row's horizon then agree, which is checked.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def merge(parts: list[dict], reruns: tuple[dict, ...] = ()) -> dict:
    first = parts[0]
    if any(p["target_val_loss"] != first["target_val_loss"] for p in (*parts, *reruns)):
        raise ValueError(
            "results from different curves (DDP's final val loss differs): rerun with --reuse-curves"
        )
    merged = {**first, "links": [], "rows": [], "commands": [p["command"] for p in parts]}
    for part in parts:
        merged["links"] += part["links"]
        merged["rows"] += part["rows"]
    for rerun in reruns:
        for row in rerun["rows"]:
            if row["key"] == "ddp":
                continue
            same = [
                i
                for i, r in enumerate(merged["rows"])
                if (r["key"], r["link_label"]) == (row["key"], row["link_label"])
            ]
            if not same:
                raise ValueError(f"a rerun of {row['key']} over {row['link_label']}, which no part has")
            merged["rows"][same[0]] = {**row, "rerun": rerun["command"]}
        merged["commands"].append(rerun["command"])
    merged["bench_s"] = sum(p.get("bench_s", 0.0) for p in (*parts, *reruns))
    return merged


def _load(paths: list[Path]) -> list[dict]:
    return [json.loads(p.read_text()) for p in paths]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("parts", nargs="+", type=Path)
    ap.add_argument("--rerun", type=Path, action="append", default=[], help="rows that replace the parts'")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    try:
        merged = merge(_load(args.parts), tuple(_load(args.rerun)))
    except (OSError, ValueError, KeyError) as exc:
        print(f"merge_results: {exc}", file=sys.stderr)
        return 2
    args.out.write_text(json.dumps(merged, indent=1))
    print(f"wrote {args.out}: {len(merged['links'])} links, {len(merged['rows'])} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
