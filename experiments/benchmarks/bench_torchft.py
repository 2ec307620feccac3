"""The torchft backend against the torch backend: sync time, and how long a death and a rejoin cost.

Part 1, sync time (`--part sync`): N gloo processes on 127.0.0.1 (default 3), each with a random
pseudogradient shaped like the `small` GPT (10.9M parameters). Every process holds both a torch.distributed
world (`CollectiveReducer`) and a torchft worker (`ElasticReducer` with a lighthouse on loopback), and times
one whole sync through each reducer as the engine calls it (`start_mean(...).wait()`; for torchft that
includes forming the quorum and the commit vote), interleaved per repetition: fp32 and statistical 4-bit
row-wise with error feedback. Median over repetitions of the slowest rank, the ratio per repetition.

The `_inflight` cases are Streaming DiLoCo's syncs in flight (applied tau = 1 steps later): the sync is
started, then the process sleeps OVERLAP_S (the inner steps, idle here so that nothing competes with the
exchange) and waits for the mean. Their times are what is left exposed: encoding and the start (torchft:
the quorum) plus the wait after the overlap.

Part 2, failure (`--part failure`): `muloco launch --backend torchft --nproc 3` on a tiny model; SIGKILL
worker 2 after its second sync, time from the kill to the survivors' next completed sync; then restart it
(`muloco train ... backend.torchft.replica_id=2`) and time from the restart to its first sync with them.
Wall-clock from polling metrics.jsonl every 20 ms. Repeated `--reps` times.

    python experiments/benchmarks/bench_torchft.py --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
CASES = ["fp32", "4bit", "fp32_inflight", "4bit_inflight"]
OVERLAP_S = 0.5  # the inner steps a sync in flight overlaps (idle here: what is left exposed is the cost)
BACKENDS = ["torch", "torchft"]


class _NoState:
    """The reducer's SharedState: never used here (no worker falls behind)."""

    fragment_syncs = 0

    def export_state(self):
        raise AssertionError("no heals in the sync benchmark")


def sync_worker(rank: int, nproc: int, port: int, lighthouse: str, reps: int, threads: int, queue) -> None:
    from muloco.comm.torch_dist import TorchDistBackend
    from muloco.compress import ErrorFeedback
    from muloco.config import CompressionConfig, ModelConfig, TorchftBackendConfig
    from muloco.models import build_model, param_roles
    from muloco.sync import CollectiveReducer, Contribution
    from muloco.sync.codec import PseudogradientCodec
    from muloco.sync.elastic import ElasticReducer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    backend = TorchDistBackend(timeout_s=120, dist_backend="gloo")
    reducers = {
        "torch": CollectiveReducer.over(backend, nproc),
        "torchft": ElasticReducer(
            TorchftBackendConfig(lighthouse=lighthouse, replica_id=rank, hostname="127.0.0.1"), nproc
        ),
    }
    reducers["torchft"].open([], [])
    reducers["torchft"].join(_NoState(), [], resumed=False)
    model = build_model(ModelConfig(preset="small"), 256)
    names, roles = [n for n, _ in model.named_parameters()], param_roles(model)
    like = [torch.zeros_like(p) for p in model.parameters()]
    gen = torch.Generator().manual_seed(rank)
    delta = [torch.randn(p.shape, generator=gen) * 1e-3 for p in model.parameters()]
    cfg = CompressionConfig(scheme="statistical", bits=4, error_feedback=True)
    codec = PseudogradientCodec.from_config(names, roles, cfg)
    feedback = ErrorFeedback(cfg.ef_decay)
    numel = sum(d.numel() for d in delta)
    times = {(b, c): [] for b in BACKENDS for c in CASES}
    sent: dict[str, float] = {}
    for rep in range(reps + 1):  # the first repetition warms up (connections, the first quorum)
        for case in CASES:
            for name, reducer in reducers.items():
                backend.barrier()
                inflight = case.endswith("_inflight")
                apply_step = rep + 1 if inflight else rep  # in flight: applied tau = 1 steps later
                t0 = time.perf_counter()
                if case.startswith("fp32"):
                    c = Contribution(0, rep, 1, like, 4.0 * numel, [d.clone() for d in delta])
                else:
                    message = codec.encode(delta, feedback)
                    c = Contribution(0, rep, 1, like, float(len(message)), None, [message], codec)
                c.apply_step = apply_step
                pending = reducer.start_mean(c)
                exposed = time.perf_counter() - t0
                if inflight:
                    time.sleep(OVERLAP_S)  # the inner steps go on meanwhile
                t1 = time.perf_counter()
                mean = pending.wait()
                elapsed = exposed + time.perf_counter() - t1  # what the inner steps waited for
                assert mean.contributors == nproc, (name, case, mean.contributors)
                sent[f"{name}/{case}"] = mean.bytes_sent or pending.bytes_sent  # collectives book at start
                if rep > 0:
                    times[(name, case)].append(elapsed)
    times_by_key = {f"{b}/{c}": t for (b, c), t in times.items()}
    queue.put({"rank": rank, "times": times_by_key, "sent": sent, "params": numel})
    reducers["torchft"].close()
    backend.close()


def run_sync_part(args) -> dict:
    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse logs every quorum at INFO otherwise
    from torchft._torchft import LighthouseServer

    from muloco.net.launch import free_port

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=60_000)
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=sync_worker, args=(r, args.nproc, port, address, args.reps, threads, queue))
        for r in range(args.nproc)
    ]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=900) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    slowest = {  # per repetition: the slowest rank's time
        key: [max(r["times"][key][i] for r in results) for i in range(args.reps)]
        for key in results[0]["times"]
    }
    rows = []
    print(
        f"\none sync through the reducer, {args.nproc} gloo processes on loopback, "
        f"{results[0]['params'] / 1e6:.1f}M parameters, median of {args.reps} interleaved (min-max)"
    )
    print(f"{'case':<15}{'torch ms':>20}{'torchft ms':>22}{'torchft / torch':>22}{'MB sent/rank':>16}")
    for case in CASES:
        t, ft = slowest[f"torch/{case}"], slowest[f"torchft/{case}"]
        ratios = [b / a for a, b in zip(t, ft, strict=True)]
        row = {
            "case": case,
            "torch_ms": 1000 * statistics.median(t),
            "torch_ms_range": [1000 * min(t), 1000 * max(t)],
            "torchft_ms": 1000 * statistics.median(ft),
            "torchft_ms_range": [1000 * min(ft), 1000 * max(ft)],
            "ratio": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)],
            "mb_sent_per_rank": {b: results[0]["sent"][f"{b}/{case}"] / 1e6 for b in BACKENDS},
        }
        rows.append(row)
        (t_lo, t_hi), (ft_lo, ft_hi) = row["torch_ms_range"], row["torchft_ms_range"]
        print(
            f"{case:<15}{row['torch_ms']:>8.1f} ({t_lo:.0f}-{t_hi:.0f})"
            f"{row['torchft_ms']:>10.1f} ({ft_lo:.0f}-{ft_hi:.0f})"
            f"{row['ratio']:>12.2f} ({row['ratio_range'][0]:.2f}-{row['ratio_range'][1]:.2f})"
            f"{row['mb_sent_per_rank']['torchft']:>16.2f}"
        )
    return {"params": results[0]["params"], "rows": rows, "slowest_s": slowest}


# -- part 2: death and rejoin ---------------------------------------------------------------------------
def _syncs(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count('"kind": "sync"') if path.exists() else 0


def _wait(predicate, timeout_s: float = 300.0) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(0.02)
    raise TimeoutError("the run did not get there")


def failure_once(out: Path, heartbeat_s: float) -> dict:
    import psutil

    overrides = [
        "model.preset=nano",
        "model.seq_len=64",
        "workers=3",
        "train.batch_tokens=768",
        "train.total_tokens=76800000",  # 100k steps: it runs until the experiment ends it
        "train.eval_every=1000",
        "train.eval_tokens=2048",  # the start's evaluation: small, so the rejoin measures the protocol
        "sync.every=10",
        "logging.progress=off",
        "inner.optimizer=adamw",
        f"backend.torchft.heartbeat_timeout_s={heartbeat_s}",
        f"run.output_dir={out}",
        "run.name=ft",
    ]
    qs = str(ROOT / "configs/quickstart.yaml")
    cmd = [sys.executable, "-m", "muloco"]
    launcher = subprocess.Popen(
        [*cmd, "launch", "--nproc", "3", "--backend", "torchft", qs, *overrides],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    replacement = None
    try:
        survivor, victim = out / "ft-worker0", out / "ft-worker2"
        _wait(lambda: _syncs(victim) >= 2)
        children = psutil.Process(launcher.pid).children()
        lighthouse = next(a.split("=", 1)[1] for a in children[0].cmdline() if "torchft.lighthouse=" in a)
        before = _syncs(survivor)
        killed = time.monotonic()
        next(c for c in children if c.environ().get("RANK") == "2").kill()
        # The sync the survivors complete next without it (one already under way may include it).
        survived = _wait(lambda: _syncs(survivor) >= before + 2)
        restarted = time.monotonic()
        back = [
            "backend.kind=torchft",
            f"backend.torchft.lighthouse={lighthouse}",
            "backend.torchft.replica_id=2",
            "backend.torchft.hostname=127.0.0.1",  # as the launcher's workers
        ]
        replacement = subprocess.Popen(
            [*cmd, "train", qs, *overrides, *back, "run.name=back"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        rejoined = _wait(lambda: _syncs(out / "back") >= 1)
        first = json.loads(next(line for line in (out / "back" / "metrics.jsonl").open() if '"sync"' in line))
    finally:
        for p in (launcher, replacement):
            if p is not None:
                for child in psutil.Process(p.pid).children(recursive=True) if p.poll() is None else []:
                    child.kill()
                p.kill()
                p.wait(timeout=30)
    return {
        "death_to_next_sync_s": survived - killed,
        "restart_to_first_sync_s": rejoined - restarted,
        # of which inside the run (after imports, data and model): the first round, the quorum, the heal
        "in_run_s": first["time_s"],
    }


def run_failure_part(args) -> dict:
    runs = []
    for rep in range(args.reps):
        out = Path(tempfile.mkdtemp(prefix="bench_torchft_"))
        try:
            runs.append(failure_once(out, args.heartbeat_s))
        finally:
            shutil.rmtree(out, ignore_errors=True)
        print(f"repetition {rep + 1}: {runs[-1]}", flush=True)
    summary = {}
    print(f"\ndeath and rejoin, 3 workers, heartbeat timeout {args.heartbeat_s} s, {args.reps} repetitions")
    for key in ("death_to_next_sync_s", "restart_to_first_sync_s", "in_run_s"):
        values = [r[key] for r in runs]
        summary[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        print(f"{key:<28}{summary[key]['median']:>8.2f} s ({min(values):.2f}-{max(values):.2f})")
    return {"heartbeat_timeout_s": args.heartbeat_s, "runs": runs, "summary": summary}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=["sync", "failure", "both"], default="both")
    parser.add_argument("--nproc", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--heartbeat-s", type=float, default=5.0, help="the lighthouse's heartbeat timeout")
    parser.add_argument("--out", default=str(ROOT / "experiments/benchmarks/results/bench_torchft.json"))
    args = parser.parse_args()
    result = {"args": vars(args)}
    if args.part in ("sync", "both"):
        result["sync"] = run_sync_part(args)
    if args.part in ("failure", "both"):
        result["failure"] = run_failure_part(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
