"""The headline benchmark: DDP vs DiLoCo vs MuLoCo vs streaming MuLoCo over rate-limited links.

Four workers of the `small` model (10.8M parameters), each its own host in a network namespace
(`muloco.net.testbed`), links limited with tc tbf to each rate of --rates (Mbit/s, both directions). Rows:
DDP (gradient all-reduce every step, Muon), DiLoCo fp32 H=30 (AdamW inside), MuLoCo fp32 H=30, MuLoCo 4-bit
H=30 (statistical row-wise quantization with error feedback), streaming MuLoCo 4-bit (P=3, tau=2), on the
torch backend (gloo over the emulated links), and MuLoCo 4-bit on the hivemind backend.

Per row: training seconds per 1M tokens, the fraction of them spent waiting on the network (comm_wait_s),
bytes sent per worker (counted by muloco, and on the wire by the kernel), val loss at equal tokens
(--steps), and the wall-clock to reach DDP's final val loss at the same rate. The inner lr schedule is
constant after warmup so that a longer run's first --steps steps are exactly the shorter run: the rows in
--extend run --extend-factor x longer, and their loss at equal tokens is read at step --steps of the same run.
Next to the measured times: the WAN planner's projection (muloco.net.wan.plan) from the measured step time.

    python experiments/wan/bench_wan.py                       # ~50 min on 2 cores
    python experiments/wan/bench_wan.py --steps 30 --rates 100 --rows ddp,muloco_4bit   # a quick look

Needs root and iproute2; prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import yaml

from muloco.net.testbed import Testbed, missing_requirements, train_on_testbed
from muloco.net.wan import Link, allreduce_seconds, sync_seconds

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "wan_small.yaml"
TOKENS_PER_STEP = yaml.safe_load(CONFIG.read_text())["train"]["batch_tokens"]
FOUR_BIT = ["compression.scheme=statistical", "compression.bits=4", "compression.granularity=row",
            "compression.error_feedback=true"]  # fmt: skip
# key: (label, backend, overrides)
ROWS = {
    "ddp": ("DDP (Muon, fp32 all-reduce every step)", "torch", ["method=dp"]),
    "diloco_fp32": ("DiLoCo fp32 H=30 (AdamW)", "torch", ["inner.optimizer=adamw"]),
    "muloco_fp32": ("MuLoCo fp32 H=30", "torch", []),
    "muloco_4bit": ("MuLoCo 4-bit H=30", "torch", FOUR_BIT),
    "streaming_4bit": (
        "streaming MuLoCo 4-bit P=3 tau=2",
        "torch",
        [*FOUR_BIT, "sync.fragments=3", "sync.overlap=2"],
    ),  # fmt: skip
    # target_group_size: a group starts as soon as all 4 peers are in, not after the whole matchmaking window
    "hivemind_4bit": (
        "MuLoCo 4-bit H=30, hivemind",
        "hivemind",
        [*FOUR_BIT, "backend.hivemind.target_group_size=4"],
    ),  # fmt: skip
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="100,1000", help="link rates in Mbit/s, comma-separated")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {list(ROWS)}")
    ap.add_argument("--steps", type=int, default=120, help="inner steps at equal tokens (H = 30)")
    ap.add_argument("--extend", default="muloco_4bit,streaming_4bit",
                    help="rows run longer at the lowest rate, to reach DDP's final loss")  # fmt: skip
    ap.add_argument("--extend-factor", type=float, default=2.0)
    ap.add_argument("--extend-rate", type=float, default=100.0, help="the rate (Mbit/s) of the longer runs")
    ap.add_argument("--workdir", default="runs/wan_bench")
    ap.add_argument("--out", default=str(HERE.parent / "benchmarks/results/wan.json"))
    ap.add_argument("--report-only", action="store_true", help="re-render --out's rows (no runs)")
    ap.add_argument("--merge", action="store_true", help="add the rows to --out's, replacing the same ones")
    ap.add_argument("--markdown", action="store_true", help="with --report-only: the table as markdown")
    args = ap.parse_args()
    if args.report_only:
        saved = json.loads(Path(args.out).read_text())
        report(saved["rows"], args.out, saved["command"], quiet=args.markdown)
        if args.markdown:
            print(format_markdown(saved["rows"]))
        return 0

    reason = missing_requirements()
    if reason:
        print(f"bench_wan: cannot run: {reason}", file=sys.stderr)
        return 2
    rates = [float(r) for r in args.rates.split(",")]
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        print(f"bench_wan: unknown --rows {unknown}; choose from {list(ROWS)}", file=sys.stderr)
        return 2
    extend = set(args.extend.split(",")) if args.extend else set()
    workdir = Path(args.workdir)
    results, command = [], " ".join(sys.argv)
    if args.merge and Path(args.out).exists():
        earlier = json.loads(Path(args.out).read_text())
        fresh = {(key, rate) for key in rows for rate in rates}
        results = [r for r in earlier["rows"] if (r["key"], r["rate_mbit"]) not in fresh]
        command = f"{earlier['command']}; then {command}"
    for rate in rates:
        with Testbed(4, rate) as testbed:
            for key in rows:
                steps = args.steps
                if key in extend and rate == args.extend_rate:
                    steps = int(args.steps * args.extend_factor)
                try:
                    results.append(run_row(testbed, key, rate, steps, args.steps, workdir))
                except RuntimeError as exc:  # one failed row does not cost the others
                    print(f"bench_wan: {exc}", file=sys.stderr, flush=True)
                    continue
                print(json.dumps(results[-1]["measured"]), flush=True)
                report(results, args.out, command, quiet=True)  # a partial result survives
    report(results, args.out, command)
    return 0


def report(results: list[dict], out: str, command: str, quiet: bool = False) -> None:
    order = list(ROWS)
    results.sort(key=lambda r: (r["rate_mbit"], order.index(r["key"])))
    for rate in {r["rate_mbit"] for r in results}:
        add_comparisons([r for r in results if r["rate_mbit"] == rate])
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"command": command, "rows": results}, indent=1))
    if not quiet:
        print(format_table(results))
        print(f"wrote {out}")


def run_row(testbed: Testbed, key: str, rate: float, steps: int, equal_steps: int, workdir: Path) -> dict:
    label, backend, overrides = ROWS[key]
    name = f"{key}_{rate:g}mbit"
    for old in workdir.glob(f"{name}*"):
        shutil.rmtree(old)
    overrides = [
        *overrides,
        f"run.name={name}",
        f"run.output_dir={workdir}",
        f"train.total_tokens={TOKENS_PER_STEP * steps}",
        "train.lr_schedule=constant",
        "checkpoint.resume=never",
    ]
    started = time.perf_counter()
    run = train_on_testbed(testbed, str(CONFIG), overrides, workdir / f"{name}.logs", backend, timeout_s=3600)
    if not run.ok:
        raise RuntimeError(f"{name} failed (exit codes {run.returncodes}); see {run.logs}")
    run_dir = workdir / (f"{name}-peer0" if backend == "hivemind" else name)
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["time_s"], r["val_loss"]) for r in records if r["kind"] == "eval"]
    train_s = summary["tokens_seen"] / summary["train_tokens_per_s"]
    equal = [loss for step, _, loss in evals if step <= equal_steps][-1]
    step_s = summary["worker_compute_s"] / summary["inner_steps"]
    return {
        "key": key,
        "label": label,
        "backend": backend,
        "rate_mbit": rate,
        "steps": steps,
        "measured": {
            "name": name,
            "train_s": round(train_s, 2),
            "s_per_1m_tokens": round(1e6 * train_s / summary["tokens_seen"], 1),
            "network_wait_fraction": round(summary["comm_wait_s"] / train_s, 4),
            "step_compute_s": round(step_s, 4),
            "bytes_per_worker": summary["bytes_sent_per_worker"] * equal_steps / steps,
            # whole run, set-up included (rank 0 broadcasts the initial parameters; hivemind peers load state)
            "wire_bytes_per_worker": sum(run.wire_sent) / len(run.wire_sent),
            "val_loss_equal_tokens": equal,
            "final_val_loss": summary["final_val_loss"],
            "process_wall_s": round(run.wall_s, 1),
            "harness_s": round(time.perf_counter() - started, 1),
        },
        # train clock: seconds since the first evaluation (set-up excluded, later evaluations included)
        "evals": [
            {"step": s, "train_clock_s": round(t - evals[0][1], 2), "val_loss": v} for s, t, v in evals
        ],
        "params": summary["params"],
        "payload_bytes_per_sync": summary["payload_bytes_per_sync"],
    }


def projected_s_per_1m_tokens(row: dict, step_s: float, link: Link) -> float:
    """The WAN planner's time for row's run on `link`, from the run's measured step time: every step's
    compute plus, per sync, the transfer not hidden behind overlapped steps (muloco.net.wan's link model).
    Streaming: its last sync sends every fragment at once without overlap (the run's final flush), which
    a per-outer-step plan, a steady state, leaves out."""
    K, H, P, steps = 4, 30, row["params"], row["steps"]
    compute = steps * step_s
    if row["key"] == "ddp":
        wait = steps * allreduce_seconds(link, 4.0 * P, K)
    elif row["key"] == "streaming_4bit":
        fragments, tau = 3, 2
        whole = row["payload_bytes_per_sync"]  # one replica's message, all fragments
        fragment = sync_seconds(link, whole / fragments, K, compressed=True)
        overlapped = fragments * steps // H - 1
        wait = overlapped * max(0.0, fragment - tau * step_s) + sync_seconds(link, whole, K, compressed=True)
    else:
        compressed = row["key"].endswith("4bit")
        payload = row["payload_bytes_per_sync"] if compressed else 4.0 * P
        wait = math.ceil(steps / H) * sync_seconds(link, payload, K, compressed)
    return 1e6 * (compute + wait) / (steps * TOKENS_PER_STEP)


def add_comparisons(rows: list[dict]) -> None:
    """Wall-clock to DDP's final loss (first eval at or below it) and the planner's projection."""
    ddp = next((r for r in rows if r["key"] == "ddp"), None)
    target = ddp["measured"]["val_loss_equal_tokens"] if ddp else None
    for row in rows:
        m = row["measured"]
        link, line_rate = Link(row["rate_mbit"]), Link(row["rate_mbit"], efficiency=1.0)
        m["projected_s_per_1m_tokens"] = round(projected_s_per_1m_tokens(row, m["step_compute_s"], link), 1)
        # the planner before this benchmark: payload bytes at the line rate, headers not counted
        m["projected_at_line_rate"] = round(projected_s_per_1m_tokens(row, m["step_compute_s"], line_rate), 1)
        m["measured_over_projected"] = round(m["s_per_1m_tokens"] / m["projected_s_per_1m_tokens"], 3)
        reached = next((e for e in row["evals"] if target is not None and e["val_loss"] <= target), None)
        m["s_to_ddp_loss"] = reached["train_clock_s"] if reached else None
        m["step_to_ddp_loss"] = reached["step"] if reached else None
    if ddp and ddp["measured"]["s_to_ddp_loss"]:
        for row in rows:
            m, ddp_s = row["measured"], ddp["measured"]["s_to_ddp_loss"]
            m["time_to_ddp_loss_vs_ddp"] = (
                round(m["s_to_ddp_loss"] / ddp_s, 3) if m["s_to_ddp_loss"] else None
            )


def format_table(results: list[dict]) -> str:
    header = (
        f"{'Mbit/s':>6} {'method':<40} {'s/1M tok':>8} {'planner':>8} {'wait %':>6} {'MB/worker':>9} "
        f"{'steps':>5} {'wire MB':>8} {'val@eq':>7} {'to DDP loss s':>15} {'vs DDP':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        m = r["measured"]
        to_ddp = "not reached"
        if m["s_to_ddp_loss"]:
            to_ddp = f"{m['s_to_ddp_loss']:.0f} (step {m['step_to_ddp_loss']})"
        ratio = m.get("time_to_ddp_loss_vs_ddp")
        lines.append(
            f"{r['rate_mbit']:>6g} {r['label']:<40} {m['s_per_1m_tokens']:>8.0f} "
            f"{m['projected_s_per_1m_tokens']:>8.0f} {100 * m['network_wait_fraction']:>5.1f}% "
            f"{m['bytes_per_worker'] / 1e6:>9.1f} {r['steps']:>5} {m['wire_bytes_per_worker'] / 1e6:>8.1f} "
            f"{m['val_loss_equal_tokens'] or float('nan'):>7.3f} {to_ddp:>15} "
            f"{(f'{ratio:.3f}' if ratio else '-'):>6}"
        )
    return "\n".join(lines)


def format_markdown(results: list[dict]) -> str:
    lines = [
        "| link | method | s / 1M tokens (planner) | network wait | MB / worker | wire MB / worker (steps) "
        "| val loss at equal tokens | to DDP's loss: s (step) | vs DDP |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m = r["measured"]
        to_ddp = (
            f"{m['s_to_ddp_loss']:.0f} ({m['step_to_ddp_loss']})" if m["s_to_ddp_loss"] else "not reached"
        )
        ratio = m.get("time_to_ddp_loss_vs_ddp")
        lines.append(
            f"| {r['rate_mbit']:g} Mbit/s | {r['label']} | {m['s_per_1m_tokens']:.0f} "
            f"({m['projected_s_per_1m_tokens']:.0f}) | {100 * m['network_wait_fraction']:.1f}% "
            f"| {m['bytes_per_worker'] / 1e6:.1f} | {m['wire_bytes_per_worker'] / 1e6:.1f} ({r['steps']}) "
            f"| {m['val_loss_equal_tokens']:.3f} | {to_ddp} | {f'{ratio:.2f}x' if ratio else '-'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
