"""Distributed Muon inside one DiLoCo worker: optimizer step time and state per rank for R = 1, 2, 4 ranks.

Matrix set: the hidden matrices of a d512/L6 GPT block stack, per block q, k, v, o (512x512) and the MLP
(2048x512, 512x2048): 36 matrices, 18.9M parameters (the project's GPT fuses q, k, v into one 1536x512
matrix; same parameter count). Fixed random gradients, the same on every rank (as after the worker's
all-reduce). Each R runs as R processes on gloo over 127.0.0.1 with torch.set_num_threads(1), so each rank
stands for one device; R=1 is plain `Muon` in one process, which is also what vanilla Muon costs per rank
at any R. The R values alternate over --rounds so background load hits all of them alike.

Step time: every rank waits at a barrier, then times `opt.step()`; a step's time is the slowest rank's, and
the table shows the median over measured steps. A second pass times the phases of `DistributedMuon.step`
(the slowest rank's, median): orthogonalize (momentum + Newton-Schulz on the owned matrices), wait (a
barrier: load imbalance between ranks), exchange (the owners' broadcasts), apply (the weight update).

    python experiments/benchmarks/bench_distributed_muon.py [--ranks 1 2 4] [--steps 7] [--warmup 2]
        [--rounds 2] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from muloco.net.launch import free_port  # noqa: E402
from muloco.optim import DistributedMuon, Muon  # noqa: E402
from muloco.optim.orthogonalize import default_ns_dtype  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "distributed_muon.json"
D512_L6 = [(512, 512)] * 4 * 6 + [(2048, 512), (512, 2048)] * 6  # q, k, v, o, fc, proj of 6 blocks
PHASES = ("orthogonalize", "wait", "exchange", "apply")
TARGET_STEP, TARGET_STATE = 0.6, 0.55  # R=2 over R=1 (issue 12)


def matrices() -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape, generator=gen) * 0.02) for shape in D512_L6]
    grads = [torch.randn(*shape, generator=gen) for shape in D512_L6]
    return params, grads


def barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()  # every rank calls it at the same point of each step


def time_steps(opt: torch.optim.Optimizer, world_size: int, warmup: int, steps: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        barrier(world_size)
        start = time.perf_counter()
        opt.step()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def time_phases(opt: DistributedMuon, world_size: int, steps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for _ in range(steps):
        barrier(world_size)
        t0 = time.perf_counter()
        owned = opt.orthogonalize_owned()
        t1 = time.perf_counter()
        barrier(world_size)
        t2 = time.perf_counter()
        updates = opt.exchange(owned)
        t3 = time.perf_counter()
        opt.apply_updates(updates)
        t4 = time.perf_counter()
        for phase, ms in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[phase].append(ms * 1e3)
    return times


def rank_main(rank: int, world_size: int, port: int, warmup: int, steps: int, out: str) -> None:
    """One rank: step times, phase times and optimizer-state bytes, written to OUT/rank{rank}.json."""
    torch.set_num_threads(1)  # one rank = one device
    if world_size > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=300),  # a stuck rank makes the others raise, not hang
        )
    try:
        params, grads = matrices()
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        # R=1: plain Muon, the baseline; R>1: DistributedMuon. Both with Muon's default hyperparameters.
        opt = Muon(params) if world_size == 1 else DistributedMuon(params)
        step_ms = time_steps(opt, world_size, warmup, steps)
        # R=1: DistributedMuon without a process group (Muon's maths, no communication) for the phases.
        phased = opt if isinstance(opt, DistributedMuon) else DistributedMuon(params)
        phases = time_phases(phased, world_size, steps)
        state_bytes = sum(
            v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
        )
        result = {"step_ms": step_ms, "phase_ms": phases, "state_bytes": state_bytes}
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        if world_size > 1:
            dist.destroy_process_group()


def run(world_size: int, warmup: int, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        args = (world_size, free_port(), warmup, steps, out)
        mp.spawn(rank_main, args=args, nprocs=world_size, join=True)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world_size)]


def slowest(per_rank: list[list[float]]) -> list[float]:
    """Per step, the slowest rank's time: the step is done when every rank holds the new parameters."""
    return [max(ts) for ts in zip(*per_rank, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="R values; 1 is the baseline")
    parser.add_argument("--steps", type=int, default=7, help="measured steps per run (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    parser.add_argument("--rounds", type=int, default=2, help="runs per R, alternating between the R values")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    args = parser.parse_args()
    if 1 not in args.ranks:
        parser.error("--ranks must include 1, the baseline")
    cores = os.cpu_count() or 1
    numel = sum(torch.Size(s).numel() for s in D512_L6)
    ns_dtype = default_ns_dtype("cpu")
    print(f"{len(D512_L6)} matrices (d512/L6), {numel / 1e6:.1f}M parameters; NS dtype {ns_dtype}")
    print(f"torch {torch.__version__}, gloo on 127.0.0.1, 1 thread per rank, {cores} cores")
    for r in args.ranks:
        if r > cores:
            print(
                f"note: R={r} runs {r} single-thread ranks on {cores} cores: oversubscribed {r / cores:.0f}x"
            )

    runs: dict[int, list[list[dict]]] = {r: [] for r in args.ranks}
    for _ in range(args.rounds):
        for r in args.ranks:
            runs[r].append(run(r, args.warmup, args.steps))

    table = {}
    for r, results in runs.items():
        step = [t for ranks in results for t in slowest([rank["step_ms"] for rank in ranks])]
        phases = {
            phase: statistics.median(
                t for ranks in results for t in slowest([rank["phase_ms"][phase] for rank in ranks])
            )
            for phase in PHASES
        }
        state = [rank["state_bytes"] for rank in results[0]]
        table[r] = {
            "step_ms": statistics.median(step),
            "step_ms_all": step,
            "phase_ms": phases,
            "state": state,
        }
    base = table[1]
    update_bytes = numel * torch.tensor([], dtype=ns_dtype).element_size()

    header = f"{'R':>2} {'step ms':>8} {'vs R=1':>7} {'ideal':>6}  "
    header += " ".join(f"{p + ' ms':>16}" for p in PHASES)
    header += f" {'state/rank MiB':>15} {'vs R=1':>7} {'recv MiB':>9}"
    print(f"\n{header}")
    for r, row in table.items():
        ratio = row["step_ms"] / base["step_ms"]
        state = max(row["state"])
        recv = update_bytes * (r - 1) / r / 2**20
        cells = " ".join(f"{row['phase_ms'][p]:>16.1f}" for p in PHASES)
        print(
            f"{r:>2} {row['step_ms']:>8.1f} {ratio:>6.2f}x {1 / r:>5.2f}x  {cells} "
            f"{state / 2**20:>15.1f} {state / max(base['state']):>6.2f}x {recv:>9.1f}"
        )
        row.update(step_ratio=ratio, state_ratio=state / max(base["state"]), recv_bytes=recv * 2**20)
    if 2 in table:
        step_ok = table[2]["step_ratio"] <= TARGET_STEP
        state_ok = table[2]["state_ratio"] <= TARGET_STATE
        print(
            f"\nR=2: step {table[2]['step_ratio']:.2f}x R=1 (target <= {TARGET_STEP}: "
            f"{'met' if step_ok else 'missed'}), state {table[2]['state_ratio']:.2f}x "
            f"(target <= {TARGET_STATE}: {'met' if state_ok else 'missed'})"
        )
    print(
        "phases: the slowest rank's median each, so they need not add up to the step; R=1 phases are "
        "DistributedMuon without a group (Muon's maths, no communication)"
    )

    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cpu": platform.processor() or platform.machine(),
        "cores": cores,
        "torch": torch.__version__,
        "threads_per_rank": 1,
        "ns_dtype": str(ns_dtype),
        "matrices": len(D512_L6),
        "matrix_params": numel,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "oversubscribed_ranks": [r for r in args.ranks if r > cores],
        "targets": {"r2_step_over_r1": TARGET_STEP, "r2_state_over_r1": TARGET_STATE},
        "by_ranks": {str(r): row for r, row in table.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
