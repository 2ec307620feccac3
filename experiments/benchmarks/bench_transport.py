"""Bytes per worker and time of one compressed sync: all_gather vs reduce_scatter (sync.transport), against
DDP's fp32 ring all-reduce, for K = 2, 4, 8 gloo processes on loopback and K = 4 over the WAN testbed.

Each worker holds a random pseudogradient shaped like the `small` GPT's parameters (10.8M) and, interleaved
per repetition, runs one whole sync as the engine does: encode (statistical, row-wise), the reducer's
collectives (CollectiveReducer over TorchDistBackend), decode and average. It reports the bytes the engine
counts (what the ledger books), the bytes that crossed the wire, headers included, and the TCP payload
(the wire less 66 header bytes per packet):

- loopback: the K processes run in one network namespace of their own (a 1-host testbed), so its `lo`
  carries nothing else; wire bytes per worker = lo's tx bytes / K;
- WAN: a K-host testbed (muloco.testbed), each host's link limited to --rate-mbit (tbf); wire bytes = each
  host's eth0 tx bytes.

Without root (no namespaces) the loopback runs go on 127.0.0.1 and the wire column is empty. Times are the
median over --reps repetitions (after one warm-up) of the slowest rank, with the min-max spread.

    python experiments/benchmarks/bench_transport.py --reps 3                  # K = 2, 4, 8 + WAN K = 4
    python experiments/benchmarks/bench_transport.py --ks 4 --no-wan --reps 3  # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from muloco.config import CompressionConfig

OUT = Path(__file__).parent / "results" / "bench_transport.json"
BITS = (8, 4, 2)
# Per packet on lo and on the testbed's veth links: Ethernet 14 + IPv4 20 + TCP 20 + the timestamp
# option 12 (RFC 7323, on by default in Linux).
HEADER_BYTES = 14 + 20 + 20 + 12


def default_mean_bits(bits: int) -> int:
    return CompressionConfig(scheme="statistical", bits=bits).second_stage_bits


# Per bits: the all-gather, the reduce-scatter with means at the same bits, and with the default second
# stage (compression.mean_bits unset) where that is wider.
CASES = ["ddp_fp32"]
for _b in BITS:
    CASES += [f"all_gather_{_b}bit", f"reduce_scatter_{_b}bit"]
    if default_mean_bits(_b) != _b:
        CASES.append(f"reduce_scatter_{_b}bit_means{default_mean_bits(_b)}")


# -- one worker (a process of its own, started by the parent in a namespace) --------------------------------
def run_worker(args: argparse.Namespace) -> None:
    import torch

    from muloco.comm import ring_allreduce_bytes
    from muloco.comm.torch_dist import TorchDistBackend
    from muloco.config import ModelConfig
    from muloco.models import build_model, param_roles
    from muloco.sync import CollectiveReducer, Contribution
    from muloco.sync.codec import PseudogradientCodec
    from muloco.sync.scatter import PartitionedCodec

    torch.set_num_threads(1)
    backend = TorchDistBackend(timeout_s=600, dist_backend="gloo")
    K, rank = backend.world_size, backend.rank
    model = build_model(ModelConfig(preset=args.model), 256)
    names = [n for n, _ in model.named_parameters()]
    roles, shapes = param_roles(model), [p.shape for p in model.parameters()]
    gen = torch.Generator().manual_seed(rank)
    delta = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
    like = [torch.zeros(s) for s in shapes]
    n_params = sum(d.numel() for d in delta)
    reducer = CollectiveReducer.over(backend, workers=K)
    codecs = {}
    for bits in BITS:
        codec = PseudogradientCodec.from_config(
            names, roles, CompressionConfig(scheme="statistical", bits=bits)
        )
        codecs[f"all_gather_{bits}bit"] = codec
        codecs[f"reduce_scatter_{bits}bit"] = PartitionedCodec(codec, shapes, K, codec.compressors)
        wide = default_mean_bits(bits)
        if wide != bits:
            wide_cfg = CompressionConfig(scheme="statistical", bits=wide)
            means = PseudogradientCodec.from_config(names, roles, wide_cfg).compressors
            codecs[f"reduce_scatter_{bits}bit_means{wide}"] = PartitionedCodec(codec, shapes, K, means)

    def wire_counters() -> tuple[int, int, int]:
        """(bytes, packets, bytes resent) the interface has sent; zeros without one."""
        if not args.iface:
            return 0, 0, 0
        stats = Path(f"/sys/class/net/{args.iface}/statistics")
        sent = int((stats / "tx_bytes").read_text()), int((stats / "tx_packets").read_text())
        return *sent, resent_bytes()

    def one_sync(case: str) -> float:
        if case == "ddp_fp32":
            backend.all_reduce_sum([torch.cat([d.flatten() for d in delta])]).wait()
            return ring_allreduce_bytes(4 * n_params, K)
        codec = codecs[case]
        message = codec.encode(delta)
        c = Contribution(0, 0, 1, like, float(len(message)), None, [message], codec, [None])
        pending = reducer.start_mean(c)
        mean = pending.wait()
        return pending.bytes_sent + mean.bytes_sent

    rows = []
    for rep in range(args.reps + 1):  # repetition 0 warms up
        for case in CASES:
            backend.barrier()
            before = wire_counters()
            backend.barrier()  # nobody sends before every counter was read
            t0 = time.perf_counter()
            counted = one_sync(case)
            seconds = time.perf_counter() - t0
            backend.barrier()
            wire, packets, resent = (after - b for after, b in zip(wire_counters(), before, strict=True))
            row = {"rep": rep, "case": case, "rank": rank, "s": seconds, "counted": counted}
            rows.append({**row, "wire": wire, "packets": packets, "resent": resent})
    Path(args.worker_out).write_text(json.dumps(rows))
    backend.barrier()
    backend.close()


def resent_bytes() -> int:
    """TCP bytes retransmitted by the sockets of this network namespace (`ss`'s bytes_retrans). On a loaded
    machine TCP's tail-loss probe resends a whole segment (up to 64 KiB on lo) when an ACK comes late."""
    out = subprocess.run(["ss", "-tinH"], capture_output=True, text=True, timeout=30).stdout
    return sum(int(m) for m in re.findall(r"bytes_retrans:(\d+)", out))


# -- the parent: start the workers, gather and summarize -------------------------------------------------
def worker_command(args: argparse.Namespace, out: str, iface: str | None) -> list[str]:
    cmd = [sys.executable, __file__, "--worker", "--worker-out", out, "--reps", str(args.reps)]
    return [*cmd, "--model", args.model, *(["--iface", iface] if iface else [])]


def launch(args, K: int, wan: bool) -> list[list[dict]]:
    """K workers on loopback (in a namespace of their own when possible) or on a K-host WAN testbed."""
    from muloco.net.launch import free_port
    from muloco.testbed.network import Testbed, missing_requirements

    tmp = Path(tempfile.mkdtemp(prefix="bench_transport_"))
    outs = [str(tmp / f"rank{r}.json") for r in range(K)]
    env = {**os.environ, "WORLD_SIZE": str(K), "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    can_namespace = missing_requirements() is None
    if wan and not can_namespace:
        raise SystemExit(f"the WAN testbed needs root and iproute2: {missing_requirements()}")
    timeout = 1800
    if not can_namespace:  # plain loopback: wire bytes are not measured
        procs = [
            subprocess.Popen(
                worker_command(args, outs[r], None), env={**env, "RANK": str(r), "MASTER_ADDR": "127.0.0.1"}
            )
            for r in range(K)
        ]
        _wait(procs, timeout)
    else:
        hosts = K if wan else 1
        with Testbed(hosts=hosts, rate_mbit=args.rate_mbit if wan else 100_000) as bed:
            if not wan:
                bed.run(0, ["ip", "link", "set", "lo", "up"])  # a new namespace's loopback starts down
            procs = []
            for r in range(K):
                host = r if wan else 0
                iface = bed.hosts[host].interface if wan else "lo"
                master = bed.hosts[0].address if wan else "127.0.0.1"
                worker_env = {**env, "RANK": str(r), "MASTER_ADDR": master}
                worker_env["GLOO_SOCKET_IFNAME"] = iface
                procs.append(bed.popen(host, worker_command(args, outs[r], iface), env=worker_env))
            _wait(procs, timeout)
    return [json.loads(Path(o).read_text()) for o in outs]


def _wait(procs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
    bad = [p.returncode for p in procs if p.returncode != 0]
    if bad:
        raise SystemExit(f"a worker failed: return codes {[p.returncode for p in procs]}")


def summarize(per_rank: list[list[dict]], K: int, link: str, loopback_shared: bool) -> list[dict]:
    rows = []
    for case in CASES:
        reps = sorted({r["rep"] for r in per_rank[0]} - {0})
        slowest = [
            max(r["s"] for rank in per_rank for r in rank if r["rep"] == rep and r["case"] == case)
            for rep in reps
        ]
        counted = statistics.mean(
            r["counted"] for rank in per_rank for r in rank if r["case"] == case and r["rep"] > 0
        )
        measured = [r for rank in per_rank for r in rank if r["case"] == case and r["rep"] > 0]
        # Loopback: every rank read the same lo counter, which carries all K workers' bytes.
        share = K if loopback_shared else 1
        wire = (
            statistics.mean(r["wire"] for r in measured) / share if any(r["wire"] for r in measured) else None
        )
        packets = statistics.mean(r["packets"] for r in measured) / share if wire else None
        resent = statistics.mean(r["resent"] for r in measured) / share if wire else None
        # What TCP delivered: the wire less each packet's headers and less what it sent twice. Headers
        # and resends grow on a loaded machine (more, smaller segments; late ACKs); this holds steady.
        payload = wire - packets * HEADER_BYTES - resent if wire else None
        rows.append(
            {
                "K": K,
                "link": link,
                "case": case,
                "counted_mb": counted / 1e6,
                "wire_mb": wire / 1e6 if wire is not None else None,
                "wire_over_counted": wire / counted if wire else None,
                "packets": packets,
                "resent_mb": resent / 1e6 if wire else None,
                "payload_over_counted": payload / counted if payload else None,
                "sync_s": statistics.median(slowest),
                "sync_s_min": min(slowest),
                "sync_s_max": max(slowest),
            }
        )
    by_case = {r["case"]: r for r in rows}
    for r in rows:
        if r["case"] != "ddp_fp32":
            bits = r["case"].split("_")[2]
            gather = by_case[f"all_gather_{bits}"]
            r["bytes_vs_all_gather"] = gather["counted_mb"] / r["counted_mb"]
            r["bytes_vs_ddp_sync"] = by_case["ddp_fp32"]["counted_mb"] / r["counted_mb"]
    return rows


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'K':>2} {'link':<12} {'case':<28} {'counted MB':>10} {'wire MB':>8} {'wire/cnt':>8} "
        f"{'TCP/cnt':>8} {'x fewer vs AG':>13} {'x vs DDP':>8} {'sync s (min-max)':>22}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        wire = f"{r['wire_mb']:8.2f}" if r["wire_mb"] is not None else f"{'-':>8}"
        ratio = f"{r['wire_over_counted']:8.3f}" if r["wire_over_counted"] else f"{'-':>8}"
        payload = f"{r['payload_over_counted']:8.3f}" if r["payload_over_counted"] else f"{'-':>8}"
        vs_ag = f"{r['bytes_vs_all_gather']:13.2f}" if "bytes_vs_all_gather" in r else f"{'-':>13}"
        vs_ddp = f"{r['bytes_vs_ddp_sync']:8.1f}" if "bytes_vs_ddp_sync" in r else f"{'-':>8}"
        spread = f"{r['sync_s']:.3f} ({r['sync_s_min']:.3f}-{r['sync_s_max']:.3f})"
        print(
            f"{r['K']:>2} {r['link']:<12} {r['case']:<28} {r['counted_mb']:10.2f} {wire} {ratio} "
            f"{payload} {vs_ag} {vs_ddp} {spread:>22}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8], help="K on loopback")
    parser.add_argument("--wan-k", type=int, default=4, help="K on the WAN testbed")
    parser.add_argument("--no-wan", action="store_true", help="skip the WAN testbed")
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="WAN link rate (Mbit/s)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--model", default="small", help="preset whose parameter shapes are synced")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--iface", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return
    from muloco.testbed.network import missing_requirements

    shared = missing_requirements() is None
    rows = []
    for K in args.ks:
        rows += summarize(launch(args, K, wan=False), K, "loopback", loopback_shared=shared)
    if not args.no_wan:
        rows += summarize(launch(args, args.wan_k, wan=True), args.wan_k, f"{args.rate_mbit:g} Mbit/s", False)
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "reps": args.reps, "command": " ".join(sys.argv)}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
