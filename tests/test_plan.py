"""The WAN link model and `muloco plan` against hand-computed figures."""

import json

import pytest
from test_helpers import run_muloco

from muloco.cli import main
from muloco.wan import Link, allgather_seconds, allreduce_seconds, estimate_step_seconds, parse_count, plan


def test_link_times_are_bytes_over_bandwidth_plus_hops():
    link = Link(bandwidth_mbps=100, latency_ms=10, efficiency=1.0)
    # 4 workers, 40 MB fp32: ring all-reduce sends 2 * 3/4 * 40 MB = 60 MB = 480 Mbit -> 4.8 s, 6 hops.
    assert allreduce_seconds(link, 40e6, 4) == pytest.approx(4.8 + 0.06)
    # all-gather of 5 MB messages: 3 * 5 MB = 120 Mbit -> 1.2 s, 3 hops.
    assert allgather_seconds(link, 5e6, 4) == pytest.approx(1.2 + 0.03)
    assert allreduce_seconds(link, 40e6, 1) == 0.0


def test_the_payload_rate_is_the_line_rate_less_headers():
    # TCP over Ethernet carries 1448 payload bytes per 1514-byte frame: 100 Mbit/s moves 95.64 Mbit/s of data.
    assert Link(100).seconds(1e6, 0) == pytest.approx(8e6 / (100e6 * 1448 / 1514))
    assert Link(100).seconds(1e6, 0) / Link(100, efficiency=1.0).seconds(1e6, 0) == pytest.approx(1514 / 1448)


def test_plan_rows_by_hand():
    rows = plan(10e6, 4, 30, 0.1, Link(100, efficiency=1.0), bits=4, fragments=3, overlap=2)
    ddp, diloco, muloco, streaming = rows
    assert ddp.network_s == pytest.approx(30 * 8 * 2 * 0.75 * 40e6 / 100e6)  # 30 all-reduces of 40 MB
    assert diloco.network_s == pytest.approx(8 * 2 * 0.75 * 40e6 / 100e6)
    assert muloco.network_s == pytest.approx(8 * 3 * 5e6 / 100e6)  # all-gather of 3 x 5 MB
    # Streaming: 3 transfers of 1/3 each (0.4 s), each hidden behind 2 x 0.1 s of compute.
    assert streaming.network_s == pytest.approx(muloco.network_s)
    assert streaming.wait_s == pytest.approx(3 * (0.4 - 0.2))
    assert streaming.peak_bytes_per_sync == pytest.approx(muloco.peak_bytes_per_sync / 3)
    assert all(r.compute_s == pytest.approx(3.0) for r in rows)
    assert ddp.wait_fraction > diloco.wait_fraction > muloco.wait_fraction > streaming.wait_fraction


def test_counts_and_step_estimate():
    assert parse_count("150M") == 150e6 and parse_count("1.3B") == 1.3e9 and parse_count("2k") == 2000
    with pytest.raises(ValueError):
        parse_count("12x")
    assert estimate_step_seconds(100e6, 1000, 1.0) == pytest.approx(0.6)


def test_plan_command_prints_every_method_per_bandwidth(capsys):
    assert main(["plan", "--params", "150M", "--step-time-s", "0.5", "--bandwidth-mbps", "100", "1000"]) == 0
    out = capsys.readouterr().out
    assert out.count("DDP (fp32 every step)") == 2 and "streaming MuLoCo 4-bit P=3 tau=2" in out
    assert main(["plan", "--params", "nano", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [len(b["rows"]) for b in data] == [4, 4]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--params", "lots"], "--params"),
        (["--bits", "3"], "--bits"),
        (["--overlap", "20", "--fragments", "3"], "--overlap"),
        (["--bandwidth-mbps", "0"], "--bandwidth-mbps"),
    ],
)
def test_plan_bad_input_exits_2_with_one_line(args, needle):
    result = run_muloco("plan", *args, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in result.stderr
