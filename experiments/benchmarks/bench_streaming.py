"""Streaming MuLoCo (P fragments, overlap tau) vs plain MuLoCo at K = 4 on the built-in corpus.

Same data, seed, model and tokens; reports the final val loss and its difference to plain MuLoCo, the peak
bytes one worker sends in one sync event (expect ~1/P) and the total, and the in-run WAN projection at
`--bandwidth-mbps` (the trainer's `backend.local.bandwidth_mbps`: measured compute + the transfers not
hidden behind the overlap). Then the planner (`muloco plan`) at 100 Mbit/s and 1 Gbit/s for this model, at
the step time measured here, and for a 150M-parameter model at an estimated GPU step time.

    python experiments/benchmarks/bench_streaming.py --seeds 0 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from muloco.config import load_config
from muloco.net.wan import Link, estimate_step_seconds, format_plan, plan, plan_as_dict
from muloco.run.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
# The quickstart run (MuLoCo K = 4, H = 15, 600k tokens) with 6 blocks, so that P = 3 strided fragments
# hold 2 blocks each (with the quickstart's 4 blocks one fragment would hold 2 of them).
BASE = ["model.n_layers=6", "logging.progress=off", "checkpoint.every=0", "train.eval_every=0"]
CASES = {
    "MuLoCo": [],
    "streaming P=3 tau=0": ["sync.fragments=3"],
    "streaming P=3 tau=2": ["sync.fragments=3", "sync.overlap=2"],
    "streaming P=3 tau=2 alpha=0.5": ["sync.fragments=3", "sync.overlap=2", "sync.alpha=0.5"],
}


def run_case(overrides: list[str], out_dir: Path) -> dict:
    cfg = load_config(ROOT / "configs/quickstart.yaml", [*BASE, f"run.output_dir={out_dir}", *overrides])
    return Trainer(cfg).run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--bandwidth-mbps", type=float, default=100.0)
    parser.add_argument("--threads", type=int, default=0, help="train.threads (0 = torch's default)")
    parser.add_argument("--out", default=str(ROOT / "experiments/benchmarks/results/streaming.json"))
    args = parser.parse_args()

    results: dict[str, list[dict]] = {name: [] for name in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for name, overrides in CASES.items():  # interleaved: seeds outside, cases inside
                link = [f"backend.local.bandwidth_mbps={args.bandwidth_mbps}"]
                run_name = f"run.name={name.replace(' ', '_')}_s{seed}"
                threads = f"train.threads={args.threads}"
                summary = run_case([*overrides, *link, threads, f"run.seed={seed}", run_name], Path(tmp))
                results[name].append(summary)
                print(f"done {name} seed={seed} val={summary['final_val_loss']:.4f}", flush=True)

    plain = results["MuLoCo"]
    rows = []
    for name, runs in results.items():
        diffs = [r["final_val_loss"] - p["final_val_loss"] for r, p in zip(runs, plain, strict=True)]
        rows.append(
            {
                "case": name,
                "final_val_loss": statistics.mean(r["final_val_loss"] for r in runs),
                "val_loss_diff_vs_plain": statistics.mean(diffs),
                "peak_bytes_per_sync": runs[0]["peak_bytes_per_sync"],
                "peak_ratio": runs[0]["peak_bytes_per_sync"] / plain[0]["peak_bytes_per_sync"],
                "bytes_sent_per_worker": runs[0]["bytes_sent_per_worker"],
                "projected_wall_s": statistics.mean(r["projected_wall_s"] for r in runs),
                "projected_wall_s_no_overlap": statistics.mean(
                    r["projected_wall_s_no_overlap"] for r in runs
                ),
                "projected_network_wait_fraction": statistics.mean(
                    r["projected_network_wait_fraction"] for r in runs
                ),
                "worker_compute_s": statistics.mean(r["worker_compute_s"] for r in runs),
            }
        )
    print(f"\nK=4, {len(args.seeds)} seed(s), projection at {args.bandwidth_mbps:g} Mbit/s")
    header = (
        f"{'case':<32} {'val loss':>8} {'diff':>8} {'peak MB':>8} {'peak x':>7} {'total MB':>9} "
        f"{'proj s':>7} {'no-ovl s':>8} {'wait %':>7}"
    )
    print(header + "\n" + "-" * len(header))
    for r in rows:
        print(
            f"{r['case']:<32} {r['final_val_loss']:>8.4f} {r['val_loss_diff_vs_plain']:>+8.4f} "
            f"{r['peak_bytes_per_sync'] / 1e6:>8.3f} {r['peak_ratio']:>7.3f} "
            f"{r['bytes_sent_per_worker'] / 1e6:>9.2f} {r['projected_wall_s']:>7.1f} "
            f"{r['projected_wall_s_no_overlap']:>8.1f} {100 * r['projected_network_wait_fraction']:>6.1f}%"
        )

    # The planner for this model at the measured step time, and for a 150M model on a GPU.
    first = plain[0]
    step_here = first["worker_compute_s"] / first["inner_steps"]
    cfg = load_config(ROOT / "configs/quickstart.yaml", BASE)
    sizes = {
        f"this model ({first['params'] / 1e6:.2f}M, {step_here:.3f} s/step measured)": (
            first["params"],
            step_here,
        ),
        "150M, 16k tokens/step at 100 TFLOP/s": (150e6, estimate_step_seconds(150e6, 16384, 100.0)),
    }
    planner = []
    for label, (params, step) in sizes.items():
        for bandwidth in (100.0, 1000.0):
            table = plan(params, cfg.workers, cfg.sync.every, step, Link(bandwidth), 4, 3, 2)
            print(f"\nplanner: {label}, K={cfg.workers}, H={cfg.sync.every}, {bandwidth:g} Mbit/s")
            print(format_plan(table))
            planner.append({"model": label, "bandwidth_mbps": bandwidth, "rows": plan_as_dict(table)})

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seeds": args.seeds, "runs": rows, "planner": planner}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
