"""The WAN link model and `muloco plan` against hand-computed figures."""

import json
from dataclasses import replace

import pytest
from test_helpers import run_muloco_here

from muloco.cli import main
from muloco.net.wan import (
    Link,
    Workload,
    allgather_seconds,
    allreduce_round_trips,
    allreduce_seconds,
    bytes_in_flight,
    estimate_step_seconds,
    faster_transport,
    parse_count,
    plan,
    pro_rata,
    reduce_scatter_seconds,
    reduce_scatter_shares,
    sync_round_trips,
    wall_clock,
)


def test_a_collective_takes_its_bytes_or_its_round_trips_whichever_is_longer():
    link = Link(bandwidth_mbps=100, latency_ms=10, efficiency=1.0)  # a round trip: 20 ms
    # 4 workers, 40 MB fp32: ring all-reduce sends 2 * 3/4 * 40 MB = 60 MB = 480 Mbit -> 4.8 s, more than
    # its 2K = 8 round trips (0.16 s).
    assert allreduce_seconds(link, 40e6, 4) == pytest.approx(4.8)
    # all-gather of 5 MB messages: 3 * 5 MB = 120 Mbit -> 1.2 s (3 round trips: 0.06 s).
    assert allgather_seconds(link, 5e6, 4) == pytest.approx(1.2)
    assert allreduce_seconds(link, 40e6, 1) == 0.0
    # reduce-scatter of 5 MB messages and 5 MB means: 3/4 x 10 MB = 60 Mbit -> 0.6 s (1 + 3 round trips).
    assert reduce_scatter_seconds(link, 5e6, 5e6, 4) == pytest.approx(0.6)
    # 1 KB: the round trips are the time (the bytes, 0.24 ms at most, hide behind them).
    assert allreduce_seconds(link, 1e3, 4) == pytest.approx(8 * 0.02)
    # Past 2K MiB gloo adds a segment (a round trip) per MiB: 64 MiB over 4 nodes, 64 round trips, 1.28 s,
    # more than its 96 MiB of bytes at 1 Gbit/s (0.81 s); 8 MiB still 8.
    fast = Link(bandwidth_mbps=1000, latency_ms=10, efficiency=1.0)
    assert allreduce_round_trips(4, 8 * 2**20) == 8 and allreduce_round_trips(4, 64 * 2**20) == 64
    assert allreduce_round_trips(4, 65 * 2**20) == 68  # segments rounded up to a multiple of the ranks
    assert allreduce_seconds(fast, 64 * 2**20, 4) == pytest.approx(64 * 0.02)
    assert allgather_seconds(link, 1e3, 4) == pytest.approx(3 * 0.02)
    assert reduce_scatter_seconds(link, 1e3, 1e3, 4) == pytest.approx(4 * 0.02)
    # Its two collectives run one after the other, each bound on its own: at 40 ms round trips, 1 MB parts
    # (3/4 MB = 6 Mbit: 60 ms, more than their 1 round trip) then 1 MB means (60 ms of bytes, less than
    # their 3 round trips: 120 ms): 180 ms, where one max over both would say 160.
    far = Link(bandwidth_mbps=100, latency_ms=20, efficiency=1.0)
    assert reduce_scatter_seconds(far, 1e6, 1e6, 4) == pytest.approx(0.06 + 0.12)
    work = Workload(steps=1, step_compute_s=0.0, syncs=1, bytes_per_sync=1.5e6, round_trips_per_sync=4)
    assert wall_clock(replace(work, phases=((0.5, 1), (0.5, 3))), far) == pytest.approx(0.18)
    assert wall_clock(work, far) == pytest.approx(0.16)


def test_a_measured_syncs_shape_round_trips_phases_and_pro_rata_cut():
    """What a Workload is built from: each transport's round trips, reduce_scatter's phases as shares of
    the bytes muloco counts, and a run's syncs and bytes up to a step."""
    assert [sync_round_trips(t, 4) for t in ("all_reduce", "all_gather", "reduce_scatter")] == [8, 3, 4]
    assert sync_round_trips("all_reduce", 4, 64 * 2**20) == 64  # a gloo segment per MiB past 2K
    # 4-bit parts, 8-bit owners' means over 4 workers: 3/4 of each is sent, a third and two thirds of it.
    (parts, means) = reduce_scatter_shares(4, 4, 8)
    assert parts == (pytest.approx(1 / 3), 1) and means == (pytest.approx(2 / 3), 3)
    link = Link(bandwidth_mbps=100, latency_ms=20, efficiency=1.0)
    # 1 MB parts and 2 MB means: 3/4 of 3 MB sent, which the shares split as the two collectives send it.
    work = Workload(steps=1, step_compute_s=0.0, syncs=1, bytes_per_sync=2.25e6, round_trips_per_sync=4)
    shared = replace(work, phases=reduce_scatter_shares(4, 1e6, 2e6))
    assert wall_clock(shared, link) == pytest.approx(reduce_scatter_seconds(link, 1e6, 2e6, 4))
    # The first 150 of 300 steps of a run with 20 syncs that sent 10 MB: 10 syncs of 0.5 MB; 100 steps: 6.67
    # syncs, rounded to 7, of the 3.33 MB sent by then.
    assert pro_rata(150, 300, 20, 10e6) == (10, pytest.approx(0.5e6))
    assert pro_rata(100, 300, 20, 10e6) == (7, pytest.approx(10e6 / 3 / 7))
    assert pro_rata(1, 300, 20, 10e6)[0] == 0  # no sync yet: the bytes over one, not a division by zero


def test_a_workloads_wall_clock_is_compute_plus_what_overlap_does_not_hide():
    link = Link(bandwidth_mbps=100, latency_ms=10, efficiency=1.0)
    # A sync: 1.25 MB = 10 Mbit -> 0.1 s, more than its 2 round trips (0.04 s). 30 steps of 10 ms: 0.3 s.
    work = Workload(steps=30, step_compute_s=0.01, syncs=2, bytes_per_sync=1.25e6, round_trips_per_sync=2)
    assert wall_clock(work, link) == pytest.approx(0.3 + 2 * 0.1)
    # tau = 6 steps hide 0.06 s of each sync; 10 steps hide all of it.
    assert wall_clock(replace(work, hidden_steps=6), link) == pytest.approx(0.3 + 2 * 0.04)
    assert wall_clock(replace(work, hidden_steps=10), link) == pytest.approx(0.3)
    # A latency-bound sync: 1 KB in 6 round trips, 0.12 s.
    assert wall_clock(replace(work, bytes_per_sync=1e3, round_trips_per_sync=6), link) == pytest.approx(0.54)
    # Round trips that its bytes do not overlap (a blocking exchange of sizes, matchmaking) add to them.
    assert wall_clock(replace(work, serial_round_trips_per_sync=2), link) == pytest.approx(0.3 + 2 * 0.14)
    # Its local cost (codec, outer step, waiting for the slowest process) is paid even when tau hides the
    # transfer.
    hidden = replace(work, hidden_steps=10, local_s_per_sync=0.02)
    assert wall_clock(hidden, link) == pytest.approx(0.3 + 2 * 0.02)
    # Its collective took 0.03 s on loopback, inside the 0.05 s local cost measured there: the link's 0.1 s
    # replaces it rather than adds to it; a link faster than loopback leaves the loopback run's time; a
    # sync that tau hid on loopback as well paid nothing there.
    measured = replace(work, local_s_per_sync=0.05, loopback_transfer_s=0.03)
    assert wall_clock(measured, link) == pytest.approx(0.3 + 2 * (0.05 - 0.03 + 0.1))
    fast = Link(bandwidth_mbps=1e5, latency_ms=0, efficiency=1.0)
    assert wall_clock(measured, fast) == pytest.approx(0.3 + 2 * 0.05)
    assert wall_clock(replace(measured, hidden_steps=10), link) == pytest.approx(0.3 + 2 * 0.05)


def test_faster_transport_follows_k_bytes_and_latency():
    assert faster_transport(None, 5e6, 5e6, 2) == "all_gather"  # same bytes at K = 2, one quantization
    assert faster_transport(None, 5e6, 5e6, 3) == "reduce_scatter"
    assert faster_transport(None, 5e6, 5e6, 8) == "reduce_scatter"
    # A tiny message on a high-latency link: the extra hop costs more than the bytes saved.
    assert faster_transport(Link(1000, latency_ms=50), 1e3, 1e3, 4) == "all_gather"
    assert faster_transport(Link(100, latency_ms=50), 5e6, 5e6, 4) == "reduce_scatter"


def test_the_payload_rate_is_the_line_rate_less_headers():
    # TCP over Ethernet carries 1448 payload bytes per 1514-byte frame: 100 Mbit/s moves 95.64 Mbit/s of data.
    assert Link(100).seconds(1e6, 0) == pytest.approx(8e6 / (100e6 * 1448 / 1514))
    assert Link(100).seconds(1e6, 0) / Link(100, efficiency=1.0).seconds(1e6, 0) == pytest.approx(1514 / 1448)


def test_plan_rows_by_hand():
    rows = plan(10e6, 4, 30, 0.1, Link(100, efficiency=1.0), bits=4, fragments=3, overlap=2)
    ddp, diloco, gather, scatter, streaming = rows
    assert ddp.network_s == pytest.approx(30 * 8 * 2 * 0.75 * 40e6 / 100e6)  # 30 all-reduces of 40 MB
    assert diloco.network_s == pytest.approx(8 * 2 * 0.75 * 40e6 / 100e6)
    assert gather.network_s == pytest.approx(8 * 3 * 5e6 / 100e6)  # all-gather of 3 x 5 MB
    assert scatter.network_s == pytest.approx(8 * 0.75 * 10e6 / 100e6)  # 3/4 x (5 MB + 5 MB of means)
    assert gather.bytes_per_outer_step / scatter.bytes_per_outer_step == pytest.approx(2.0)
    # Streaming (tau > 0) takes the all-gather, whose one collective overlaps compute (reduce-scatter's
    # second waits for the apply step): 3 transfers of 1/3 each (0.4 s), 2 x 0.1 s of each hidden.
    assert "all-gather" in streaming.method
    assert streaming.network_s == pytest.approx(gather.network_s)
    assert streaming.wait_s == pytest.approx(3 * (0.4 - 0.2))
    assert streaming.peak_bytes_per_sync == pytest.approx(gather.peak_bytes_per_sync / 3)
    assert all(r.compute_s == pytest.approx(3.0) for r in rows)
    assert ddp.wait_fraction > diloco.wait_fraction > gather.wait_fraction > scatter.wait_fraction


def test_counts_and_step_estimate():
    assert parse_count("150M") == 150e6 and parse_count("1.3B") == 1.3e9 and parse_count("2k") == 2000
    with pytest.raises(ValueError):
        parse_count("12x")
    assert estimate_step_seconds(100e6, 1000, 1.0) == pytest.approx(0.6)


def test_plan_command_prints_every_method_per_bandwidth(capsys):
    assert main(["plan", "--params", "150M", "--step-time-s", "0.5", "--bandwidth-mbps", "100", "1000"]) == 0
    out = capsys.readouterr().out
    assert out.count("DDP (fp32 every step)") == 2 and "streaming MuLoCo 4-bit P=3 tau=2" in out
    assert out.count("all-gather") == 4 and out.count("H=30 reduce-scatter") == 2  # streaming's too
    assert main(["plan", "--params", "nano", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [len(b["rows"]) for b in data] == [5, 5]


def test_plan_projects_a_configs_run_and_flags_win_over_it(capsys):
    """`muloco plan CONFIG [KEY=VALUE ...]`: that run's model size, K, H, bits and streaming."""
    from muloco.cli.plan import config_params
    from muloco.config import load_config

    qs = "configs/quickstart.yaml"
    overrides = ["workers=8", "sync.every=20", "sync.fragments=2", "sync.overlap=1"]
    args = ["compression.scheme=statistical", "compression.bits=2", "model.preset=small"]
    assert main(["plan", qs, *overrides, *args, "--step-time-s", "0.1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)[0]["rows"]
    params = config_params(load_config(qs, ["model.preset=small"]))
    by_hand = plan(params, 8, 20, 0.1, Link(100), bits=2, fragments=2, overlap=1)
    assert [r["total_s"] for r in rows] == pytest.approx([r.total_s for r in by_hand])
    assert 10e6 < params < 12e6  # the small preset: 10.9M
    assert main(["plan", qs, "workers=8", "--workers", "2", "--bandwidth-mbps", "100"]) == 0
    out = capsys.readouterr().out
    assert "the run of configs/quickstart.yaml workers=8" in out and "workers=2 H=15" in out


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--params", "lots"], "--params"),
        (["workers=3"], "need a CONFIG"),
        (["configs/quickstart.yaml", "workers=abc"], "override 'workers=abc'"),
        (["--bits", "3"], "--bits"),
        (["--overlap", "20", "--fragments", "3"], "--overlap"),
        (["--bandwidth-mbps", "0"], "--bandwidth-mbps"),
    ],
)
def test_plan_bad_input_exits_2_with_one_line(args, needle):
    result = run_muloco_here("plan", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in result.stderr


def test_nccl_adds_its_ring_steps_delays_to_its_bytes():
    """NCCL pushes each ring step's data without a handshake: its bytes at the payload rate plus one one-way
    delay per step (2 (K-1) for an all-reduce), not a round trip per 1 MiB segment as gloo."""
    link = Link(bandwidth_mbps=100, latency_ms=10, efficiency=1.0)  # one way 10 ms
    # 40 MB over 4 nodes: 60 MB = 4.8 s of bytes, plus 6 steps x 10 ms.
    assert allreduce_seconds(link, 40e6, 4, "nccl") == pytest.approx(4.8 + 0.06)
    assert allgather_seconds(link, 5e6, 4, "nccl") == pytest.approx(1.2 + 0.03)
    # reduce_scatter: the parts' all-to-all (3/4 x 5 MB, one step), then the means' all-gather (three).
    assert reduce_scatter_seconds(link, 5e6, 5e6, 4, "nccl") == pytest.approx(0.3 + 0.01 + 0.3 + 0.03)
    assert allreduce_seconds(link, 40e6, 1, "nccl") == 0.0
    # A 64 MiB all-reduce at 1 Gbit/s, 10 ms one way: gloo's 64 segments cost 64 round trips (1.28 s), NCCL
    # its bytes (0.81 s) and 6 one-way delays.
    fast = Link(bandwidth_mbps=1000, latency_ms=10, efficiency=1.0)
    assert allreduce_seconds(fast, 64 * 2**20, 4) == pytest.approx(1.28)
    assert allreduce_seconds(fast, 64 * 2**20, 4, "nccl") == pytest.approx(8 * 96 * 2**20 / 1e9 + 0.06)
    # What keeps the link full: its bandwidth x a round trip in flight (10 Gbit/s, 20 ms one way: 50 MB).
    assert bytes_in_flight(Link(10_000, latency_ms=20)) == pytest.approx(50e6)


# NVIDIA/nccl issue #209 (2019-06-04): nccl-tests all_reduce_perf over TCP sockets on GCP's 32 Gbit/s
# instances, 1 GPU per node, NCCL 2.4.7: the bus bandwidth (bytes each node sends per second) of messages
# from 32 MiB (2 nodes, 1 x 8 sockets) and 128 MiB (4 nodes, 2 x 8 sockets), three runs each, Gbit/s.
NCCL_ISSUE_209_BUSBW_GBIT = {2: (30.6, 31.0, 31.4), 4: (30.4, 30.8, 30.8)}


@pytest.mark.parametrize("nodes", sorted(NCCL_ISSUE_209_BUSBW_GBIT))
def test_nccl_fills_the_link_as_measured_over_tcp(nodes):
    """The model's byte term: NCCL with enough sockets sends at the TCP payload rate (32 x 1448/1514 = 30.6
    Gbit/s). Within 3% of every run (GCP's 1460-byte MTU and its rate cap are not exactly ours). A LAN's
    ~50 us one way adds its ring steps' delays, under 0.2% at these sizes."""
    link = Link(bandwidth_mbps=32_000, latency_ms=0.05)
    size = 128 * 2**20
    busbw_gbit = 2 * (nodes - 1) / nodes * size * 8 / allreduce_seconds(link, size, nodes, "nccl") / 1e9
    for measured in NCCL_ISSUE_209_BUSBW_GBIT[nodes]:
        assert busbw_gbit == pytest.approx(measured, rel=0.03)


def test_gloo_plan_is_unchanged_and_nccl_is_byte_bound_for_a_1b_model():
    """`muloco plan --params 1B --bandwidth-mbps 1000 10000 --latency-ms 20`: over gloo DDP takes 4,608.69 s
    per outer step at both rates (its 4 GB all-reduce: ~3,800 segments, a round trip each); over NCCL the
    bytes set it, ~10x apart (docs/wan.md's deployment: ratios ~50 and ~5 of its 0.98 s step)."""
    step = estimate_step_seconds(1e9, 16384, 100.0)
    slow, fast = Link(1000, latency_ms=20), Link(10_000, latency_ms=20)
    for link in (slow, fast):
        assert plan(1e9, 4, 30, step, link)[0].total_s == pytest.approx(4608.69, abs=0.005)
    nccl_slow, nccl_fast = (plan(1e9, 4, 30, step, link, backend="nccl") for link in (slow, fast))
    assert all(r.backend == "nccl" for r in nccl_slow + nccl_fast)
    ratio = nccl_slow[0].network_s / nccl_fast[0].network_s
    assert 9.5 < ratio < 10.0  # the bytes 10x, the same 3 round trips per all-reduce at both
    ddp_step = nccl_slow[0].network_s / 30
    assert ddp_step / step == pytest.approx(51, abs=1) and nccl_fast[0].network_s / 30 / step < 5.3
    # The compressed rows were byte-bound over gloo too: they move by the ring steps' delays only.
    for gloo, nccl in zip(plan(1e9, 4, 30, step, slow)[2:], nccl_slow[2:]):
        assert nccl.network_s == pytest.approx(gloo.network_s, rel=0.02)


def test_plan_names_its_transport_and_takes_the_runs(capsys, monkeypatch):
    """The table says whose collectives it models; the default is what the run would use: the config's
    backend.torch.dist_backend, else its device, else CUDA on this machine."""
    import torch

    args = ["plan", "--params", "1B", "--bandwidth-mbps", "1000", "10000", "--latency-ms", "20"]
    assert main([*args, "--transport", "gloo"]) == 0
    out = capsys.readouterr().out
    assert "transport: gloo (--transport)" in out and out.count("4608.69") == 2
    assert main([*args, "--transport", "nccl"]) == 0
    out = capsys.readouterr().out
    assert "transport: nccl (--transport)" in out and "4608.69" not in out
    assert "50.0 MB in flight per node" in out  # 10 Gbit/s x 40 ms
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main([*args, "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)
    assert [e["transport"] for e in entries] == ["nccl", "nccl"]
    assert {r["backend"] for e in entries for r in e["rows"]} == {"nccl"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(args) == 0
    assert "transport: gloo (no CUDA on this machine" in capsys.readouterr().out
    qs = "configs/quickstart.yaml"
    for overrides, expected in (
        (["device=cuda"], "transport: nccl (the config's device=cuda)"),
        (["device=cpu"], "transport: gloo (the config's device=cpu)"),
        (["device=cuda", "backend.torch.dist_backend=gloo"], "dist_backend=gloo)"),
        (["backend.kind=torchft"], "transport: gloo (backend.kind=torchft"),
    ):
        assert main(["plan", qs, *overrides, "--bandwidth-mbps", "100"]) == 0
        assert expected in capsys.readouterr().out
    assert main(["plan", qs, "device=cuda", "--transport", "gloo"]) == 0
    assert "transport: gloo (--transport)" in capsys.readouterr().out
