"""Workers of different speeds (issue 62), measured: MuLoCo 4-bit on 4 emulated hosts over the WAN
headline's ratio-5 link, each host under its own CPU quota (the testbed's cgroup quotas: 4 hosts share the
2 cores, a host at speed v gets v x --cores-per-host cores, in every scenario including the equal one, so a
slow host's idle share never speeds up the others).

Scenarios (host speeds): equal (1, 1, 1, 1), half (1, 1, 1, 0.5), quarter (1, 1, 1, 0.25), spread
(1, 0.75, 0.5, 0.25). Rows:

    sync       every round waits for the slowest host (sync.pacing: fixed)
    by_speed   each host's inner steps sized to its measured speed (sync.pacing: by_speed, DyLU)
    drop_slow  the slowest host left out: the other hosts alone (K = 3 at the same per-worker batch)
    async      no barrier: each window applied when it arrives by delayed Nesterov, the global parameters
               on rank 0's host (sync.mode: async over torch; windows of H: a faster host hands in more)

The target is the equal-speed synchronous run's final val loss (pico's 100 outer rounds; each row at the
MuLoCo 4-bit headline row's settings, wan_rows.py). A row that trains fewer tokens a round tries longer
horizons (--horizons, x 100 rounds, wsd's decay in each horizon's last 20%) until its final loss reaches
the target; its time to the target is its train clock at its first evaluation at or below it. Also each
row's loss at the equal-speed run's train time. Repeats are interleaved (every scenario's rows, then
again); the horizons the first repeat found are the later repeats'.

    python experiments/wan/bench_speeds.py --repeats 3 --scenarios equal,half,quarter   # root; ~100 min
    python experiments/wan/bench_speeds.py --repeats 3 --scenarios spread \
        --out experiments/wan/results/bench_speeds_spread.json                           # ~1 h
    python experiments/wan/bench_speeds.py --quick                # 2 scenarios, a few rounds (< 3 min)

Needs root, iproute2 and the cgroup v1 cpu controller. Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from wan_rows import FOUR_BIT, MULOCO
from wan_runs import CONFIG, DECAY, first_at_or_below, read_run

from muloco.testbed.cpu_quota import missing_cpu_controller
from muloco.testbed.network import Testbed, missing_requirements
from muloco.testbed.train import train_on_testbed

HERE = Path(__file__).resolve().parent
RATIO5 = HERE / "results/wan_headline_59_r5.json"  # the headline's ratio-5 link: its rate and delay
SCENARIOS = {
    "equal": [1.0, 1.0, 1.0, 1.0],
    "half": [1.0, 1.0, 1.0, 0.5],
    "quarter": [1.0, 1.0, 1.0, 0.25],
    "spread": [1.0, 0.75, 0.5, 0.25],
}
ROWS = {
    "sync": ("sync.pacing=fixed",),
    "by_speed": ("sync.pacing=by_speed",),
    "drop_slow": (),
    # Delayed Nesterov at the synchronous rows' outer lr (0.7) with momentum 0.3, not pico's 0.6: 3.7% lower
    # final loss on each of 2 seeds with one host at half speed (results/async_tune.json, simulated)
    "async": ("sync.mode=async", "outer.momentum=0.3"),
}
BATCH_TOKENS = 2048  # pico's, 512 a worker
H = 15  # pico's sync.every


def ratio5_link() -> tuple[float, float]:
    link = json.loads(RATIO5.read_text())["links"][0]
    return link["rate_mbit"], link["delay_ms"]


def hosts_of(row: str, speeds: list[float]) -> list[float]:
    """The speeds of the hosts a row runs on: drop_slow leaves the slowest out."""
    if row != "drop_slow":
        return speeds
    slowest = speeds.index(min(speeds))
    return [v for i, v in enumerate(speeds) if i != slowest]


def run_row(
    row: str, scenario: str, rounds: int, horizon: float, args, repeat: int, link: tuple[float, float]
) -> dict:
    speeds = hosts_of(row, SCENARIOS[scenario])
    K = len(speeds)
    steps = round(horizon * rounds) * H
    name = f"{scenario}_{row}_h{horizon:g}_r{repeat}"
    overrides = [
        *MULOCO,
        *FOUR_BIT,
        *ROWS[row],
        f"workers={K}",
        f"train.batch_tokens={K * BATCH_TOKENS // 4}",
        f"train.total_tokens={steps * K * BATCH_TOKENS // 4}",
        "train.lr_schedule=wsd",
        f"train.decay_fraction={DECAY}",
        f"train.eval_every={args.eval_every}",
        f"run.name={name}",
        f"run.output_dir={args.workdir}",
        "checkpoint.resume=never",
        "logging.progress=off",
    ]
    cores = [v * args.cores_per_host for v in speeds]
    with Testbed(K, link[0], link[1], cpus=cores) as testbed:
        run = train_on_testbed(testbed, CONFIG, overrides, args.workdir / f"{name}.logs", "torch", 3600)
    if not run.ok:
        raise RuntimeError(f"{name} failed (exit codes {run.returncodes}); see {run.logs}")
    result = read_run(args.workdir / name)
    return {
        "row": row,
        "scenario": scenario,
        "horizon": horizon,
        "repeat": repeat,
        "speeds": speeds,
        "cores": cores,
        "evals": result["evals"],
        "final_val_loss": result["summary"]["final_val_loss"],
        "tokens_seen": result["summary"]["tokens_seen"],
        "train_s": result["evals"][-1]["train_s"],
        **round_breakdown(result),
    }


def round_breakdown(result: dict) -> dict:
    """Where a round's time went, rank 0's: compute, network wait (a sync's collectives, the slowest's
    barrier) and the rest (e.g. a blocking exchange outside the sync), in ms a round."""
    summary, train_s = result["summary"], result["evals"][-1]["train_s"]
    rounds = summary["outer_steps"]
    compute, wait = summary["worker_compute_s"], summary["comm_wait_s"]
    return {
        "rounds": rounds,
        "round_ms": round(1000 * train_s / rounds, 1),
        "compute_ms": round(1000 * compute / rounds, 1),
        "wait_ms": round(1000 * wait / rounds, 1),
        "other_ms": round(1000 * (train_s - compute - wait) / rounds, 1),
    }


def loss_at(evals: list[dict], seconds: float) -> float | None:
    """The val loss of the last evaluation at or before `seconds` of train clock."""
    before = [e for e in evals if e["train_s"] is not None and e["train_s"] <= seconds]
    return before[-1]["val_loss"] if before else None


def measure(runs: list[dict], target: float, equal_train_s: float) -> dict:
    """A row's figures from its runs at increasing horizons: the first that reaches the target."""
    reached = next((r for r in runs if r["final_val_loss"] <= target), None)
    chosen = reached or runs[-1]
    first = first_at_or_below(chosen["evals"], target) if reached else None
    return {
        "horizon": chosen["horizon"],
        "time_to_target_s": first["train_s"] if first else None,
        "loss_at_equal_time": loss_at(chosen["evals"], equal_train_s),
        "final_val_loss": chosen["final_val_loss"],
        "tokens_seen": chosen["tokens_seen"],
        **{k: chosen[k] for k in ("rounds", "round_ms", "compute_ms", "wait_ms", "other_ms") if k in chosen},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=100, help="outer rounds of the equal-speed run")
    parser.add_argument("--horizons", default="1,1.15,1.3,1.5,2", help="x rounds, tried in turn")
    parser.add_argument("--cores-per-host", type=float, default=0.5, help="a full-speed host's CPU quota")
    parser.add_argument("--eval-every", type=int, default=75)
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench_speeds"))
    parser.add_argument("--out", type=Path, default=HERE / "results/bench_speeds.json")
    parser.add_argument("--quick", action="store_true", help="2 scenarios, 6 rounds, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.scenarios, args.repeats, args.rounds, args.horizons, args.eval_every = (
            "equal,half",
            1,
            6,
            "1,1.5",
            30,
        )
        args.out = args.workdir / "quick.json"
    reason = missing_requirements() or missing_cpu_controller()
    if reason:
        print(f"bench_speeds: cannot run: {reason}", file=sys.stderr)
        return 2
    scenarios, rows = args.scenarios.split(","), args.rows.split(",")
    unknown = [s for s in scenarios if s not in SCENARIOS] + [r for r in rows if r not in ROWS]
    if unknown:
        print(f"bench_speeds: unknown scenarios or rows {unknown}", file=sys.stderr)
        return 2
    horizons = [float(h) for h in args.horizons.split(",")]
    link = ratio5_link()
    args.workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    found: dict[tuple[str, str], float] = {}  # the first repeat's horizon per (scenario, row)
    results = []
    for repeat in range(args.repeats):
        equal = run_row("sync", "equal", args.rounds, 1.0, args, repeat, link)
        target, equal_s = equal["final_val_loss"], equal["train_s"]
        for scenario in scenarios:
            for row in rows:
                if scenario == "equal" and row in ("sync", "drop_slow"):
                    continue  # sync is the reference run; no host is slow to drop
                tries = [found[(scenario, row)]] if (scenario, row) in found else horizons
                runs = []
                for horizon in tries:
                    runs.append(run_row(row, scenario, args.rounds, horizon, args, repeat, link))
                    if runs[-1]["final_val_loss"] <= target:
                        break
                figures = measure(runs, target, equal_s)
                found.setdefault((scenario, row), figures["horizon"])
                results.append({"repeat": repeat, "scenario": scenario, "row": row, **figures})
        results.append(
            {"repeat": repeat, "scenario": "equal", "row": "sync", **measure([equal], target, equal_s)}
        )
        for r in results:
            if r["repeat"] == repeat:
                r["vs_equal_sync"] = r["time_to_target_s"] / equal_s if r["time_to_target_s"] else None
        # Written after every repeat: a run cut short keeps the repeats it finished
        table = summarize(results)
        payload = {
            "command": " ".join(sys.argv),
            "link": {"rate_mbit": link[0], "delay_ms": link[1]},
            "cores_per_host": args.cores_per_host,
            "scenarios": {s: SCENARIOS[s] for s in scenarios},
            "repeats_done": repeat + 1,
            "runs": results,
            "table": table,
            "bench_s": round(time.perf_counter() - started, 1),
        }
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(format_table(table))
    print(f"wrote {args.out}")
    return 0


def summarize(results: list[dict]) -> list[dict]:
    """Per (scenario, row): the median and range over the repeats of time to target (x equal sync's)."""
    table = []
    keys = sorted(
        {(r["scenario"], r["row"]) for r in results}, key=lambda k: (list(SCENARIOS).index(k[0]), k[1])
    )
    for scenario, row in keys:
        mine = [r for r in results if (r["scenario"], r["row"]) == (scenario, row)]
        ratios = [r["vs_equal_sync"] for r in mine if r["vs_equal_sync"] is not None]
        losses = [r["loss_at_equal_time"] for r in mine if r["loss_at_equal_time"] is not None]
        table.append(
            {
                "scenario": scenario,
                "row": row,
                "repeats": len(mine),
                "reached": len(ratios),
                "vs_equal_sync_median": statistics.median(ratios) if ratios else None,
                "vs_equal_sync_range": [min(ratios), max(ratios)] if ratios else None,
                "loss_at_equal_time_median": statistics.median(losses) if losses else None,
                "horizon": mine[0]["horizon"],
            }
        )
    return table


def format_table(table: list[dict]) -> str:
    lines = [
        "| scenario | row | time to equal sync's loss (x equal sync) | loss at equal sync's time | horizon |",
        "|---|---|---|---|---|",
    ]
    for t in table:
        if t["vs_equal_sync_median"] is None:
            time_cell = f"not reached ({t['reached']}/{t['repeats']})"
        else:
            lo, hi = t["vs_equal_sync_range"]
            time_cell = f"{t['vs_equal_sync_median']:.2f}x ({lo:.2f}-{hi:.2f})"
        loss = t["loss_at_equal_time_median"]
        loss_cell = f"{loss:.4f}" if loss is not None else ""
        lines.append(f"| {t['scenario']} | {t['row']} | {time_cell} | {loss_cell} | {t['horizon']:g}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
