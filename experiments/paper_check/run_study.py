"""Small-scale check of the DiLoCo / MuLoCo papers on the built-in corpus, at equal tokens.

Runs each named case (the quickstart model and budget, overrides per case) in a fresh subprocess, one after
another, skipping cases whose run directory already holds a completed summary.json (so it resumes), then
prints a table of final val loss and % over each method's own DP baseline and writes JSON.

    python experiments/paper_check/run_study.py --study engine      # docs/results.md, engine section
    python experiments/paper_check/run_study.py --study compression # docs/results.md, compression section
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

BASE = "configs/quickstart.yaml"

# Tuned on the DP baselines ("tune" study): the best inner lr of each optimizer at this budget.
ADAMW = ["inner.optimizer=adamw", "inner.adamw.lr=0.0015"]
MUON = ["inner.optimizer=muon", "inner.lr=0.04"]
DILOCO_MOMENTUM = 0.6  # best of {0.6, 0.9} in "tune_outer"
MULOCO_MOMENTUM = 0.6  # best of {0.6, 0.9} in "tune_outer"

STUDIES: dict[str, dict[str, list[str]]] = {
    # Tuning first: the inner lr of each DP baseline, then the outer lr / momentum at K = 4.
    "tune": {
        "dp_adamw_lr7.5e-4": ["method=dp", "workers=4", "inner.optimizer=adamw", "inner.adamw.lr=0.00075"],
        "dp_adamw_lr1.5e-3": ["method=dp", "workers=4", "inner.optimizer=adamw", "inner.adamw.lr=0.0015"],
        "dp_adamw_lr3e-3": ["method=dp", "workers=4", "inner.optimizer=adamw", "inner.adamw.lr=0.003"],
        "dp_adamw_lr6e-3": ["method=dp", "workers=4", "inner.optimizer=adamw", "inner.adamw.lr=0.006"],
        "dp_muon_lr0.01": ["method=dp", "workers=4", "inner.optimizer=muon", "inner.lr=0.01"],
        "dp_muon_lr0.02": ["method=dp", "workers=4", "inner.optimizer=muon", "inner.lr=0.02"],
        "dp_muon_lr0.04": ["method=dp", "workers=4", "inner.optimizer=muon", "inner.lr=0.04"],
        "dp_muon_lr0.08": ["method=dp", "workers=4", "inner.optimizer=muon", "inner.lr=0.08"],
        "diloco_k4_m0.9": ["workers=4", "inner.optimizer=adamw", "outer.momentum=0.9"],
        "diloco_k4_m0.6": ["workers=4", "inner.optimizer=adamw", "outer.momentum=0.6"],
        "muloco_k4_m0.6": ["workers=4", "inner.optimizer=muon", "outer.momentum=0.6"],
        "muloco_k4_m0.9": ["workers=4", "inner.optimizer=muon", "outer.momentum=0.9"],
    },
    # Outer momentum at K = 4 with each method's tuned inner lr (AdamW 1.5e-3, Muon 0.04, from "tune").
    "tune_outer": {
        "diloco_k4_m0.6": ["workers=4", *ADAMW, "outer.momentum=0.6"],
        "diloco_k4_m0.9": ["workers=4", *ADAMW, "outer.momentum=0.9"],
        "muloco_k4_m0.6": ["workers=4", *MUON, "outer.momentum=0.6"],
        "muloco_k4_m0.9": ["workers=4", *MUON, "outer.momentum=0.9"],
        # Averaging K weakly aligned pseudogradients shrinks the update: does a larger outer lr help?
        "diloco_k4_m0.6_lr1.0": ["workers=4", *ADAMW, "outer.momentum=0.6", "outer.lr=1.0"],
        "muloco_k4_m0.6_lr1.0": ["workers=4", *MUON, "outer.momentum=0.6", "outer.lr=1.0"],
    },
    # The paper check at tuned settings (outer momentum from "tune_outer").
    "engine": {
        "dp_adamw": ["method=dp", "workers=4", *ADAMW],
        "dp_muon": ["method=dp", "workers=4", *MUON],
        "diloco_k1": ["workers=1", *ADAMW, f"outer.momentum={DILOCO_MOMENTUM}"],
        "diloco_k4": ["workers=4", *ADAMW, f"outer.momentum={DILOCO_MOMENTUM}"],
        "muloco_k1": ["workers=1", *MUON, f"outer.momentum={MULOCO_MOMENTUM}"],
        "muloco_k4": ["workers=4", *MUON, f"outer.momentum={MULOCO_MOMENTUM}"],
    },
    # The MuLoCo paper's quantization check: K = 4, H = 30, statistical row-wise quantization.
    "compression": {
        f"{name}_{label}": [*method, *comp]
        for name, method in (
            ("muloco", ["workers=4", "sync.every=30", *MUON, f"outer.momentum={MULOCO_MOMENTUM}"]),
            ("diloco", ["workers=4", "sync.every=30", *ADAMW, f"outer.momentum={DILOCO_MOMENTUM}"]),
        )
        for label, comp in (
            ("fp32", []),
            ("8bit", ["compression.scheme=statistical", "compression.bits=8"]),
            ("4bit", ["compression.scheme=statistical", "compression.bits=4"]),
            ("2bit", ["compression.scheme=statistical", "compression.bits=2"]),
            (
                "2bit_ef",
                ["compression.scheme=statistical", "compression.bits=2", "compression.error_feedback=true"],
            ),
        )
    },
}


def baseline_of(case: str, summary: dict, results: dict) -> str | None:
    """The DP run of the same inner optimizer in these results, if any."""
    name = "dp_muon" if summary["inner_optimizer"] == "muon" else "dp_adamw"
    return name if name in results and case != name else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--study", choices=sorted(STUDIES), required=True)
    parser.add_argument("--out-dir", default="runs/paper_check")
    parser.add_argument("--extra", nargs="*", default=[], help="overrides added to every case")
    parser.add_argument("--baselines-from", help="a results JSON whose dp_* runs serve as baselines")
    args = parser.parse_args()

    out_dir = Path(args.out_dir) / args.study
    results: dict[str, dict] = {}
    for case, overrides in STUDIES[args.study].items():
        summary_path = out_dir / case / "summary.json"
        done = summary_path.exists() and json.loads(summary_path.read_text()).get("status") == "completed"
        if not done:
            cmd = [
                sys.executable,
                "-m",
                "muloco",
                "train",
                BASE,
                "model.norm=rmsnorm",  # the studies' norm (layernorm became the default later)
                *overrides,
                *args.extra,
                f"run.output_dir={out_dir}",
                f"run.name={case}",
                "logging.progress=off",
            ]
            print("$ " + " ".join(cmd[2:]), file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True)
        results[case] = json.loads(summary_path.read_text())
    if args.baselines_from:
        for name, summary in json.loads(Path(args.baselines_from).read_text())["runs"].items():
            results.setdefault(name, summary)

    print(f"\n{args.study}: {BASE} + overrides, {next(iter(results.values()))['tokens_seen']} tokens each")
    print(
        f"{'case':<22}{'val loss':>10}{'vs own DP':>11}{'MB sent/worker':>16}{'bits/param':>12}{'wall s':>8}"
    )
    rows = {}
    for case, s in results.items():
        base = baseline_of(case, s, results)
        gap = 100 * (s["final_val_loss"] / results[base]["final_val_loss"] - 1) if base else None
        rows[case] = {**s, "pct_over_dp": gap}
        bits = s.get("effective_bits_per_param")
        print(
            f"{case:<22}{s['final_val_loss']:>10.4f}{'' if gap is None else f'{gap:+.2f}%':>11}"
            f"{s['bytes_sent_per_worker'] / 1e6:>16.1f}{'' if bits is None else f'{bits:.2f}':>12}"
            f"{s['wall_time_s']:>8.0f}"
        )
    path = Path(args.out_dir) / f"{args.study}.json"
    path.write_text(json.dumps({"study": args.study, "runs": rows}, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
