"""Merge bench_wan.py results run one link at a time (`--ratios 50 --out A.json`, `--ratios 5 --out B.json`)
into one file, which `bench_wan.py --report-only --out merged.json [--plots DIR]` then renders as one table.

    python experiments/wan/merge_results.py experiments/wan/results/wan_headline_r*.json \
        --out experiments/wan/results/wan_headline.json

A part may run more rows over a link an earlier part ran (`--ratios 5 --rows ddp,diloco_fp32 --repeats 3`):
its rows join that link, each still compared with the DDP window of its own part and repeat (the one that
ran beside it), and that DDP window is kept as their reference only (`"reference": true`, not in the
tables). A row run again (`--ratios 50 --rows ddp,hivemind_4bit --out C.json`, e.g. after a fix) replaces
the same row on the same link and repeat with `--rerun C.json` (its DDP window is dropped: the row is
compared with the DDP window of the part it replaces).

    python experiments/wan/merge_results.py A.json B.json --rerun C.json --out merged.json

The runs must share their curves (the same --workdir, later ones with --reuse-curves): the target and each
row's horizon then agree, which is checked. `--curves D.json` (a `--curves-only --reuse-curves` run of the
same curves, e.g. with a row's 1x run trained since: the loss at equal tokens) joins the parts' curves.
Parts run with other --rows trained other curve rows: the merged file has them all (a row's horizon and
its runs' losses agreeing where two parts have it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def merge(parts: list[dict], reruns: tuple[dict, ...] = (), curves: dict | None = None) -> dict:
    first = parts[0]
    everyone = (*parts, *reruns, *filter(None, [curves]))
    if any(p["target_val_loss"] != first["target_val_loss"] for p in everyone):
        raise ValueError(
            "results from different curves (DDP's final val loss differs): rerun with --reuse-curves"
        )
    first = {**first, "curves": union_curves([p["curves"] for p in everyone])}
    merged = {**first, "links": [], "rows": [], "commands": [p["command"] for p in parts]}
    for index, part in enumerate(parts):
        earlier = {link["label"] for link in merged["links"]}
        merged["links"] += [link for link in part["links"] if link["label"] not in earlier]
        for row in part["rows"]:
            again = row["link_label"] in earlier
            if again and row["key"] != "ddp" and _find(merged["rows"], row):
                raise ValueError(
                    f"{row['key']} over {row['link_label']} is in two parts: pass the later one with --rerun"
                )
            merged["rows"].append(
                {**row, "part": index, **({"reference": True} if again and row["key"] == "ddp" else {})}
            )
    for rerun in reruns:
        for row in rerun["rows"]:
            if row["key"] == "ddp":
                continue
            same = _find(merged["rows"], row)
            if not same:
                raise ValueError(f"a rerun of {row['key']} over {row['link_label']}, which no part has")
            merged["rows"][same[0]] = {
                **row,
                "rerun": rerun["command"],
                "part": merged["rows"][same[0]]["part"],
            }
        merged["commands"].append(rerun["command"])
    merged["bench_s"] = sum(p.get("bench_s", 0.0) for p in (*parts, *reruns))
    return merged


def union_curves(parts: list[dict]) -> dict:
    """Every part's curve rows (a part run with other --rows trained other curves), each row's runs joined
    by length: a row's horizon, and its loss at any length two parts both trained, must agree."""
    union: dict[str, dict] = {}
    for curves in parts:
        for key, curve in curves.items():
            if key not in union:
                union[key] = {**curve, "runs": list(curve["runs"])}
                continue
            if curve["horizon"] != union[key]["horizon"]:
                raise ValueError(f"two parts found other horizons for {key}: not the same curves")
            known = {r["steps"]: r for r in union[key]["runs"]}
            for run in curve["runs"]:
                if run["steps"] in known and run["final_val_loss"] != known[run["steps"]]["final_val_loss"]:
                    raise ValueError(f"two parts' {key} runs of {run['steps']} steps end at other losses")
                known.setdefault(run["steps"], run)
            union[key]["runs"] = [known[steps] for steps in sorted(known)]
    return union


def _find(rows: list[dict], row: dict) -> list[int]:
    """Where `row`'s method ran over the same link in the same repeat."""

    def where(r: dict) -> tuple:
        return r["key"], r["link_label"], r.get("repeat", 0)

    return [i for i, r in enumerate(rows) if where(r) == where(row)]


def _load(paths: list[Path]) -> list[dict]:
    return [json.loads(p.read_text()) for p in paths]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("parts", nargs="+", type=Path)
    ap.add_argument("--rerun", type=Path, action="append", default=[], help="rows that replace the parts'")
    ap.add_argument("--curves", type=Path, help="a --curves-only result of the same curves: replaces theirs")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    try:
        curves = _load([args.curves])[0] if args.curves else None
        merged = merge(_load(args.parts), tuple(_load(args.rerun)), curves)
    except (OSError, ValueError, KeyError) as exc:
        print(f"merge_results: {exc}", file=sys.stderr)
        return 2
    args.out.write_text(json.dumps(merged, indent=1))
    print(f"wrote {args.out}: {len(merged['links'])} links, {len(merged['rows'])} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
