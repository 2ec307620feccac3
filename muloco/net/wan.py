"""What communication would cost on a wide-area link, and the `muloco plan` projection.

A link is a bandwidth (Mbit/s, each node's upload: the line rate) and a one-way latency. Two libraries run
the collectives (`backend`, torch.distributed's name for them): gloo (CPU runs; every function's default,
the model the WAN headline was measured against) and NCCL (CUDA runs), modelled below it.

gloo. A collective's time on a link is the longer of two: the bytes one node sends over the payload rate
(the line rate less TCP/IP/Ethernet headers), and its round trips. gloo's ring sends a chunk only once
its receiver has posted the buffer for it (the receiver's notice is one one-way trip, the data another),
so every ring hop costs a round trip; it keeps two half-chunks in flight, so one half's bytes hide the
other's round trip and a collective is either byte-bound or latency-bound, not both (gloo/allgather.cc,
gloo/allreduce.cc):

- ring all-reduce of P bytes (fp32 pseudogradients, DDP gradients): 2 (K-1)/K P bytes (reduce-scatter then
  all-gather; Patarasuk & Yuan 2009); gloo splits it into segments of at most 1 MiB, at least 2K, two in
  flight: a round trip per segment (2K up to 2K MiB; a 1B model's 4 GB: ~3,800, so over a 20 ms link its
  all-reduce takes at least ~150 s however fast the link: latency-bound above ~330 Mbit/s);
- all-gather of compressed messages of P bytes each: (K-1) P bytes, K-1 round trips;
- reduce-scatter of compressed parts (sync.transport: reduce_scatter; message P, owners' means Q): K-1 parts
  of P / K sent directly to their owners (an all-to-all: (K-1)/K P bytes, one round trip), then a ring
  all-gather of the K means of Q / K ((K-1)/K Q bytes, K-1 round trips). The two run one after the other
  (an owner reduces its parts between them), so each is byte- or latency-bound on its own and their times
  add. Both are padded to bounds every node computes alike (muloco/sync/reduce.py), so neither waits for
  an exchange of sizes first.

Measured over the testbed (4 hosts, 20 ms one way; experiments/wan/probe_collectives.py, docs/wan.md): the
all-reduce of pico's 739 KB took 310 ms at 350 Mbit/s (8 round trips: 320) and 1,344 ms at 6.89 Mbit/s
(its bytes: 1,345); an all-gather of 37 KB messages 134 ms at 350 Mbit/s (3 round trips: 120).

NCCL over TCP (its net/socket transport, src/transport/net_socket.cc), with a ring: what its tuner picks
for buffers of MBs and more (src/graph/tuning.cc; for small ones it may pick a tree or PAT, with fewer
steps). Its sender pushes each step's data without a handshake (a size header, then the data: no round
trip per chunk, unlike gloo) into its receiver's NCCL_BUFFSIZE (4 MiB by default, NCCL_STEPS = 8 slots)
per channel, 2 channels per NIC typically, each over NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD sockets
(by default its one socket; AWS 16, GCP 4). With enough of them in flight the bytes go at the
payload rate, and what the pipeline cannot hide is its fill: one one-way delay per ring step, added to the
bytes, as NCCL's own tuner adds nsteps x a step's latency to bytes / bandwidth (tuning.cc):

- ring all-reduce: 2 (K-1)/K P bytes, 2 (K-1) steps: K-1 round trips, whatever P;
- all-gather of messages of P bytes: (K-1) P bytes, K-1 steps;
- reduce_scatter: the all-to-all of parts (NCCL's grouped sends to the K-1 peers, concurrently: one step),
  then the owners' means' all-gather (K-1 steps), one after the other.

Keeping the link full takes the bandwidth x round trip in flight per node (50 MB at 10 Gbit/s and 20 ms
one way): enough sockets with TCP windows to match (net.ipv4.tcp_rmem / tcp_wmem), else NCCL runs slower
than modelled. Checked against NVIDIA/nccl issue #209 (GCP, 32 Gbit/s TCP, 1 GPU per node, 8-16 sockets):
all-reduce bus bandwidth 30.4-31.4 Gbit/s on 2 and 4 nodes, this model 30.6 (tests/net/test_wan.py); with
8 GPUs per node the same issue measured 14.5-22.9: NCCL does not always fill the link, and this is the
case where it does. No published NCCL figure over a WAN's latency was found: the latency term is the
tuner's form with a WAN's one-way delay, an assumption (a 1B model's all-reduce over 20 ms: 0.12 s of its
5-50 s at 10-1 Gbit/s).

Overlap: a sync started at inner step t and applied at t + tau runs while tau inner steps compute, so only
max(0, transfer - tau x step time) is spent waiting (Streaming DiLoCo, arXiv:2501.18512, section 2.3).
DDP is modelled without overlap: `method: dp` over processes is torch's DDP, whose buckets' all-reduces
overlap the backward where the gradient spans several buckets (pico's fits torch's first, 1 MiB: none), so
the DDP rows are an upper bound on its waiting.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from muloco.comm.base import reduce_scatter_bytes, ring_allgather_bytes, ring_allreduce_bytes

# Share of a full-size Ethernet frame that is TCP payload: MSS 1448 B (1500 MTU - 20 IP - 20 TCP - 12 TCP
# timestamps, RFC 7323) of 1514 B on the wire with the 14 B Ethernet header. The emulated WAN measured 95.7%
# of the line rate as goodput (docs/records/benchmarks.md, "WAN emulation").
TCP_PAYLOAD_EFFICIENCY = 1448 / 1514


@dataclass(frozen=True)
class Link:
    bandwidth_mbps: float
    latency_ms: float = 0.0
    efficiency: float = TCP_PAYLOAD_EFFICIENCY  # payload bytes per byte on the wire

    def seconds(self, bytes_sent: float, round_trips: float, serial_round_trips: float = 0.0) -> float:
        """A collective that sends `bytes_sent` per node in `round_trips`: its bytes or its round trips,
        whichever take longer (the module's docstring); plus `serial_round_trips` that no bytes overlap
        (a blocking exchange of sizes before the data, a matchmaking round)."""
        payload_rate = self.bandwidth_mbps * 1e6 * self.efficiency
        overlapped = max(8.0 * bytes_sent / payload_rate, round_trips * self.round_trip_s)
        return serial_round_trips * self.round_trip_s + overlapped

    @property
    def round_trip_s(self) -> float:
        return 2.0 * self.latency_ms / 1e3


# gloo's ring all-reduce cuts the buffer into segments of at most 1 MiB, at least 2 per rank, rounded to a
# multiple of the ranks (gloo/allreduce.cc: kMaxSegmentSize, numSegments), and keeps two in flight.
GLOO_MAX_SEGMENT_BYTES = 1 << 20


# Round trips of each collective over K nodes as gloo runs it (the module's docstring).
def allreduce_round_trips(workers: int, payload_bytes: float = 0.0) -> int:
    """One per gloo segment: 2K up to 2K MiB, then one more per MiB. Measured over the testbed (4 hosts,
    350 Mbit/s, 50 ms one way; probe_collectives.py --all-reduce-sizes, median of 3 runs): 7.7, 7.6, 15.6,
    30.9 and 62.9 round trips for 0.7, 4, 16, 32 and 64 MiB (this: 8, 8, 16, 32, 64); 6.1 for 4 KB."""
    segments = max(math.ceil(payload_bytes / GLOO_MAX_SEGMENT_BYTES), 2 * workers)
    return math.ceil(segments / workers) * workers


def allgather_round_trips(workers: int) -> int:
    return workers - 1


def reduce_scatter_phases(
    workers: int, message_bytes: float, mean_bytes: float
) -> tuple[tuple[float, int], ...]:
    """(bytes one node sends, round trips) of reduce_scatter's two collectives, in their order: the parts
    to their owners, then the owners' means (the module's docstring)."""
    share = (workers - 1) / workers
    return ((share * message_bytes, 1), (share * mean_bytes, workers - 1))


# The libraries whose collectives are modelled (the module's docstring), as torch.distributed names them.
BACKENDS = ("gloo", "nccl")
BACKEND_MODELS = {
    "gloo": "gloo's ring: its bytes or a round trip per segment of at most 1 MiB, whichever is longer",
    "nccl": "NCCL's ring over TCP sockets, the link kept full: its bytes plus a one-way delay per ring step "
    "(2(K-1) per all-reduce)",
}


def nccl_ring_steps(collective: str, workers: int) -> int:
    """Ring steps of one NCCL collective over K nodes, each one one-way delay that its bytes do not hide
    (tuning.cc's nsteps): all_reduce 2 (K-1), all_gather K-1, all_to_all (grouped sends to every peer at
    once) 1."""
    steps = {"all_reduce": 2 * (workers - 1), "all_gather": workers - 1, "all_to_all": 1}
    return steps[collective]


def nccl_seconds(link: Link, bytes_sent: float, collective: str, workers: int) -> float:
    """An NCCL collective that sends `bytes_sent` per node: its bytes at the payload rate, plus its ring
    steps' one-way delays (half a round trip each), which the pipeline does not hide."""
    return link.seconds(bytes_sent, 0, nccl_ring_steps(collective, workers) / 2)


def bytes_in_flight(link: Link) -> float:
    """What one node must have in flight to keep `link` full: its bandwidth x a round trip (bytes)."""
    return link.bandwidth_mbps * 1e6 / 8 * link.round_trip_s


def allreduce_seconds(link: Link, payload_bytes: float, workers: int, backend: str = "gloo") -> float:
    if workers <= 1:
        return 0.0
    sent = ring_allreduce_bytes(payload_bytes, workers)
    if backend == "nccl":
        return nccl_seconds(link, sent, "all_reduce", workers)
    assert backend == "gloo", f"{backend=}"
    return link.seconds(sent, allreduce_round_trips(workers, payload_bytes))


def allgather_seconds(link: Link, payload_bytes: float, workers: int, backend: str = "gloo") -> float:
    if workers <= 1:
        return 0.0
    sent = ring_allgather_bytes(payload_bytes, workers)
    if backend == "nccl":
        return nccl_seconds(link, sent, "all_gather", workers)
    assert backend == "gloo", f"{backend=}"
    return link.seconds(sent, allgather_round_trips(workers))


def reduce_scatter_seconds(
    link: Link, message_bytes: float, mean_bytes: float, workers: int, backend: str = "gloo"
) -> float:
    """Its two collectives' times added, each its bytes or its round trips (gloo; NCCL: its bytes plus its
    steps' delays). Over the testbed (4 hosts, 6.33 Mbit/s, 20 ms one way; probe_collectives.py,
    docs/wan.md) the 2-bit pico sync took 210 ms: this 183 ms, one max over both collectives 172 ms (its
    means' all-gather is latency-bound, its parts not)."""
    if workers <= 1:
        return 0.0
    phases = reduce_scatter_phases(workers, message_bytes, mean_bytes)
    if backend == "nccl":
        (parts, _), (means, _) = phases
        return nccl_seconds(link, parts, "all_to_all", workers) + nccl_seconds(
            link, means, "all_gather", workers
        )
    assert backend == "gloo", f"{backend=}"
    return sum(link.seconds(sent, round_trips) for sent, round_trips in phases)


def sync_seconds(
    link: Link,
    payload_bytes: float,
    workers: int,
    transport: str,
    mean_bytes: float | None = None,
    backend: str = "gloo",
) -> float:
    """One sync of one message of `payload_bytes` per worker by `transport` (the engine's: all_reduce of
    fp32 sums, all_gather of compressed messages, or reduce_scatter of their parts with owners' means of
    `mean_bytes`, default the message's size), its collectives run by `backend` (gloo or nccl)."""
    if transport == "all_reduce":
        return allreduce_seconds(link, payload_bytes, workers, backend)
    if transport == "all_gather":
        return allgather_seconds(link, payload_bytes, workers, backend)
    assert transport == "reduce_scatter", f"{transport=}"
    means = payload_bytes if mean_bytes is None else mean_bytes
    return reduce_scatter_seconds(link, payload_bytes, means, workers, backend)


def sync_round_trips(transport: str, workers: int, payload_bytes: float = 0.0) -> int:
    """Round trips of one sync by `transport` (the engine's) that its bytes overlap: an all-reduce's one
    per gloo segment of `payload_bytes` (2K up to 2K MiB: pico's 739 KB and any smaller buffer), an
    all-gather's K-1, reduce_scatter's two collectives' 1 + (K-1)."""
    if transport == "all_reduce":
        return allreduce_round_trips(workers, payload_bytes)
    if transport == "all_gather":
        return allgather_round_trips(workers)
    assert transport == "reduce_scatter", f"{transport=}"
    return sum(trips for _, trips in reduce_scatter_phases(workers, 1, 1))  # round trips: not the bytes'


def faster_transport(
    link: Link | None, message_bytes: float, mean_bytes: float, workers: int, backend: str = "gloo"
) -> str:
    """all_gather or reduce_scatter for compressed syncs: the one that is faster on `link` with `backend`'s
    collectives (with no link: the one that sends fewer bytes). At K <= 2 both send the same bytes and
    all_gather quantizes once, so it wins ties."""
    if workers <= 2:
        return "all_gather"
    if link is None:
        gather = ring_allgather_bytes(message_bytes, workers)
        scatter = reduce_scatter_bytes(message_bytes, mean_bytes, workers)
    else:
        gather = allgather_seconds(link, message_bytes, workers, backend)
        scatter = reduce_scatter_seconds(link, message_bytes, mean_bytes, workers, backend)
    return "reduce_scatter" if scatter < gather else "all_gather"


@dataclass(frozen=True)
class PlanRow:
    method: str
    bytes_per_outer_step: float  # sent by one worker over H inner steps
    peak_bytes_per_sync: float
    compute_s: float  # per outer step
    network_s: float  # transfer time per outer step
    wait_s: float  # the part of network_s not hidden behind compute
    backend: str = "gloo"  # the library whose collectives were modelled (BACKENDS)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.wait_s

    @property
    def wait_fraction(self) -> float:
        return self.wait_s / self.total_s if self.total_s > 0 else 0.0


def plan(
    params: float,
    workers: int,
    sync_every: int,
    step_seconds: float,
    link: Link,
    bits: int = 4,
    fragments: int = 3,
    overlap: int = 2,
    backend: str = "gloo",
) -> list[PlanRow]:
    """Projected time per outer step (H inner steps) for DDP, DiLoCo fp32, MuLoCo `bits`-bit and streaming
    MuLoCo (`fragments` fragments, tau = `overlap`), their collectives run by `backend` (gloo or nccl).
    Compressed payloads count bits/8 bytes per parameter (the row statistics add ~1% at d >= 512; ignored
    here)."""
    H, K = sync_every, workers
    compute = H * step_seconds
    fp32 = 4.0 * params
    packed = params * bits / 8.0
    rows = []

    def row(method: str, sent: float, peak: float, network: float, wait: float) -> None:
        rows.append(PlanRow(method, sent, peak, compute, network, wait, backend))

    ddp_step = allreduce_seconds(link, fp32, K, backend)
    ddp_bytes = ring_allreduce_bytes(fp32, K)
    row("DDP (fp32 every step)", H * ddp_bytes, ddp_bytes, H * ddp_step, H * ddp_step)

    sync = allreduce_seconds(link, fp32, K, backend)
    row(f"DiLoCo fp32 H={H}", ddp_bytes, ddp_bytes, sync, sync)

    sync = allgather_seconds(link, packed, K, backend)
    gathered = ring_allgather_bytes(packed, K)
    row(f"MuLoCo {bits}-bit H={H} all-gather", gathered, gathered, sync, sync)

    sync = reduce_scatter_seconds(link, packed, packed, K, backend)
    scattered = reduce_scatter_bytes(packed, packed, K)
    row(f"MuLoCo {bits}-bit H={H} reduce-scatter", scattered, scattered, sync, sync)

    # Streaming: the transport sync.transport: auto picks (all_gather when the sync overlaps compute).
    fragment = packed / fragments
    overlapped = overlap > 0
    transport = "all_gather" if overlapped else faster_transport(link, fragment, fragment, K, backend)
    per_fragment = sync_seconds(link, fragment, K, transport, backend=backend)
    best = (transport.replace("_", "-"), gathered if transport == "all_gather" else scattered)
    hidden = overlap * step_seconds
    wait = fragments * max(0.0, per_fragment - hidden)
    method = f"streaming MuLoCo {bits}-bit P={fragments} tau={overlap} {best[0]}"
    row(method, best[1], best[1] / fragments, fragments * per_fragment, wait)
    return rows


@dataclass(frozen=True)
class Workload:
    """A run up to some loss, as measured, for projecting its wall-clock onto any link (`wall_clock`; the
    WAN headline's planner, experiments/wan/wan_report.py, builds one per measured row with sync_round_trips,
    reduce_scatter_shares and pro_rata).

    steps inner steps of step_compute_s each (one worker); syncs collectives on the link, each sending
    bytes_per_sync per worker (as muloco counts them) in round_trips_per_sync, after
    serial_round_trips_per_sync that its bytes do not overlap (Link.seconds); a sync overlaps hidden_steps
    inner steps (Streaming DiLoCo's tau; 0 when the worker waits for it)."""

    steps: int
    step_compute_s: float
    syncs: int
    bytes_per_sync: float
    round_trips_per_sync: float
    hidden_steps: int = 0
    serial_round_trips_per_sync: float = 0.0
    # What a sync costs the worker with no link to pay (its codec and outer step, waiting for the slowest
    # process at the collective): measured on loopback; overlap does not hide it.
    local_s_per_sync: float = 0.0
    # Collectives a sync runs one after another, as (share of bytes_per_sync, round trips) each, their times
    # added (reduce_scatter: the parts, then the owners' means); empty: one of round_trips_per_sync.
    phases: tuple[tuple[float, float], ...] = ()
    # The sync's collectives' own time with no link (probe_collectives.py --loopback), which the loopback
    # measurements above already hold: in local_s_per_sync, or under a DDP hook in step_compute_s.
    loopback_transfer_s: float = 0.0


def reduce_scatter_shares(
    workers: int, message_bytes: float, mean_bytes: float
) -> tuple[tuple[float, float], ...]:
    """reduce_scatter's two collectives as a Workload's phases: (share of the bytes a sync sends, round
    trips) each, for bytes_per_sync that counts both, as muloco does. Only the sizes' ratio matters: bits
    per parameter will do (the message's bits, the owners' means' compression.mean_bits; row scales, ~1%,
    left out)."""
    phases = reduce_scatter_phases(workers, message_bytes, mean_bytes)
    total = sum(sent for sent, _ in phases)
    return tuple((sent / total, trips) for sent, trips in phases)


def pro_rata(steps: int, run_steps: int, run_syncs: int, run_bytes: float) -> tuple[int, float]:
    """(syncs, bytes per sync) of a measured run's first `steps` inner steps: the run's `run_syncs` syncs
    (rounded to whole ones) and `run_bytes` per worker in proportion to `steps` of its `run_steps`."""
    share = steps / run_steps
    syncs = round(run_syncs * share)
    return syncs, run_bytes * share / max(1, syncs)


def transfer_seconds(work: Workload, link: Link) -> float:
    """One sync's time on `link`: its collectives one after another, after its serial round trips."""
    if not work.phases:
        return link.seconds(work.bytes_per_sync, work.round_trips_per_sync, work.serial_round_trips_per_sync)
    collectives = sum(link.seconds(share * work.bytes_per_sync, trips) for share, trips in work.phases)
    return work.serial_round_trips_per_sync * link.round_trip_s + collectives


def wall_clock(work: Workload, link: Link) -> float:
    """Compute, every sync's local cost, and the part of its transfer that the overlapped steps do not
    hide. A collective on a link takes at least what it took on loopback (its copies and reductions are
    the same work); the loopback measurements already paid that part (loopback_transfer_s, less what
    overlap hid there too), so it is not counted twice."""
    loopback = work.loopback_transfer_s
    transfer = max(transfer_seconds(work, link), loopback)
    hidden = work.hidden_steps * work.step_compute_s
    per_sync = work.local_s_per_sync - max(0.0, loopback - hidden) + max(0.0, transfer - hidden)
    return work.steps * work.step_compute_s + work.syncs * per_sync


def format_plan(rows: list[PlanRow]) -> str:
    header = (
        f"{'method':<50} {'s/outer step':>12} {'compute s':>10} {'network s':>10} {'wait %':>7} "
        f"{'MB/outer step':>13} {'peak MB/sync':>12}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.method:<50} {r.total_s:>12.2f} {r.compute_s:>10.2f} {r.network_s:>10.2f} "
            f"{100 * r.wait_fraction:>6.1f}% {r.bytes_per_outer_step / 1e6:>13.1f} "
            f"{r.peak_bytes_per_sync / 1e6:>12.1f}"
        )
    return "\n".join(lines)


_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMbB]?)\s*$")


def parse_count(text: str) -> float:
    """'150M' -> 1.5e8, '1.3B' -> 1.3e9, '10900000' -> 1.09e7. ValueError on anything else."""
    match = _COUNT.match(text)
    if not match:
        raise ValueError(text)
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9}[match.group(2).lower()]
    return float(match.group(1)) * scale


def estimate_step_seconds(params: float, tokens_per_step: int, tflops: float) -> float:
    """Compute time of one inner step of one worker: 6 N tokens FLOPs (forward + backward, Kaplan et al.
    2020) at `tflops` sustained."""
    return 6.0 * params * tokens_per_step / (tflops * 1e12)


def plan_as_dict(rows: list[PlanRow]) -> list[dict]:
    return [{**asdict(r), "total_s": r.total_s, "wait_fraction": r.wait_fraction} for r in rows]
