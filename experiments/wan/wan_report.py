"""The WAN headline's table, its planner check and its speed-up plot (bench_wan.py's results -> text, PNG).

A result row (one method over one link) holds what was measured; `measure` derives the table's columns,
`workload` the run as the planner sees it (muloco.net.wan.Workload), so that `planner_s` projects the
same run onto the same link and the plot onto any rate. The model is muloco.net.wan's alone (its round
trips, phases, pro-rata cut and wall-clock); here only which of a row's fields and which probe's
measurements feed it.
"""

from __future__ import annotations

import json
import math
import statistics
from functools import cache
from pathlib import Path

from wan_rows import ROWS

from muloco.config.exchange import DEFAULT_MEAN_BITS
from muloco.net.wan import Link, Workload, pro_rata, reduce_scatter_shares, sync_round_trips, wall_clock

WORKERS = 4
TRANSPORTS = ("all_reduce", "all_gather", "reduce_scatter")  # the engine's; any other: all_gather's
# A hivemind sync's local cost and the round trips of its matchmaking and streams, measured over the
# testbed at several delays (probe_hivemind.py): gloo's model does not describe it.
HIVEMIND_PROBE = Path(__file__).resolve().parent / "results/probe_hivemind.json"
# Each collective's time with no link (probe_collectives.py --loopback), and the ones a row's loopback run
# paid per sync (bench_wan.py measures its compute and local cost there): DDP's and its hooks' all-reduces,
# the engine's transport as `auto` took it on loopback. torchft's rows use their twin's loopback run;
# hivemind's local cost is its own probe's, which holds its exchange.
LOOPBACK_PROBE = Path(__file__).resolve().parent / "results/probe_collectives_loopback.json"
FP32_ALL_REDUCE = ("all_reduce fp32 pico",)
LOOPBACK_OPS = {
    "ddp": FP32_ALL_REDUCE,
    "ddp_bf16": ("all_reduce bf16 pico",),
    "ddp_powersgd": tuple(f"all_reduce PowerSGD r4 {part}" for part in ("uncompressed", "P", "Q")),
    "diloco_fp32": FP32_ALL_REDUCE,
    "muloco_fp32": FP32_ALL_REDUCE,
    "muloco_4bit": ("reduce_scatter 4-bit pico",),
    "muloco_2bit_rs": ("reduce_scatter 2-bit pico",),
    "muloco_4bit_window": ("all_gather 4-bit pico",),  # sync.transport auto: all_gather when overlapped
    "muloco_4bit_eager": ("all_gather 4-bit pico",),
    "streaming_4bit": ("all_gather 4-bit fragment",),
    "muloco_sparse": ("all_gather sparse pico",),  # sparse parts are all-gathered on every backend
    "hivemind_4bit": (),
}


@cache
def hivemind_sync() -> tuple[float, float]:
    """(local seconds, round trips) of one hivemind sync, from HIVEMIND_PROBE."""
    probe = json.loads(HIVEMIND_PROBE.read_text())
    return probe["local_s"], probe["round_trips"]


@cache
def loopback_op_s() -> dict[tuple[str, float], float]:
    """(op name, pause s) -> its median seconds on loopback, from LOOPBACK_PROBE; empty where the probe has
    not run."""
    if not LOOPBACK_PROBE.exists():
        return {}
    rows = json.loads(LOOPBACK_PROBE.read_text())["rows"]
    return {(r["op"], r["pause_s"]): r["measured_s"] for r in rows}


def loopback_transfer_s(row: dict) -> float:
    """What one sync's collectives took in `row`'s loopback run (LOOPBACK_OPS, at the probe's pause nearest
    its own: a DDP step's 30 ms of compute, a round's 0.5 s); 0 where the probe has not run."""
    measured = loopback_op_s()
    if not measured:
        return 0.0
    pause = 0.03 if row["per_step"] else 0.5
    key = row["key"] if row["key"] in LOOPBACK_OPS else ROWS[row["key"]].curve_row  # torchft: its twin's
    return sum(measured[(op, pause)] for op in LOOPBACK_OPS[key])


def round_trips_per_sync(row: dict) -> tuple[float, float]:
    """Round trips of one sync (those its bytes overlap, those they do not): a ring all-reduce per DDP
    bucket (PowerSGD: three, its P, its Q and the vectors it leaves uncompressed; pico's buffers are under
    2K MiB); the engine's transport for the others; hivemind: its probe's, which its bytes do not overlap."""
    if row["per_step"]:
        return row.get("allreduces_per_step", 1) * sync_round_trips("all_reduce", WORKERS), 0
    if row["backend"] == "hivemind":
        return 0, hivemind_sync()[1]
    transport = row["transport"] if row["transport"] in TRANSPORTS else "all_gather"
    return sync_round_trips(transport, WORKERS), 0


def sync_phases(row: dict) -> tuple[tuple[float, float], ...]:
    """A reduce_scatter row's two collectives as shares of its counted bytes: the parts at the row's bits,
    the owners' means at their default bits (compression.mean_bits); their times add
    (muloco.net.wan.reduce_scatter_shares). Others: one collective."""
    if row["per_step"] or row["backend"] == "hivemind" or row["transport"] != "reduce_scatter":
        return ()
    bits = int(ROWS[row["key"]].override("compression.bits"))
    return reduce_scatter_shares(WORKERS, bits, DEFAULT_MEAN_BITS[bits])


def workload(row: dict, steps: int, syncs: int, bytes_per_sync: float) -> Workload:
    """`row`'s run up to `steps` inner steps with `syncs` syncs of `bytes_per_sync` per worker each."""
    rounds, serial = round_trips_per_sync(row)
    # hivemind's local cost is its own (probe), not its torch twin's loopback run's.
    local = hivemind_sync()[0] if row["backend"] == "hivemind" else row.get("local_s_per_sync", 0.0)
    return Workload(
        steps=steps,
        step_compute_s=row["step_compute_s"],
        syncs=syncs,
        bytes_per_sync=bytes_per_sync,
        round_trips_per_sync=rounds,
        hidden_steps=row.get("overlap", 0),
        serial_round_trips_per_sync=serial,
        local_s_per_sync=local,
        phases=sync_phases(row),
        loopback_transfer_s=loopback_transfer_s(row),
    )


def to_target_workload(row: dict) -> Workload | None:
    """The run up to DDP's loss (None: not reached), its syncs and bytes pro rata of the whole run's."""
    steps = row["steps_to_target"]
    if steps is None:
        return None
    syncs, bytes_per_sync = pro_rata(steps, row["run_steps"], row["run_syncs"], row["run_bytes_per_worker"])
    return workload(row, steps, syncs, bytes_per_sync)


def planner_s(row: dict, link: Link) -> float | None:
    """`row`'s wall-clock to DDP's loss on `link` by muloco.net.wan's model (None: not reached)."""
    work = to_target_workload(row)
    return None if work is None else wall_clock(work, link)


def speedup_curve(
    rows: list[dict], rates_mbit: list[float], delay_ms: float
) -> dict[str, list[float | None]]:
    """Each row's wall-clock-to-DDP's-loss speed-up over DDP at each rate (the planner, from one link's
    measured tokens-to-loss, bytes and compute)."""
    ddp = next(r for r in rows if r["key"] == "ddp")
    curves = {}
    for row in rows:
        curves[row["key"]] = []
        for rate in rates_mbit:
            link = Link(rate, delay_ms)
            mine, theirs = planner_s(row, link), planner_s(ddp, link)
            curves[row["key"]].append(None if mine is None else theirs / mine)
    return curves


def headline_rows(rows: list[dict]) -> list[dict]:
    """One entry per method and ratio in merged results: the repeats of the first part that ran it there
    (a later part's runs of it, e.g. on another machine's link of the same ratio, stay in the file and its
    other tables). Ordered by ratio, highest first, then as ROWS."""
    shown = [r for r in rows if not r.get("reference")]
    first_part: dict[tuple, int] = {}
    for r in shown:
        first_part.setdefault((r["ratio"], r["key"]), r.get("part", 0))
    chosen = [r for r in shown if r.get("part", 0) == first_part[(r["ratio"], r["key"])]]
    order = list(ROWS)
    return sorted(chosen, key=lambda r: (-r["ratio"], order.index(r["key"]), r.get("repeat", 0)))


def headline_speedups(
    rows: list[dict], ratio: float, rates_mbit: list[float], delay_ms: float
) -> dict[str, list[float | None]]:
    """speedup_curve for the headline rows at one ratio, each against the DDP window of its own part (the
    one it ran beside: a part on another machine has another compute per step, so another DDP)."""
    heads = [r for r in headline_rows(rows) if r["ratio"] == ratio and r.get("repeat", 0) == 0]
    curves: dict[str, list[float | None]] = {}
    for part in dict.fromkeys(r.get("part", 0) for r in heads):
        ddp = next(
            r
            for r in rows
            if r["key"] == "ddp" and r["ratio"] == ratio and r.get("part", 0) == part and not r.get("repeat")
        )
        mine = [r for r in heads if r.get("part", 0) == part and r["key"] != "ddp"]
        curves.update(speedup_curve([ddp, *mine], rates_mbit, delay_ms))
    return curves


def format_curves(curves: dict, target: float) -> str:
    """Each row's horizons on loopback: final val loss per horizon, and the one that reaches DDP's."""
    lines = [f"DDP's final val loss (the target): {target:.4f}", "| row | horizon | final val loss per run |"]
    lines.append("|---|---|---|")
    for key, curve in curves.items():
        finals = ", ".join(f"{r['steps']}: {r['final_val_loss']:.4f}" for r in curve["runs"])
        horizon = "not reached" if curve["horizon"] is None else f"{curve['horizon']:g}x"
        lines.append(f"| {key} | {horizon} | {finals} |")
    return "\n".join(lines)


def format_table(results: list[dict]) -> str:
    header = (
        f"{'link':>16} {'method':<44} {'to DDP loss s':>13} {'vs DDP':>7} {'planner s':>9} {'steps':>6} "
        f"{'val@eq tok':>10} {'val@eq s':>9} {'wait %':>6} {'MB/worker':>9} {'wire MB':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        to = "not reached" if r["s_to_target"] is None else f"{r['s_to_target']:.0f}"
        vs = "-" if r.get("vs_ddp") is None else f"{r['vs_ddp']:.3f}"
        plan = "-" if r.get("planner_s") is None else f"{r['planner_s']:.0f}"
        steps = "-" if r["steps_to_target"] is None else str(r["steps_to_target"])
        lines.append(
            f"{r['link_label']:>16} {r['label'][:44]:<44} {to:>13} {vs:>7} {plan:>9} {steps:>6} "
            f"{_f(r.get('val_equal_tokens')):>10} {_f(r.get('val_equal_wall')):>9} "
            f"{100 * r['wait_fraction']:>5.1f}% {r['bytes_to_target'] / 1e6:>9.1f} "
            f"{r['wire_to_target'] / 1e6:>8.1f}"
        )
    return "\n".join(lines)


def format_markdown(results: list[dict]) -> str:
    lines = [
        "| link | method | to DDP's loss (s) | vs DDP | vs best DDP | planner (s) | inner steps "
        "| val loss, equal tokens | val loss, DDP's wall-clock | network wait "
        "| MB / worker (counted, wire) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        to = "not reached" if r["s_to_target"] is None else f"{r['s_to_target']:.0f}"
        how = " (window)" if r["per_step"] else ""
        vs = "-" if r.get("vs_ddp") is None else f"{r['vs_ddp']:.3f}x"
        best = "-" if r.get("vs_best_ddp") is None else f"{r['vs_best_ddp']:.3f}x"
        plan = "-" if r.get("planner_s") is None else f"{r['planner_s']:.0f}"
        steps = "-" if r["steps_to_target"] is None else f"{r['steps_to_target']:,}"
        lines.append(
            f"| {r['link_label']} | {r['label']} | {to}{how} | {vs} | {best} | {plan} | {steps} | "
            f"{_f(r.get('val_equal_tokens'))} | {_f(r.get('val_equal_wall'))} | "
            f"{100 * r['wait_fraction']:.1f}% | "
            f"{r['bytes_to_target'] / 1e6:.1f}, {r['wire_to_target'] / 1e6:.1f} |"
        )
    return "\n".join(lines)


def repeats_of(rows: list[dict]) -> int:
    return 1 + max((r.get("repeat", 0) for r in rows), default=0)


def format_repeats(rows: list[dict]) -> str:
    """The table over repeats, per row and link (markdown): the median and min-max of its wall-clock to
    DDP's loss, of its ratio to DDP's and to the fastest of DDP and its hooks ("best DDP") within the
    same repeat, of measured over planner, of its network wait and of its wall-clock over its own compute
    to the loss; the medians of its inner steps to the loss, its val loss at DDP's wall-clock and its MB
    per worker to the loss (counted, on the wire); its val loss at equal tokens (its 1x curve, one for all
    repeats)."""
    lines = [
        f"Over {repeats_of(rows)} interleaved repeats: median (min-max)",
        "| link | method | to DDP's loss (s) | vs DDP | vs best DDP | measured / planner | network wait "
        "| wall / compute | inner steps | val loss, equal tokens | val loss, DDP's wall-clock "
        "| MB / worker (counted, wire) | vs undisturbed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["link_label"], r["label"]), []).append(r)
    for (link, label), runs in groups.items():

        def values(name: str, scale: float = 1.0, runs: list[dict] = runs) -> list[float | None]:
            return [None if r.get(name) is None else r[name] * scale for r in runs]

        # DDP and its hooks: a window's median step time x the steps to the loss (extrapolated)
        how = " (window)" if runs[0].get("per_step") else ""
        spreads = [
            _spread(values("s_to_target"), "{:.0f}") + how,
            _spread(values("vs_ddp"), "{:.3f}x"),
            _spread(values("vs_best_ddp"), "{:.3f}x"),
            _spread(values("measured_over_planner"), "{:.2f}"),
            _spread(values("wait_fraction", 100), "{:.1f}%"),
            _spread(values("wall_over_compute"), "{:.2f}x"),
        ]
        mb = [_median(values(name, 1e-6), "{:.1f}") for name in ("bytes_to_target", "wire_to_target")]
        medians = [
            _median(values("steps_to_target"), "{:,.0f}"),
            _f(runs[0].get("val_equal_tokens")),
            _median(values("val_equal_wall"), "{:.4f}"),
            "-" if mb == ["-", "-"] else ", ".join(mb),
        ]
        cells = [*spreads, *medians, _spread(values("vs_undisturbed"), "{:.2f}x")]
        lines.append(f"| {link} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _median(values: list[float | None], fmt: str) -> str:
    got = [v for v in values if v is not None]
    return fmt.format(statistics.median(got)) if got else "-"


def _spread(values: list[float | None], fmt: str) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "-"
    median = fmt.format(statistics.median(got))
    missing = f", {len(values) - len(got)} not reached" if len(got) < len(values) else ""
    return f"{median} ({fmt.format(min(got))}-{fmt.format(max(got))}{missing})"


def _f(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


def plot(curves: dict, rates: list[float], points: list[dict], labels: dict[str, str], path: Path) -> None:
    """Speed-up over DDP against the link rate: the planner's lines, the measured points on them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for key, ys in curves.items():
        if key == "ddp" or all(y is None for y in ys):
            continue
        line = ax.plot(rates, [math.nan if y is None else y for y in ys], label=labels[key])[0]
        mine = [p for p in points if p["key"] == key and p.get("vs_ddp")]
        ax.scatter([p["rate_mbit"] for p in mine], [1 / p["vs_ddp"] for p in mine], color=line.get_color())
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate per worker (Mbit/s), one-way latency as measured")
    ax.set_ylabel("speed-up over DDP: wall-clock to DDP's final loss")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
