"""The WAN headline: wall-clock to DDP's final loss over emulated links, DDP and its hooks against DiLoCo and
MuLoCo (issue 36).

The regime is pico's (configs/pico.yaml: K = 4, H = 15, 1,500 inner steps = 100 outer steps for DDP's
budget; each row at its tuned lr, wsd with its decay in its own horizon's last 20%: wan_rows.py). The links
model named deployments by DDP's all-reduce time over its compute time per step (docs/wan.md): the compute
per DDP step is measured here and each ratio's rate solved for (calibrate_links.py), every link with the same
one-way delay (the hub's delay line); a ratio that this delay alone exceeds gets no added delay (a LAN) and
the table says so.

1. Curves (loopback, wan_runs.py): DDP's 1x run sets the target, its final val loss. Each other row trains
   horizons of --horizons x DDP's steps in turn until one ends at or below the target (at most 3x),
   starting from the committed headline's horizon (--expect-horizons), and its 1x run (equal tokens). A
   torch row whose expected horizon's next shorter misses leaves that horizon to its first link run (the
   same losses): find_horizons' `deferred`.
2. Links (the testbed, 4 hosts): each row over each link. A low-communication row runs in full at its
   horizon, and its wall-clock is its train clock to its first evaluation at or below the target. A
   per-step row (DDP, + PowerSGD, + bf16) runs a window of --window steps over the link: its median step
   time, all-reduces included, times the steps its curve needs (over a slow link a full run takes hours).
   A compute-bound link (ratio <= 1) runs --compute-bound-rows only: DDP, its hooks and MuLoCo 4-bit's
   fastest forms (what the low-communication rows cost where communication is cheap). Before its rows, a
   link's rate is re-solved from DDP windows over it until DDP measures the link's ratio within
   --solve-within (the model leaves out gloo's segments and the cores the processes share); with
   --check-ddp, DDP runs once more after them to check the windows' extrapolation: in full at ratios up to
   --full-run-ratio, over a --check-window window above.
3. Report (wan_report.py): the table, each row against DDP and against the fastest of DDP and its hooks
   in the same repeat ("vs best DDP"), the planner's projection of each measured run (muloco.net.wan),
   and with --plots the planner's speed-up over DDP from 1 Mbit/s to 10 Gbit/s with the measured points.

    python experiments/wan/bench_wan.py --plots docs/img          # everything (root; 76 min at 25.6 ms/step)
    python experiments/wan/bench_wan.py --quick                   # two rows, a few outer steps (< 2 min)
    python experiments/wan/bench_wan.py --report-only --markdown  # the headline's table again, from its JSON
    python experiments/wan/bench_wan.py --curves-only
        # the curves (no testbed), each row's committed horizon tried first, then the next shorter: about
        # half the runs of the search without it (--expect-horizons none)
    python experiments/wan/bench_wan.py --reuse-curves --ratios 50 --rows ddp,muloco_4bit --repeats 3
        # each link's rows 3 times, interleaved: the table of the first, and each row's median (min-max)
        # of its time and of its ratio to the DDP window of its own repeat

Needs root and iproute2 (the testbed). Prints the table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from calibrate_links import link_for
from wan_report import (
    format_curves,
    format_markdown,
    format_repeats,
    format_table,
    headline_rows,
    headline_speedups,
    planner_s,
    plot,
    repeats_of,
)
from wan_rows import ROWS, Row
from wan_runs import completed_curve, first_at_or_below, keep_as_curve, loopback_curve, on_link

from muloco.net.wan import Link
from muloco.testbed.network import Testbed, missing_requirements

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BATCH_TOKENS = 2048  # pico's
WORKERS = 4
# The headline docs/wan.md and README quote (scripts/figures/wan.py): --report-only renders it, a full run
# writes it, and its rows' horizons are tried first.
HEADLINE = HERE / "results/wan_headline_repeats.json"
EXPECTED = HEADLINE
QUICK_HORIZONS = {"muloco_4bit": 2.0}  # --quick: its 2x run is the link's (find_horizons' deferred)
COMPUTE_BOUND_ROWS = (
    "ddp",
    "ddp_powersgd",
    "ddp_bf16",
    "muloco_4bit",
    "muloco_4bit_window",
    "muloco_4bit_eager",
    "streaming_4bit",
)
SOLVE_TRIES = 4  # DDP windows a link's rate may take to land on its ratio (--solve-within)
PLOT_RATES = [10 ** (k / 8) for k in range(0, 33)]  # 1 Mbit/s to 10 Gbit/s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {list(ROWS)}")
    ap.add_argument("--steps", type=int, default=1500, help="DDP's inner steps (its budget)")
    ap.add_argument("--horizons", default="1,1.5,2,3", help="x DDP's steps (find_horizons)")
    ap.add_argument("--ratios", default="50,5,0.5", help="DDP's all-reduce / compute per step, per link")
    ap.add_argument("--delay-ms", type=float, default=20.0, help="one way, every link that can have it")
    ap.add_argument("--window", type=int, default=40, help="steps a per-step row runs over a link")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every row over each link, interleaved")
    ap.add_argument(
        "--solve-within",
        type=float,
        default=0.05,
        help="re-solve each link's rate from DDP windows over it until DDP's measured ratio is within this "
        "fraction of its name (0: the model's rate as solved)",
    )
    ap.add_argument(
        "--check-ddp",
        action="store_true",
        help="after a link's repeats, DDP once more over it to check the window's extrapolation: a full run "
        "at ratios <= --full-run-ratio, a --check-window window above",
    )
    ap.add_argument(
        "--full-run-ratio", type=float, default=5.0, help="--check-ddp's full runs: ratios up to this"
    )
    ap.add_argument(
        "--check-window", type=int, default=300, help="--check-ddp's window above --full-run-ratio"
    )
    ap.add_argument("--eval-every", type=int, default=45, help="inner steps (3 outer steps)")
    ap.add_argument("--quick", action="store_true", help="ddp and muloco_4bit, 60 steps, one link (< 2 min)")
    ap.add_argument("--workdir", type=Path, default=ROOT / "runs/wan_headline")
    ap.add_argument(
        "--out",
        type=Path,
        help=f"the results JSON (default: the headline, {HEADLINE.relative_to(ROOT)}; --quick: quick.json in "
        "--workdir)",
    )
    ap.add_argument("--plots", type=Path, help="write the speed-up plot (wan_speedup.png) here")
    ap.add_argument(
        "--reuse-curves",
        action="store_true",
        help="read completed loopback runs in --workdir (each search starts at the shortest that reaches)",
    )
    ap.add_argument(
        "--expect-horizons",
        type=Path,
        default=EXPECTED,
        help="a results JSON whose rows' horizons are tried first (about half the curves' runs; default: the "
        "committed headline's, if there; 'none': the grid search alone)",
    )
    ap.add_argument(
        "--compute-bound-rows",
        default=",".join(COMPUTE_BOUND_ROWS),
        help="the rows of --rows a link of ratio <= 1 runs ('all': every row)",
    )
    ap.add_argument("--curves-only", action="store_true", help="phase 1 only (no testbed needed)")
    ap.add_argument("--report-only", action="store_true", help="re-render --out (no runs)")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = ap.parse_args()
    if args.quick:  # <= 2 minutes (issue 36): 1x misses DDP's loss, 2x (the link's run) reaches it
        args.rows, args.steps, args.horizons, args.ratios = "ddp,muloco_4bit", 60, "1,2", "50"
        args.window, args.eval_every, args.solve_within = 6, 15, 0.0
    if args.out is None:
        args.out = args.workdir / "quick.json" if args.quick else HEADLINE
    if args.report_only:
        saved = json.loads(args.out.read_text())
        return report(saved, args, runs_s=None)

    reason = None if args.curves_only else missing_requirements()
    if reason:
        print(f"bench_wan: cannot run: {reason}", file=sys.stderr)
        return 2
    keys = [k for k in args.rows.split(",") if k]
    compute_bound = keys if args.compute_bound_rows == "all" else args.compute_bound_rows.split(",")
    unknown = [k for k in (*keys, *compute_bound) if k not in ROWS]
    if unknown or "ddp" not in keys:
        print(
            f"bench_wan: --rows needs ddp and names from {list(ROWS)} (unknown: {unknown})", file=sys.stderr
        )
        return 2
    rows = [ROWS[k] for k in keys]
    horizons = [float(h) for h in args.horizons.split(",")]
    started = time.perf_counter()

    # 1. Curves on loopback: the target, and each row's horizon.
    try:
        expected = QUICK_HORIZONS if args.quick else expected_horizons(args.expect_horizons)
    except (OSError, ValueError, KeyError) as exc:
        print(
            f"bench_wan: --expect-horizons: {exc} (a results JSON of bench_wan.py, or 'none')",
            file=sys.stderr,
        )
        return 2
    ratios = [float(r) for r in args.ratios.split(",")]
    on_first = rows_over(ratios[0], rows, compute_bound)
    deferred = frozenset() if args.curves_only else first_link_curves(rows, on_first)
    curves = find_horizons(
        rows,
        args.steps,
        horizons,
        args.workdir / "curves",
        args.eval_every,
        args.reuse_curves,
        expected,
        deferred,
    )
    phase_s = {"curves": round(time.perf_counter() - started, 1)}
    ddp_curve = curves["ddp"]
    ddp_summary = ddp_curve["runs"][0]["summary"]
    target = ddp_summary["final_val_loss"]
    compute_s = ddp_summary["worker_compute_s"] / ddp_summary["inner_steps"]
    links = choose_links(ratios, compute_s, ddp_curve, args.delay_ms)
    print(
        f"target: DDP's final val loss {target:.4f}; compute {compute_s * 1e3:.1f} ms per DDP step; links: "
        + ", ".join(f"ratio {link['ratio']:g}: {link['label']}" for link in links),
        flush=True,
    )
    saved = {
        "command": " ".join(sys.argv),
        "target_val_loss": target,
        "compute_s_per_ddp_step": compute_s,
        "links": links,
        "curves": {k: summarize_curve(c) for k, c in curves.items()},
        "rows": [],
    }
    if args.curves_only:
        return report(saved, args, runs_s=time.perf_counter() - started)

    # 2. Every row over every link.
    results, checks = [], []
    for link in links:
        link_started = time.perf_counter()
        if args.solve_within > 0:
            solve_rate(link, curves, args)
        with Testbed(WORKERS, link["rate_mbit"], link["delay_ms"]) as testbed:
            # Where communication is cheap (ratio <= 1) the question is only what the low-communication
            # rows cost: the per-step rows and MuLoCo's fastest forms answer it (the default subset).
            here = rows_over(link["ratio"], rows, compute_bound)
            if len(here) < len(rows):
                skipped = ",".join(r.key for r in rows if r not in here)
                print(f"{link['label']}: compute-bound, skips {skipped} (--compute-bound-rows all runs them)")
            for repeat, row in ((i, row) for i in range(args.repeats) for row in here):
                run = run_over(testbed, row, curves, args)
                if "confirm" in curves[row.key]:  # its horizon's run was this one (find_horizons)
                    stands = confirm_on_link(curves, row.key, run)
                    if run is not None and not stands:
                        print(f"{row.key}: its expected horizon missed DDP's loss; runs again", flush=True)
                        run = run_over(testbed, row, curves, args)
                if run is None:
                    continue
                curve = curves[row.curve_row]
                results.append({**measure(row, link, curve, run, target), "repeat": repeat})
                print(
                    json.dumps({k: results[-1][k] for k in ("key", "link_label", "s_to_target")}), flush=True
                )
            if args.check_ddp:
                here_ddp = [r for r in results if r["key"] == "ddp" and r["link_label"] == link["label"]]
                checks.append(check_extrapolation(testbed, link, curves, here_ddp, target, args))
        # (a link's time includes the loopback runs its rows' confirmations needed, if any)
        phase_s[f"ratio {link['ratio']:g}"] = round(time.perf_counter() - link_started, 1)
    for key in [k for k, c in curves.items() if "confirm" in c]:  # its row never ran: train it here
        confirm_on_link(curves, key, None)
    saved["phase_s"] = phase_s
    if checks:
        saved["ddp_checks"] = checks
    saved["curves"] = {k: summarize_curve(c) for k, c in curves.items()}
    saved["rows"] = results
    return report(saved, args, runs_s=time.perf_counter() - started)


def find_horizons(
    rows: list[Row],
    steps: int,
    horizons: list[float],
    workdir: Path,
    eval_every: int,
    reuse: bool,
    expected: dict[str, float] | None = None,
    deferred: frozenset[str] = frozenset(),
) -> dict:
    """Per curve row: the shortest of `horizons` (x DDP's steps) whose run ends at or below DDP's final loss
    (None: not even the longest). Without an expected horizon: tried shortest, longest, then the others
    upwards (a row that never gets there costs two runs, not all of them). With one (an earlier run's,
    --expect-horizons): that one first, then down the grid while it reaches, or up until it does: a row
    whose expectation holds costs it and the next shorter. reuse without one: the shortest completed run
    in `workdir` that reaches is the expectation (so no horizon the search can skip is trained). Every
    row's 1x run is trained too: its loss at DDP's tokens.

    A row in `deferred` (it runs over the first link before any row that reads its curve) with an
    expected horizon above the shortest trains only the next shorter here: if that misses, its expected
    horizon's run is the first link's (a torch row's losses there are its loopback losses, bit for bit),
    and its curve is pending until `confirm_on_link` (about a tenth of the one command's time saved)."""
    ddp = loopback_curve(ROWS["ddp"], steps, BATCH_TOKENS, workdir, eval_every, reuse)
    curves = {"ddp": {"runs": [ddp], "chosen": ddp, "local": ddp, "horizon": 1.0, "steps": steps}}
    target = ddp["summary"]["final_val_loss"]
    if reuse and expected is None:  # the completed runs say where each search starts: no longer runs
        expected = reached_before(rows, steps, horizons, workdir, eval_every, target)
    for key in curve_keys(rows):
        search = HorizonSearch(key, steps, horizons, workdir, eval_every, reuse, target)
        guess = (expected or {}).get(key)
        if guess in horizons[1:] and key in deferred and not search.completed(guess):
            below = horizons[horizons.index(guess) - 1]
            if not search.reaches(below):  # the guess is the shortest if it reaches: the first link says
                curves[key] = search.pending(guess, below)
                continue
            reached = _search_from(horizons, horizons.index(below), search.reaches)
        elif guess in horizons:
            reached = _search_from(horizons, horizons.index(guess), search.reaches)
        else:
            reached = _search_grid(horizons, search.reaches)
        curves[key] = search.curve(reached)
    return curves


class HorizonSearch:
    """One curve row's loopback runs, each horizon trained at most once, and the curve they give."""

    def __init__(
        self,
        key: str,
        steps: int,
        horizons: list[float],
        workdir: Path,
        eval_every: int,
        reuse: bool,
        target: float,
    ) -> None:
        self.row, self.steps, self.horizons, self.target = ROWS[key], steps, horizons, target
        self.workdir, self.eval_every, self.reuse = workdir, eval_every, reuse
        self.runs: dict[float, dict] = {}

    def completed(self, h: float) -> bool:
        """A completed run of horizon `h` is in the workdir to reuse."""
        return (
            self.reuse
            and completed_curve(self.row, round(h * self.steps), BATCH_TOKENS, self.workdir, self.eval_every)
            is not None
        )

    def reaches(self, h: float) -> bool:
        if h not in self.runs:
            self.runs[h] = loopback_curve(
                self.row, round(h * self.steps), BATCH_TOKENS, self.workdir, self.eval_every, self.reuse
            )
            print(f"curve {self.row.key} {h:g}x: final {self._final(h):.4f}", flush=True)
        return self._final(h) <= self.target

    def _final(self, h: float) -> float:
        return self.runs[h]["summary"]["final_val_loss"]

    def curve(self, reached: float | None, local: dict | None = None) -> dict:
        """The link runs the row at its horizon; one that never gets there at DDP's (its time, its loss
        then). Its 1x run is trained too (its loss at DDP's tokens). `local`: the loopback run whose time
        less its compute gives the planner the row's local cost per sync (by default the chosen run's)."""
        chosen = reached if reached is not None else self.horizons[0]
        for h in (chosen, *([1.0] if 1.0 in self.horizons else [])):
            self.reaches(h)
        return self._as_curve(self.runs[chosen], local or self.runs[chosen], reached, chosen)

    def _as_curve(self, chosen: dict | None, local: dict, horizon: float | None, at: float) -> dict:
        """The curve's fields: its runs so far, the chosen one (None: pending), the loopback run for the
        local cost, its horizon (None: none reached) and the steps the links run (`at` x DDP's)."""
        runs = [self.runs[h] for h in sorted(self.runs)]
        return {
            "runs": runs,
            "chosen": chosen,
            "local": local,
            "horizon": horizon,
            "steps": round(at * self.steps),
        }

    def pending(self, guess: float, below: float) -> dict:
        """The curve before its first link run: `guess`'s steps, and `below`'s run for the local cost."""
        if 1.0 in self.horizons:
            self.reaches(1.0)
        local = self.runs[below]
        curve = self._as_curve(None, local, guess, guess)
        return {**curve, "confirm": lambda run: self._confirm(guess, local, run)}

    def _confirm(self, guess: float, local: dict, link_run: dict | None) -> tuple[dict, bool]:
        """The curve once the first link has run `guess` (None: that run failed, train it here). True
        with it when that run stands; False when the guess missed and the row must run again at the
        horizon the search found upwards from it."""
        if link_run is not None:
            self.runs[guess] = link_run
        i = self.horizons.index(guess)
        reached = next((h for h in self.horizons[i:] if self.reaches(h)), None)
        stands = link_run is not None and reached == guess
        if stands:  # kept with the loopback runs, so that --reuse-curves finds it there
            keep_as_curve(
                self.row, round(guess * self.steps), BATCH_TOKENS, link_run, self.workdir, self.eval_every
            )
        return self.curve(reached, local), stands


def confirm_on_link(curves: dict, key: str, link_run: dict | None) -> bool:
    """Settle a pending curve (find_horizons' `deferred`) with its row's first link run: True when that run
    is the curve's (its horizon held), False when the row must run over the link again at its new steps.
    A loopback run the settling needs that fails leaves the expected horizon, unconfirmed, and the link's
    run as measured (the results so far are not lost)."""
    try:
        curve, stands = curves[key]["confirm"](link_run)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(
            f"bench_wan: {key}: {exc}; its expected horizon stands unconfirmed", file=sys.stderr, flush=True
        )
        del curves[key]["confirm"]
        return True
    curves[key] = curve
    return stands


def rows_over(ratio: float, rows: list[Row], compute_bound: list[str]) -> list[Row]:
    """The rows a link of `ratio` runs: all of them, or where communication is cheap (ratio <= 1) only
    `compute_bound`'s (--compute-bound-rows)."""
    return [r for r in rows if ratio > 1 or r.key in compute_bound]


def first_link_curves(rows: list[Row], on_first: list[Row]) -> frozenset[str]:
    """The curve rows whose horizon's loopback run the first link's run can stand in for (find_horizons'
    `deferred`): torch rows (a twin on another backend has other losses) that run over the first link,
    each before every row that reads its curve (so those run at its confirmed steps)."""
    order = [r.key for r in rows]
    return frozenset(
        r.key
        for r in on_first
        if r.backend == "torch"
        and not r.per_step
        and r.twin is None
        and all(order.index(t.key) > order.index(r.key) for t in rows if t.curve_row == r.key and t is not r)
    )


def run_over(testbed: Testbed, row: Row, curves: dict, args) -> dict | None:
    """`row` over the testbed at its curve's steps (a per-step row: a window); None if it failed (one failed
    row does not cost the others)."""
    try:
        return on_link(
            testbed,
            row,
            curves[row.curve_row]["steps"],
            BATCH_TOKENS,
            args.workdir / "links",
            args.eval_every,
            args.window if row.per_step else None,
        )
    except RuntimeError as exc:
        print(f"bench_wan: {exc}", file=sys.stderr, flush=True)
        return None


def curve_keys(rows: list[Row]) -> list[str]:
    """The rows whose own loopback curves the search finds (a twin's row reads its twin's), DDP's aside."""
    return list(dict.fromkeys(r.curve_row for r in rows if r.curve_row != "ddp"))


def reached_before(
    rows: list[Row], steps: int, horizons: list[float], workdir: Path, eval_every: int, target: float
) -> dict[str, float]:
    """Per curve row: the shortest horizon whose completed run in `workdir` reaches `target` (--reuse-curves
    without --expect-horizons; rows with none are left to the grid)."""
    reached = {}
    for key in curve_keys(rows):
        for h in horizons:
            run = completed_curve(ROWS[key], round(h * steps), BATCH_TOKENS, workdir, eval_every)
            if run is not None and run["summary"]["final_val_loss"] <= target:
                reached[key] = h
                break
    return reached


def expected_horizons(results: Path | None) -> dict[str, float] | None:
    """Each curve row's horizon in an earlier results JSON (those that reached DDP's loss there); None for
    no file ('none', or the default one where a checkout lacks it)."""
    if results is None or str(results) == "none" or (results == EXPECTED and not results.exists()):
        return None
    curves = json.loads(results.read_text())["curves"]
    return {key: c["horizon"] for key, c in curves.items() if c.get("horizon") is not None}


def _search_grid(horizons: list[float], reaches) -> float | None:
    """The shortest horizon that `reaches`: the shortest, the longest, then the others upwards."""
    if reaches(horizons[0]):
        return horizons[0]
    if len(horizons) == 1 or not reaches(horizons[-1]):
        return None
    return next((h for h in horizons[1:-1] if reaches(h)), horizons[-1])


def _search_from(horizons: list[float], i: int, reaches) -> float | None:
    """The shortest horizon that `reaches`, starting at horizons[i]: down while it reaches, else up."""
    if reaches(horizons[i]):
        while i > 0 and reaches(horizons[i - 1]):
            i -= 1
        return horizons[i]
    return next((h for h in horizons[i + 1 :] if reaches(h)), None)


def choose_links(ratios: list[float], compute_s: float, ddp_curve: dict, delay_ms: float) -> list[dict]:
    """Each ratio's rate at `delay_ms` one way; where that delay's round trips would make DDP's all-reduce
    latency-bound (calibrate_links.link_for), at the largest whole-ms delay that keeps it byte-bound."""
    gradients = 4 * ddp_curve["runs"][0]["summary"]["params"]  # fp32
    links = []
    for ratio in ratios:
        solved, delay = link_for(ratio, compute_s, gradients, WORKERS, delay_ms), delay_ms
        if solved["rate_mbit"] is None:
            delay = solved["latency_ms_max"]
            solved = link_for(ratio, compute_s, gradients, WORKERS, delay)
        label = f"{solved['rate_mbit']:.3g} Mbit/s {delay:g} ms"
        links.append(
            {"ratio": ratio, "rate_mbit": round(solved["rate_mbit"], 2), "delay_ms": delay, "label": label}
        )
    return links


def solve_rate(link: dict, curves: dict, args) -> None:
    """Re-solve `link`'s rate (in place) until a DDP window over it measures its ratio within
    --solve-within: the model's rate misses it by what it leaves out (gloo's segments, the processes that
    share the cores), so each try scales the rate by measured / named ratio. The tries go in `link`."""
    ddp = ROWS["ddp"]
    loopback = curves["ddp"]["chosen"]["summary"]
    compute = loopback["worker_compute_s"] / loopback["inner_steps"]
    tries = []
    for _ in range(SOLVE_TRIES):
        with Testbed(WORKERS, link["rate_mbit"], link["delay_ms"]) as testbed:
            run = run_over(testbed, ddp, curves, args)
        if run is None:
            break
        measured = (run["step_s_median"] - compute) / compute
        tries.append({"rate_mbit": link["rate_mbit"], "ratio_measured": round(measured, 3)})
        print(
            f"ratio {link['ratio']:g} at {link['rate_mbit']} Mbit/s: DDP measures {measured:.2f}", flush=True
        )
        if abs(measured / link["ratio"] - 1) <= args.solve_within:
            break
        link["rate_mbit"] = round(link["rate_mbit"] * measured / link["ratio"], 2)
    link["solve_tries"] = tries
    link["label"] = f"{link['rate_mbit']:.3g} Mbit/s {link['delay_ms']:g} ms"


def check_extrapolation(
    testbed: Testbed, link: dict, curves: dict, windows: list[dict], target: float, args
) -> dict:
    """DDP over `link` once more, longer than the repeats' windows (`windows`): a full run at ratios up to
    --full-run-ratio (its train clock to DDP's loss), else a --check-window window (its median step time x
    the steps to the loss), against the windows' median extrapolation."""
    full = link["ratio"] <= args.full_run_ratio
    steps = curves["ddp"]["steps"]
    run = on_link(
        testbed,
        ROWS["ddp"],
        steps,
        BATCH_TOKENS,
        args.workdir / "links",
        args.eval_every,
        None if full else args.check_window,
    )
    to_target = first_at_or_below(curves["ddp"]["chosen"]["evals"], target)["step"]
    if full:
        t0 = run["evals"][0]["train_s"]
        measured = first_at_or_below(run["evals"], target)["train_s"] - t0
    else:
        measured = run["step_s_median"] * to_target
    extrapolated = statistics.median(r["s_to_target"] for r in windows)
    out = {
        "ratio": link["ratio"],
        "link_label": link["label"],
        "kind": "full run" if full else f"{args.check_window}-step window",
        "measured_s": round(measured, 1),
        "window_steps": args.window,
        "extrapolated_s": round(extrapolated, 1),
        "extrapolated_over_measured": round(extrapolated / measured, 3),
        "process_wall_s": run["process_wall_s"],
    }
    print(f"DDP check at ratio {link['ratio']:g}: {json.dumps(out)}", flush=True)
    return out


def local_s_per_sync(loopback: dict, per_step: bool) -> float:
    """What a sync (a per-step row: a step) costs beyond compute on this machine with no link to pay: a
    loopback run's train time less its compute, per sync. Its codec and outer step, and the processes
    that share 2 cores waiting for the slowest at each collective: the planner adds it to every sync."""
    train_s = loopback["tokens_seen"] / loopback["train_tokens_per_s"]
    syncs = loopback["inner_steps"] if per_step else loopback["fragment_syncs"]
    return max(0.0, train_s - loopback["worker_compute_s"]) / max(1, syncs)


def measure(row: Row, link: dict, curve: dict, run: dict, target: float) -> dict:
    """One table row: `row` over `link`, from its run there and its curve."""
    summary = run["summary"]
    out = {
        "key": row.key,
        "label": row.label,
        "backend": row.backend,
        "per_step": row.per_step,
        "link_label": link["label"],
        "rate_mbit": link["rate_mbit"],
        "delay_ms": link["delay_ms"],
        "ratio": link["ratio"],
        "horizon": curve["horizon"],
        "transport": summary.get("transport"),
        "overlap": summary.get("overlap") or 0,
        "process_wall_s": run["process_wall_s"],
        "local_s_per_sync": local_s_per_sync(curve["local"]["summary"], row.per_step),
    }
    if row.per_step:
        final = curve["chosen"]
        step_s = run["step_s_median"]
        reached = first_at_or_below(final["evals"], target)
        steps = reached["step"] if reached else None
        # Its compute on loopback: under a hook DDP's all-reduce runs inside the backward pass, so the
        # window's own compute time would include the link's.
        compute = final["summary"]["worker_compute_s"] / final["summary"]["inner_steps"]
        # On the wire per byte counted, from the link's run (its warm-up steps included; PowerSGD's are
        # plain all-reduces), applied to the bytes its curve counts to the target.
        wire_per_counted = run["wire_bytes_per_worker"] / summary["bytes_sent_per_worker"]
        out.update(
            step_s=step_s,
            step_s_spread=run["step_s_spread"],
            window_steps=run["window_steps"],
            step_compute_s=compute,
            steps_to_target=steps,
            s_to_target=None if steps is None else step_s * steps,
            wait_fraction=max(0.0, 1 - compute / step_s),
            run_steps=final["summary"]["inner_steps"],
            run_syncs=final["summary"]["inner_steps"],
            run_bytes_per_worker=final["summary"]["bytes_sent_per_worker"],
            allreduces_per_step=3 if row.override("dp.comm_hook") == "powersgd" else 1,
            ratio_measured=(step_s - compute) / compute,
        )
        out["bytes_to_target"] = out["run_bytes_per_worker"] * (steps or out["run_steps"]) / out["run_steps"]
        out["wire_to_target"] = wire_per_counted * out["bytes_to_target"]
        out["evals"] = [{**e, "clock_s": e["step"] * step_s} for e in final["evals"]]
    else:
        # The train clock: evaluations are the benchmark's, not the method's (the per-step rows' clock,
        # their step time x steps, has none either).
        clock = "train_s" if run["evals"][0].get("train_s") is not None else "time_s"
        t0 = run["evals"][0][clock]
        evals = [{**e, "clock_s": e[clock] - t0} for e in run["evals"]]
        reached = first_at_or_below(evals, target)
        train_s = summary["tokens_seen"] / summary["train_tokens_per_s"]
        out.update(
            step_compute_s=summary["worker_compute_s"] / summary["inner_steps"],
            steps_to_target=reached["step"] if reached else None,
            s_to_target=reached["clock_s"] if reached else None,
            wait_fraction=summary["comm_wait_s"] / train_s,
            run_steps=summary["inner_steps"],
            run_syncs=summary["fragment_syncs"],
            run_bytes_per_worker=summary["bytes_sent_per_worker"],
            evals=evals,
        )
        share = (out["steps_to_target"] or out["run_steps"]) / out["run_steps"]
        out["bytes_to_target"] = out["run_bytes_per_worker"] * share
        out["wire_to_target"] = run["wire_bytes_per_worker"] * share
    return out


def fastest_baseline(here: list[dict]) -> dict | None:
    """The strongest baseline among rows that ran side by side: the fastest of DDP and its hooks (the
    per-step rows) to DDP's loss; None where none reached it."""
    reached = [r for r in here if r["per_step"] and r["s_to_target"]]
    return min(reached, key=lambda r: r["s_to_target"], default=None)


def equal_tokens_loss(curves: dict, key: str) -> float | None:
    """A row's final val loss at DDP's tokens: its curve's run of DDP's length (None: not trained)."""
    ddp_steps = curves["ddp"]["runs"][0]["steps"]
    return next((r["final_val_loss"] for r in curves[key]["runs"] if r["steps"] == ddp_steps), None)


def summarize_curve(curve: dict) -> dict:
    return {
        "horizon": curve["horizon"],
        "steps": curve["steps"],
        "runs": [
            {
                "steps": r["summary"]["inner_steps"],
                "final_val_loss": r["summary"]["final_val_loss"],
                "bytes_sent_per_worker": r["summary"].get("bytes_sent_per_worker"),
                "syncs": r["summary"].get("fragment_syncs"),
                "evals": r["evals"],
            }
            for r in curve["runs"]
        ],
    }


def report(saved: dict, args, runs_s: float | None) -> int:
    """Comparisons within each link (vs DDP, at DDP's wall-clock, the planner), the table, JSON, plot."""
    rows = saved["rows"]
    side_by_side: dict[tuple, list[dict]] = {}
    for r in rows:
        r["val_equal_tokens"] = equal_tokens_loss(saved["curves"], ROWS[r["key"]].curve_row)
        # Each comparison within one run's repeat: its rows ran interleaved with the others' (merged results
        # keep each part's own DDP window: merge_results.py).
        side_by_side.setdefault((r["link_label"], r.get("part", 0), r.get("repeat", 0)), []).append(r)
    for here in side_by_side.values():
        ddp = next((r for r in here if r["key"] == "ddp"), None)
        best = fastest_baseline(here)
        for r in here:
            if best and r["s_to_target"]:
                r["vs_best_ddp"], r["best_ddp"] = r["s_to_target"] / best["s_to_target"], best["label"]
            r["planner_s"] = planner_s(r, Link(r["rate_mbit"], r["delay_ms"]))
            if r["s_to_target"] and r.get("step_compute_s"):  # the floor is 1: its own compute, nothing else
                r["wall_over_compute"] = r["s_to_target"] / (r["steps_to_target"] * r["step_compute_s"])
            if r["planner_s"] and r["s_to_target"]:
                r["measured_over_planner"] = r["s_to_target"] / r["planner_s"]
            if ddp and ddp["s_to_target"] and r["s_to_target"]:
                r["vs_ddp"] = r["s_to_target"] / ddp["s_to_target"]
            if ddp and ddp["s_to_target"]:
                within = [e for e in r["evals"] if e["clock_s"] <= ddp["s_to_target"]]
                r["val_equal_wall"] = within[-1]["val_loss"] if within else None
        # Live recovery's cost: the run with a worker killed and restarted against the undisturbed one.
        calm = next((r for r in here if r["key"] == "torchft_4bit" and r["s_to_target"]), None)
        for r in here:
            if r["key"] == "torchft_4bit_kill" and calm and r["s_to_target"]:
                r["vs_undisturbed"] = r["s_to_target"] / calm["s_to_target"]
    if runs_s is not None:
        saved["bench_s"] = round(runs_s, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(saved, indent=1))
    print(format_curves(saved["curves"], saved["target_val_loss"]))
    shown = [r for r in rows if not r.get("reference")]  # a merged part's DDP window: its rows' reference
    once = [r for r in shown if r.get("repeat", 0) == 0]  # the table: the first repeat
    if rows:
        print(format_markdown(once) if args.markdown else format_table(once))
    if repeats_of(rows) > 1:
        print(format_repeats(shown))
    heads = headline_rows(rows)
    if len({r.get("part", 0) for r in rows}) > 1:
        print("The headline: each method at each ratio from the first part that ran it")
        print(format_repeats(heads))
    if args.plots and rows:
        first = saved["links"][0]
        curves = headline_speedups(rows, first["ratio"], PLOT_RATES, first["delay_ms"])
        points = [p for p in heads if p["delay_ms"] == first["delay_ms"]]
        plot(
            curves, PLOT_RATES, points, {k: r.label for k, r in ROWS.items()}, args.plots / "wan_speedup.png"
        )
        print(f"wrote {args.plots / 'wan_speedup.png'}")
    for check in saved.get("ddp_checks", []):
        print(
            f"DDP at ratio {check['ratio']:g} ({check['link_label']}): {check['kind']} "
            f"{check['measured_s']:.0f} s, the {check['window_steps']}-step windows' extrapolation "
            f"{check['extrapolated_s']:.0f} s "
            f"({check['extrapolated_over_measured']:.3f}x)"
        )
    if runs_s is not None and saved.get("phase_s"):
        print("phases: " + ", ".join(f"{name} {s / 60:.1f} min" for name, s in saved["phase_s"].items()))
    print(f"wrote {args.out}" + (f" ({runs_s / 60:.1f} min)" if runs_s else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
