"""Time per sync of the hivemind swarm (3 peers on loopback) beside the torch gloo backend, same tensors.

Every process holds a random pseudogradient shaped like the `small` GPT's parameters (~10.9M) and times whole
syncs, interleaved per repetition:
- hivemind: one swarm (muloco.comm.hivemind) with one fragment per case, each fragment holding every
  tensor (fp32 = scheme none; statistical 8 and 4 bit, row-wise). A sync = encode + matchmaking (groups form
  as soon as all 3 peers are in: target_group_size = 3) + payload exchange + decode, checks and mean.
- gloo: muloco.comm.torch_dist on 127.0.0.1: fp32 = one all-reduce of the flat buffer; compressed = encode +
  all-gather of the payloads + decode and mean (the engine's path; the same compressor on every tensor).
Median over repetitions, then the slowest process. The ratio is to gloo fp32.

    python experiments/benchmarks/bench_hivemind.py --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from muloco.compress import get_compressor
from muloco.sync.codec import PseudogradientCodec, pack

CASES = {"fp32": ("none", 8), "8bit": ("statistical", 8), "4bit": ("statistical", 4)}
NPROC = 3
PHASES = ("encode", "matchmaking", "exchange", "combine")


def small_gpt_shapes() -> list[torch.Size]:
    from muloco.config import load_config
    from muloco.models import build_model

    model = build_model(load_config(None, ["model.preset=small"]).model, 256)
    return [p.shape for p in model.parameters()]


def pseudogradient(rank: int, shapes: list[torch.Size]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return [torch.randn(s, generator=gen) * 1e-3 for s in shapes]


def compressor(case: str):
    scheme, bits = CASES[case]
    return get_compressor(scheme, bits=bits, granularity="row")


def hivemind_peer(rank: int, reps: int, maddrs_queue, barrier, results) -> None:
    from muloco.comm.hivemind import HivemindSwarm
    from muloco.config import HivemindBackendConfig

    mp.set_start_method("fork", force=True)  # a spawned process inherits "spawn"; hivemind needs fork
    torch.set_num_threads(1)
    shapes = small_gpt_shapes()
    delta = pseudogradient(rank, shapes)
    initial = [] if rank == 0 else maddrs_queue.get(timeout=120)
    settings = HivemindBackendConfig(
        run_id=f"bench-{os.getppid()}", initial_peers=initial, target_group_size=NPROC
    )
    per_tensor = [[compressor(case)] * len(shapes) for case in CASES]
    swarm = HivemindSwarm(settings, [shapes] * len(CASES), per_tensor)
    if rank == 0:
        for _ in range(NPROC - 1):
            maddrs_queue.put(swarm.visible_maddrs)
    times = {case: [] for case in CASES}
    phases = {case: {k: [] for k in PHASES} for case in CASES}
    failures = 0
    for rep in range(reps + 1):  # the first repetition warms up
        for fragment, case in enumerate(CASES):
            barrier.wait(timeout=300)
            t0 = time.perf_counter()
            result = swarm.start_average(fragment, delta, step=rep).wait()
            elapsed = time.perf_counter() - t0
            failures += not (result.averaged and result.group_size == NPROC and result.excluded == 0)
            if rep > 0:
                times[case].append(elapsed)
                for k in PHASES:
                    phases[case][k].append(result.seconds.get(k, 0.0))
    results.put(
        {
            "backend": "hivemind",
            "rank": rank,
            "times": times,
            "phases": phases,
            "failures": failures,
            "sync_bytes": {case: swarm.timeouts[f].sync_bytes for f, case in enumerate(CASES)},
            "timeouts": {case: vars(swarm.timeouts[f]) for f, case in enumerate(CASES)},
        }
    )
    barrier.wait(timeout=300)  # nobody leaves while others may still download from it
    swarm.close()


def gloo_peer(rank: int, reps: int, port: int, results) -> None:
    from muloco.comm.torch_dist import TorchDistBackend

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(NPROC), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    backend = TorchDistBackend(timeout_s=300, dist_backend="gloo")
    shapes = small_gpt_shapes()
    delta = pseudogradient(rank, shapes)
    names = [f"t{i}" for i in range(len(shapes))]
    codecs = {
        case: PseudogradientCodec(names, [compressor(case)] * len(shapes)) for case in CASES if case != "fp32"
    }
    times = {case: [] for case in CASES}
    for rep in range(reps + 1):
        for case in CASES:
            backend.barrier()
            t0 = time.perf_counter()
            if case == "fp32":
                backend.all_reduce_sum([d.clone() for d in delta]).wait()
            else:
                blobs = backend.all_gather_bytes(pack([codecs[case].encode(delta)])).wait()
                codecs[case].decode_mean(blobs, NPROC, delta)
            if rep > 0:
                times[case].append(time.perf_counter() - t0)
    results.put({"backend": "gloo", "rank": rank, "times": times})
    backend.close()


def run_processes(ctx, target, args_by_rank, timeout_s: float) -> list[dict]:
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, results)) for args in args_by_rank]
    for p in procs:
        p.start()
    try:
        return [results.get(timeout=timeout_s) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def slowest_median(results: list[dict], case: str) -> float:
    return max(statistics.median(r["times"][case]) for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="experiments/benchmarks/results/hivemind.json")
    args = parser.parse_args()
    from muloco.net.launch import free_port

    ctx = mp.get_context("spawn")
    load_before = os.getloadavg()
    port = free_port()
    gloo = run_processes(ctx, gloo_peer, [(r, args.reps, port) for r in range(NPROC)], 900)
    maddrs, barrier = ctx.Queue(), ctx.Barrier(NPROC)
    hive = run_processes(ctx, hivemind_peer, [(r, args.reps, maddrs, barrier) for r in range(NPROC)], 900)
    load_after = os.getloadavg()

    n_params = sum(s.numel() for s in small_gpt_shapes())
    gloo_fp32 = slowest_median(gloo, "fp32")
    rows = []
    for case in CASES:
        hive_s = slowest_median(hive, case)
        phase_s = {k: max(statistics.median(r["phases"][case][k]) for r in hive) for k in PHASES}
        rows.append(
            {
                "case": case,
                "hivemind_s": hive_s,
                "hivemind_phases_s": phase_s,
                "gloo_s": slowest_median(gloo, case),
                "hivemind_vs_gloo_fp32": hive_s / gloo_fp32,
                "gloo_vs_gloo_fp32": slowest_median(gloo, case) / gloo_fp32,
                "payload_mb_per_peer": hive[0]["sync_bytes"][case] / 1e6,
            }
        )
    failures = sum(r["failures"] for r in hive)
    print(
        f"\none sync, {NPROC} processes on loopback, {n_params / 1e6:.1f}M parameters (`small` GPT), "
        f"median of {args.reps}, slowest process; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after; hivemind syncs that were not a full group: {failures}"
    )
    header = (
        f"{'case':<6}{'payload MB':>11}{'hivemind s':>12}{'match':>7}{'exch':>7}{'enc':>7}{'comb':>7}"
        f"{'gloo s':>9}{'hm/gloo32':>11}{'gloo/gloo32':>13}"
    )
    print(header + "\n" + "-" * len(header))
    for r in rows:
        p = r["hivemind_phases_s"]
        print(
            f"{r['case']:<6}{r['payload_mb_per_peer']:>11.2f}{r['hivemind_s']:>12.3f}{p['matchmaking']:>7.2f}"
            f"{p['exchange']:>7.2f}{p['encode']:>7.2f}{p['combine']:>7.2f}{r['gloo_s']:>9.3f}"
            f"{r['hivemind_vs_gloo_fp32']:>11.1f}{r['gloo_vs_gloo_fp32']:>13.1f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "args": vars(args),
                "nproc": NPROC,
                "params": n_params,
                "load_average_before_after": [load_before, load_after],
                "hivemind_incomplete_syncs": failures,
                "timeouts": hive[0]["timeouts"],
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
