"""A host that stops answering, over hivemind (issue 62, part 4): how long the others' rounds take while it is
stopped, as a ratio to their median round before, with sync.deadline: adaptive beside the backend's own
static wait (off: backend.hivemind.matchmaking_time, derived from the sync's size).

K = 4 peers on loopback (`muloco launch --backend hivemind`), a tiny model whose inner steps are emulated at
speed 0.05 (they sleep: rounds of ~9 s that hold on 2 busy cores), a sync every H = 40 steps. After
peer 3's 7th sync its processes are stopped (SIGSTOP; its p2p daemon too: the host stops answering) for the
rest of the run; the others go on. Per run: the median of the others' round times (sync to sync; a late
window's skipped round left out) before the stop (the last 4: the first ones are start-up's, and a
deadline needs 3 rounds), and the longest of theirs after it. Rows interleaved, repeats.

    python experiments/benchmarks/bench_deadline.py --repeats 3

Prints a table and writes experiments/benchmarks/results/bench_deadline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).parent / "results" / "bench_deadline.json"
ROWS = {
    "adaptive": ["sync.deadline=adaptive", "backend.hivemind.matchmaking_time=0.5"],
    "off": [],
}
H, SYNCS, STOP_AFTER = 40, 12, 7


def overrides(out: Path) -> list[str]:
    return [
        "model.preset=nano",
        "model.d_model=32",
        "model.n_layers=2",
        "model.n_heads=2",
        "model.seq_len=32",
        "workers=4",
        "train.batch_tokens=512",
        f"train.total_tokens={512 * H * SYNCS}",
        f"sync.every={H}",
        "train.speed=0.05",
        "train.eval_every=1000",
        "train.eval_tokens=512",
        "train.warmup_steps=2",
        "logging.progress=off",
        "backend.hivemind.target_group_size=4",  # a full group begins at once, in both rows
        "backend.hivemind.averaging_timeout=5",
        "checkpoint.every=0",
        f"run.output_dir={out}",
        "run.name=swarm",
    ]


def rank_process(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    """The `muloco train` process of `rank` under the launcher (titled `LOCAL_RANK=r RANK=r ...` by the
    preloaded server, else RANK in its environment)."""
    for proc in psutil.Process(launcher.pid).children(recursive=True):
        words = proc.cmdline()
        if {"muloco", "train"} <= set(words):
            titled = dict(w.split("=", 1) for w in words[:2] if w.startswith(("LOCAL_RANK=", "RANK=")))
            if int(titled.get("LOCAL_RANK", proc.environ().get("LOCAL_RANK", -1))) == rank:
                return proc
    raise RuntimeError(f"rank {rank} not found under the launcher")


def run_once(row: str, workdir: Path) -> dict:
    out = workdir / row
    cmd = [sys.executable, "-m", "muloco", "launch", "--nproc", "4", "--backend", "hivemind"]
    cmd += [str(ROOT / "configs/quickstart.yaml"), *overrides(out), *ROWS[row]]
    env = {**os.environ, "WANDB_MODE": "offline"}
    launcher = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(launcher.stderr.readline, "")), daemon=True).start()
    needle = "[rank 3] hivemind sync fragment=0 "  # its syncs (a late window's at the step it joined)
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        while sum(needle in line for line in list(lines)) < STOP_AFTER:
            if time.monotonic() > deadline or launcher.poll() is not None:
                raise RuntimeError(f"{row}: peer 3 never synced {STOP_AFTER} times:\n{''.join(lines[-30:])}")
            time.sleep(0.05)
        # the step of its last sync before the stop (a late window's line names the sync it joined)
        last = [x for x in list(lines) if needle in x][STOP_AFTER - 1]
        stopped_after = int(last.split("step=")[1].split()[0])
        victim = rank_process(launcher, 3)
        tree = [victim, *victim.children(recursive=True)]
        for p in tree:
            p.send_signal(signal.SIGSTOP)
        survivors = [out / f"swarm-peer{i}" / "summary.json" for i in range(3)]
        while not all(s.exists() for s in survivors):
            if time.monotonic() > deadline + 300:
                raise RuntimeError(f"{row}: the others did not finish:\n{''.join(lines[-30:])}")
            time.sleep(0.5)
    finally:
        for p in tree:
            try:
                p.send_signal(signal.SIGCONT)
                p.kill()
            except psutil.NoSuchProcess:
                pass
        launcher.kill()
        launcher.wait(timeout=30)
    before, after, groups, dump = [], [], [], []
    for peer in range(3):  # the others: each one's rounds, sync to sync (a late window's skip left out)
        records = [json.loads(x) for x in (out / f"swarm-peer{peer}/metrics.jsonl").read_text().splitlines()]
        syncs = [r for r in records if r["kind"] == "sync"]
        groups.append([r.get("group_size") for r in syncs])
        dump.append(syncs)
        for a, b in zip(syncs, syncs[1:], strict=False):
            if b["step"] - a["step"] != H or a.get("late") or b.get("late"):
                continue
            # the last 4 rounds before the stop (the first ones are the start-up's, peers meeting late,
            # and a deadline needs 3 rounds); every one after it
            if stopped_after - 4 * H < b["step"] <= stopped_after:
                before.append(b["time_s"] - a["time_s"])
            elif b["step"] > stopped_after:
                after.append(b["time_s"] - a["time_s"])
    if not before or not after:
        steps = [[(r["step"], r.get("late"), round(r["time_s"], 1)) for r in g] for g in dump]
        raise RuntimeError(f"{row}: no rounds before or after the stop at step {stopped_after}: {steps}")
    median = statistics.median(before)
    return {
        "row": row,
        "stopped_after_step": stopped_after,
        "median_round_s": round(median, 3),
        "longest_round_after_stop_s": round(max(after), 3),
        "bound": round(max(after) / median, 3),
        "rounds_before_s": [round(r, 3) for r in before],
        "rounds_after_s": [round(r, 3) for r in after],
        "group_sizes": groups,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    rows = args.rows.split(",")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for row in rows:
                try:
                    result = run_once(row, Path(tmp) / f"r{repeat}")
                except RuntimeError as exc:  # counted: hivemind's own wait has lost a whole run here
                    runs.append({"repeat": repeat, "row": row, "failed": str(exc).splitlines()[0]})
                    print(f"{row} repeat {repeat}: failed: {exc}".splitlines()[0], flush=True)
                    continue
                runs.append({"repeat": repeat, **result})
                print(f"{row} repeat {repeat}: bound {result['bound']:.2f}x", flush=True)
    table = []
    for row in rows:
        done = [r for r in runs if r["row"] == row and "failed" not in r]
        bounds, medians = [r["bound"] for r in done], [r["median_round_s"] for r in done]
        failed = sum(r["row"] == row and "failed" in r for r in runs)
        if not done:
            table.append({"row": row, "failed": failed, "bound_median": None})
            continue
        table.append(
            {
                "row": row,
                "bound_median": statistics.median(bounds),
                "bound_range": [min(bounds), max(bounds)],
                "median_round_s": statistics.median(medians),
                "failed": failed,
            }
        )
    print("| row | longest round with a host stopped / median round | median round (s) | runs failed |")
    print("|---|---|---|---|")
    for t in table:
        if t["bound_median"] is None:
            print(f"| {t['row']} | every run failed | | {t['failed']} |")
            continue
        lo, hi = t["bound_range"]
        bound = f"{t['bound_median']:.2f}x ({lo:.2f}-{hi:.2f})"
        print(f"| {t['row']} | {bound} | {t['median_round_s']:.2f} | {t['failed']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"command": " ".join(sys.argv), "H": H, "syncs": SYNCS, "runs": runs, "table": table}
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
