"""Time and bytes of one sync on the torch.distributed backend: fp32 all-reduce vs compressed all-gather.

Starts N gloo processes on 127.0.0.1 (default 4). Each holds a random pseudogradient shaped like the
`small` GPT's parameters (~10.9M) and, interleaved per repetition, times a whole sync as the engine does it:
fp32 = one all-reduce of the flat buffer; compressed = encode (statistical, row-wise) + all-gather of the
payloads + decode and average of all N. Median over repetitions, then the max over ranks.

    python experiments/benchmarks/bench_backends.py --nproc 4 --reps 5
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
import torch.distributed as dist
import torch.multiprocessing as mp

from muloco.comm import ring_allgather_bytes, ring_allreduce_bytes
from muloco.comm.torch_dist import TorchDistBackend
from muloco.config import CompressionConfig, ModelConfig
from muloco.models import build_model, param_roles
from muloco.sync.codec import PseudogradientCodec, pack

CASES = ["fp32", "8bit", "4bit", "2bit"]


def worker(rank: int, nproc: int, port: int, reps: int, threads: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    backend = TorchDistBackend(timeout_s=120, dist_backend="gloo")
    model = build_model(ModelConfig(preset="small"), 256)
    names = [n for n, _ in model.named_parameters()]
    roles = param_roles(model)
    gen = torch.Generator().manual_seed(rank)
    delta = [torch.randn(p.shape, generator=gen) * 1e-3 for p in model.parameters()]
    n_params = sum(d.numel() for d in delta)
    codecs = {
        case: PseudogradientCodec.from_config(
            names, roles, CompressionConfig(scheme="statistical", bits=int(case[0]))
        )
        for case in CASES[1:]
    }
    times: dict[str, list[float]] = {c: [] for c in CASES}
    sent: dict[str, float] = {}
    for rep in range(reps + 1):  # the first repetition warms up
        for case in CASES:
            backend.barrier()
            t0 = time.perf_counter()
            if case == "fp32":
                backend.all_reduce_sum([d.clone() for d in delta]).wait()
                sent[case] = ring_allreduce_bytes(4 * n_params, nproc)
            else:
                message = codecs[case].encode(delta)
                blobs = backend.all_gather_bytes(pack([message])).wait()
                codecs[case].decode_mean(blobs, nproc, delta)
                sent[case] = ring_allgather_bytes(len(message), nproc)
            if rep > 0:
                times[case].append(time.perf_counter() - t0)
    queue.put({"rank": rank, "times": times, "sent": sent, "params": n_params})
    backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="experiments/benchmarks/results/bench_backends.json")
    args = parser.parse_args()
    from muloco.net.launch import free_port

    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=worker, args=(r, args.nproc, port, args.reps, threads, queue))
        for r in range(args.nproc)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    if dist.is_initialized():
        dist.destroy_process_group()

    params = results[0]["params"]
    rows = []
    for case in CASES:
        t = max(statistics.median(r["times"][case]) for r in results)
        rows.append({"case": case, "sync_s": t, "mb_sent_per_rank": results[0]["sent"][case] / 1e6})
    fp32 = rows[0]
    print(
        f"\none sync, {args.nproc} gloo processes on loopback, {params / 1e6:.1f}M parameters (`small` GPT), "
        f"median of {args.reps}, slowest rank"
    )
    print(f"{'path':<30}{'sync ms':>9}{'vs fp32':>9}{'MB sent/rank':>14}{'vs fp32':>9}")
    for r in rows:
        path = "fp32 all-reduce" if r["case"] == "fp32" else f"statistical {r['case']} all-gather"
        r["time_ratio"] = r["sync_s"] / fp32["sync_s"]
        r["bytes_ratio"] = r["mb_sent_per_rank"] / fp32["mb_sent_per_rank"]
        print(
            f"{path:<30}{1000 * r['sync_s']:>9.1f}{r['time_ratio']:>9.2f}{r['mb_sent_per_rank']:>14.2f}"
            f"{r['bytes_ratio']:>9.3f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "params": params, "rows": rows}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
