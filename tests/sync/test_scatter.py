"""The reduce-scatter transport (sync/scatter.py, sync.transport): the same mean as an all-gather when the
second quantization is exact, owners' error feedback that resumes bit for bit, malformed parts left out,
bytes constant in K, and `auto`'s choices."""

import json
import logging
import shutil

import pytest
import torch
from test_helpers import run_muloco

from muloco.checkpoint.plain import list_checkpoints
from muloco.comm import LocalBackend, reduce_scatter_bytes, ring_allgather_bytes
from muloco.compress import ErrorFeedback, get_compressor
from muloco.config import CompressionConfig, load_config
from muloco.run.trainer import Trainer
from muloco.sync import CollectiveReducer, Contribution
from muloco.sync.codec import PseudogradientCodec, pack
from muloco.sync.scatter import PartitionedCodec

SHAPES = [torch.Size([12, 8]), torch.Size([8]), torch.Size([]), torch.Size([30, 4])]
STAT = ["compression.scheme=statistical", "compression.granularity=row"]


def codecs(scheme: str, K: int, **options) -> tuple[PseudogradientCodec, PartitionedCodec]:
    comp = get_compressor(scheme, **options)
    codec = PseudogradientCodec([f"t{i}" for i in range(len(SHAPES))], [comp] * len(SHAPES))
    return codec, PartitionedCodec(codec, SHAPES, K, [comp] * len(SHAPES))


def scatter_mean(partitioned: PartitionedCodec, messages: list[bytes], owners: list | None = None):
    """The reduce-scatter of `messages` (one per replica) through the local backend (one process, K parts)."""
    K = len(partitioned.parts)
    like = [torch.zeros(s) for s in SHAPES]
    owners = owners or [None] * K
    contribution = Contribution(
        0, 0, len(messages), like, float(len(messages[0])), None, messages, partitioned, owners
    )
    return CollectiveReducer.over(LocalBackend(), workers=K).start_mean(contribution).wait()


@pytest.mark.parametrize("K", [2, 3, 4, 8])
def test_with_exact_compressors_reduce_scatter_equals_all_gather_bit_for_bit(K):
    """fp32 payloads make both quantizations exact: each element's mean is then the same sum in replica
    order over the same count, whichever worker owns it."""
    codec, partitioned = codecs("none", K)
    torch.manual_seed(K)
    deltas = [[torch.randn(s) for s in SHAPES] for _ in range(K)]
    blob = pack([codec.encode(d) for d in deltas])  # one process's replicas
    gathered, seen = codec.decode_mean([blob], K, [torch.zeros(s) for s in SHAPES])
    mean = scatter_mean(partitioned, [partitioned.encode(d) for d in deltas])
    assert seen == mean.contributors == K and mean.left_out == 0
    for a, b in zip(gathered, mean.values, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "scheme, options, exact",
    [
        ("statistical", {"bits": 4}, True),
        ("statistical", {"bits": 2}, True),
        ("linear", {"bits": 8, "granularity": "block", "block_size": 16}, True),
        ("none", {}, True),
        ("topk", {"topk_fraction": 0.1}, False),
    ],
)
@pytest.mark.parametrize("K", [3, 4])
def test_every_processes_bounds_hold_each_part_and_mean_message(scheme, options, exact, K):
    """The reduce-scatter pads both of its collectives to part_bound and mean_bound instead of exchanging
    sizes first: each part message and each owner's mean fits its bound, exactly for the fixed-size
    schemes (no padding on the wire)."""
    codec, partitioned = codecs(scheme, K, **options)
    torch.manual_seed(K)
    like = [torch.zeros(s) for s in SHAPES]
    messages = [partitioned.encode([torch.randn(s) for s in SHAPES]) for _ in range(K)]
    for j in range(K):
        parts = [partitioned.split(m)[j] for m in messages]
        mean = partitioned.average(j, parts, None, like)
        for got, bound in [
            *((len(p), partitioned.part_bound(j)) for p in parts),
            (len(mean), partitioned.mean_bound(j)),
        ]:
            assert got == bound if exact else got <= bound


def test_owner_error_feedback_resends_what_the_second_quantization_dropped():
    """Exact parts, a 4-bit second stage: applying the same mean n times, the owners' error feedback
    (decay = alpha = 1) keeps the total within one quantization error of n x mean; without it the error
    grows n-fold."""
    K, n = 4, 3
    codec = PseudogradientCodec([f"t{i}" for i in range(len(SHAPES))], [get_compressor("none")] * len(SHAPES))
    partitioned = PartitionedCodec(codec, SHAPES, K, [get_compressor("statistical", bits=4)] * len(SHAPES))
    torch.manual_seed(0)
    deltas = [[torch.randn(s) for s in SHAPES] for _ in range(K)]
    exact = [sum(d[i] for d in deltas) / K for i in range(len(SHAPES))]
    norm = sum(e.norm() ** 2 for e in exact) ** 0.5

    def total_error(owners) -> float:
        sent = [torch.zeros(s) for s in SHAPES]
        for _ in range(n):
            mean = scatter_mean(partitioned, [partitioned.encode(d) for d in deltas], owners)
            for acc, m in zip(sent, mean.values, strict=True):
                acc.add_(m)
        return sum((n * e - t).norm() ** 2 for e, t in zip(exact, sent, strict=True)) ** 0.5 / norm

    single = total_error(None) / n
    assert 0 < single < 0.2
    assert total_error([ErrorFeedback(1.0, 1.0) for _ in range(K)]) < 1.5 * single
    assert total_error(None) == pytest.approx(n * single)


def test_a_malformed_part_is_left_out_of_its_part_and_logged(caplog):
    K = 4
    _, partitioned = codecs("linear", K, bits=8)
    torch.manual_seed(1)
    messages = [partitioned.encode([torch.randn(s) for s in SHAPES]) for _ in range(K)]
    parts = partitioned.split(messages[2])
    parts[1] = b"\x01\x00\x00\x00garbage"  # replica 2's part for owner 1 does not decode
    messages[2] = pack(parts)
    with caplog.at_level(logging.WARNING, logger="muloco"):
        mean = scatter_mean(partitioned, messages)
    assert (mean.contributors, mean.left_out) == (K - 1, 1)  # the fewest contributors of any part
    assert mean.values is not None and all(torch.isfinite(v).all() for v in mean.values)
    assert any("part=1 contribution=2: left out" in r.message for r in caplog.records)


def test_a_malformed_owner_mean_skips_the_sync_on_every_worker(caplog):
    _, partitioned = codecs("linear", 2, bits=8)
    like = [torch.zeros(s) for s in SHAPES]
    part0 = partitioned.split(partitioned.encode([torch.randn(s) for s in SHAPES]))[0]
    good = partitioned.average(0, [part0], None, like)
    with caplog.at_level(logging.WARNING, logger="muloco"):
        values, contributors = partitioned.decode_means([good, b"not a mean"], like)
    assert values is None and contributors == 0
    assert "part=1: the owner's mean does not decode" in caplog.text


def tiny_run(tiny, *extra):
    trainer = Trainer(load_config(None, [*tiny, *STAT, "train.batch_tokens=512", *extra]))
    return trainer, trainer.run()


def test_bytes_per_worker_are_constant_in_k_and_half_of_all_gather_at_k4(tiny):
    summaries = {}
    for K in (4, 8):
        for transport in ("all_gather", "reduce_scatter"):
            _, summary = tiny_run(
                tiny,
                "compression.bits=2",
                "compression.mean_bits=2",
                f"workers={K}",
                f"sync.transport={transport}",
                f"run.name={transport}{K}",
            )
            summaries[transport, K] = summary
            assert summary["transport"] == transport
    payload = summaries["all_gather", 4]["payload_bytes_per_sync"]
    syncs = summaries["all_gather", 4]["outer_steps"]
    assert summaries["all_gather", 4]["bytes_sent_per_worker"] == syncs * ring_allgather_bytes(payload, 4)
    for K in (4, 8):
        scatter, gather = summaries["reduce_scatter", K], summaries["all_gather", K]
        # (K-1)/K x (message + owners' means): the parts' headers make the message a little longer.
        message = scatter["payload_bytes_per_sync"]
        assert message == pytest.approx(payload, rel=0.05)
        assert scatter["bytes_sent_per_worker"] == pytest.approx(
            syncs * reduce_scatter_bytes(message, message, K), rel=0.02
        )
        ratio = gather["bytes_sent_per_worker"] / scatter["bytes_sent_per_worker"]
        assert ratio == pytest.approx(K / 2, rel=0.06)


def test_owner_error_feedback_is_checkpointed_and_resume_is_bitwise(tiny, tmp_path):
    overrides = [
        "compression.bits=2",
        "compression.error_feedback=true",
        "sync.transport=reduce_scatter",
        "workers=4",
        "checkpoint.every=1",
        "checkpoint.keep=10",
    ]
    full, _ = tiny_run(tiny, *overrides)
    assert all(ef.buffers for ef in full.engine.owner_feedback)
    assert any("[" in key for ef in full.engine.owner_feedback for key in ef.buffers)  # per piece of rows
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(full.run_dir, resumed_dir / full.cfg.run.name)
    for path in list_checkpoints(resumed_dir / full.cfg.run.name / "checkpoints")[1:]:
        path.unlink()
    resumed, _ = tiny_run(tiny, *overrides, f"run.output_dir={resumed_dir}")
    assert resumed.resumed_from is not None
    for a, b in zip(full.engine.outer.params, resumed.engine.outer.params, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(full.engine.owner_feedback, resumed.engine.owner_feedback, strict=True):
        assert a.buffers.keys() == b.buffers.keys()
        assert all(torch.equal(a.buffers[k], b.buffers[k]) for k in a.buffers)


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["workers=2", "compression.scheme=statistical"], "all_gather"),  # same bytes: quantize once
        (["workers=4", "compression.scheme=statistical"], "reduce_scatter"),
        (["workers=4"], "all_reduce"),  # fp32
        (["workers=4", "compression.scheme=statistical", "sync.transport=all_gather"], "all_gather"),
        # A tiny model on a fast link with 200 ms latency: the owners' extra hop costs more than bytes.
        (
            [
                "workers=4",
                "compression.scheme=statistical",
                "backend.local.bandwidth_mbps=10000",
                "backend.local.latency_ms=200",
            ],
            "all_gather",
        ),
    ],
)
def test_auto_picks_the_transport_from_k_bits_and_link(tiny, extra, expected):
    trainer = Trainer(load_config(None, [*tiny, "train.batch_tokens=512", "train.total_tokens=512", *extra]))
    assert trainer.engine.transport == expected


def test_reduce_scatter_on_hivemind_is_a_config_error(tmp_path):
    result = run_muloco(
        "config",
        "configs/quickstart.yaml",
        "backend.kind=hivemind",
        "compression.scheme=statistical",
        "sync.transport=reduce_scatter",
        timeout=60,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and "sync.transport=reduce_scatter" in lines[0] and "Traceback" not in result.stderr
    )


def test_summary_and_log_name_the_transport(tiny):
    trainer, summary = tiny_run(tiny, "workers=4", "compression.bits=4")
    assert summary["transport"] == "reduce_scatter"
    assert json.loads((trainer.run_dir / "summary.json").read_text())["transport"] == "reduce_scatter"


def test_a_replica_sending_a_malformed_part_is_left_out_by_the_guard_and_the_run_goes_on(
    tiny, monkeypatch, caplog
):
    encode = PartitionedCodec.encode
    calls = {"n": 0}

    def corrupt_one(self, delta, error_feedback=None):
        message = encode(self, delta, error_feedback)
        calls["n"] += 1
        if calls["n"] == 6:  # the second sync's second replica: its part for owner 3 is cut short
            parts = self.split(message)
            parts[3] = parts[3][:-7]
            message = pack(parts)
        return message

    monkeypatch.setattr(PartitionedCodec, "encode", corrupt_one)
    with caplog.at_level(logging.WARNING, logger="muloco"):
        trainer, summary = tiny_run(tiny, "workers=4", "compression.bits=4", "sync.transport=reduce_scatter")
    assert summary["status"] == "completed"
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    left_out = [r["replicas_left_out"] for r in records if r["kind"] == "sync"]
    assert left_out[1] == 1 and sum(left_out) == 1
    assert "part=3 contribution=1: left out of the part's mean" in caplog.text


def engine_of(tiny, *extra):
    """The sync engine of a one-step K = 4 statistical run (built, not run)."""
    base = [*tiny, *STAT, "train.batch_tokens=512", "train.total_tokens=512", "workers=4"]
    return Trainer(load_config(None, [*base, *extra])).engine


def test_part_owners_keep_error_feedback_unless_told_not_to(tiny):
    base = ["sync.transport=reduce_scatter"]
    default = engine_of(tiny, *base)
    assert all(ef is None for ef in default.error_feedback)  # the workers': error_feedback is off
    assert all(ef is not None and ef.decay == 0.9 for ef in default.owner_feedback)
    off = engine_of(tiny, *base, "compression.mean_error_feedback=false")
    assert all(ef is None for ef in off.owner_feedback)
    gather = engine_of(tiny, *base, "sync.transport=all_gather")
    assert all(ef is None for ef in gather.owner_feedback)


def test_the_second_stage_has_twice_the_bits_within_4_and_8_by_default(tiny):
    defaults = [CompressionConfig(scheme="statistical", bits=b).second_stage_bits for b in (1, 2, 4, 8)]
    assert defaults == [4, 4, 8, 8]
    assert CompressionConfig(scheme="statistical", bits=2, mean_bits=2).second_stage_bits == 2
    engine = engine_of(tiny, "compression.bits=2")
    codec = engine.fragments[0].codec
    quantized = [c for c, skipped in zip(codec.mean_compressors, codec.codec.skipped) if not skipped]
    assert quantized and all(c.bits == 4 for c in quantized)
