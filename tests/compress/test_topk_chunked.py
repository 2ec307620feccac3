"""Chunked top-k (SparseLoCo's tiles): the largest entries of every chunk survive, exactly at 32-bit values
and within the statistical quantizer's bound at 4 and 2 bits; the bytes are the formula's; malformed payloads
are refused; error feedback keeps what was not sent."""

import math
import struct
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from muloco.compress import CompressionError, ErrorFeedback, decode, get_compressor, read_header
from muloco.compress.chunks import from_chunks, kept_per_chunk, largest_divisor_at_most, tiling, to_chunks
from muloco.compress.quantize import DEFAULT_STAT_RANGE
from muloco.config.bits import check_chunk


def chunked(fraction=0.03125, value_bits=32, chunk=4096):
    return get_compressor("topk", topk_fraction=fraction, topk_value_bits=value_bits, topk_chunk=chunk)


def test_the_reference_tiles():
    # tplr/sparseloco.py: each dim's largest divisor <= 64; vectors in runs; 3+ dims as (shape[0], rest)
    assert largest_divisor_at_most(4096, 64) == 64 and largest_divisor_at_most(50, 64) == 50
    assert largest_divisor_at_most(257, 64) == 1 and largest_divisor_at_most(96, 64) == 48
    t = tiling((256, 768), 64)
    assert (t.tile_rows, t.tile_cols, t.chunks, t.chunk_len) == (64, 64, 48, 4096)
    t = tiling((257, 96), 64)
    assert (t.tile_rows, t.tile_cols, t.chunks) == (1, 48, 257 * 2)
    assert (tiling((100,), 64).tile_rows, tiling((100,), 64).tile_cols) == (1, 50)
    assert tiling((3, 5, 8), 64).cols == 40 and tiling((0, 4), 64).chunks == 0
    # k per chunk: max(1, round(len x fraction)), Python's round (half to even) as the reference
    assert kept_per_chunk(4096, 128 / 4096) == 128 and kept_per_chunk(64, 0.005) == 1
    assert kept_per_chunk(80, 1 / 32) == 2  # round(2.5) == 2
    assert check_chunk(4096) == 64 and check_chunk(None) is None
    for bad in (4000, 0, -4, True, 2.0):
        with pytest.raises(ValueError, match="topk_chunk must be a square"):
            check_chunk(bad)


def test_chunks_are_tiles_and_round_trip():
    x = torch.arange(128 * 192, dtype=torch.float32).view(128, 192)
    t = tiling(tuple(x.shape), 64)
    c = to_chunks(x, t)
    assert c.shape == (6, 4096)
    assert torch.equal(c[0], x[:64, :64].reshape(-1)) and torch.equal(c[1], x[:64, 64:128].reshape(-1))
    assert torch.equal(c[3], x[64:, :64].reshape(-1))
    assert torch.equal(from_chunks(c, t, tuple(x.shape)), x)


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from([(7,), (100,), (50, 64), (128, 192), (257, 96), (3, 5, 8)]),
    fraction=st.sampled_from([0.005, 0.015, 0.03125, 0.25]),
    chunk=st.sampled_from([64, 4096]),
    seed=st.integers(0, 1000),
)
def test_every_chunk_keeps_its_largest_exactly(shape, fraction, chunk, seed):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    comp = chunked(fraction, 32, chunk)
    y = comp.decode(comp.encode(x))
    t = tiling(shape, math.isqrt(chunk))
    k = kept_per_chunk(t.chunk_len, fraction)
    xc, yc = to_chunks(x, t), to_chunks(y, t)
    kept = yc != 0
    assert (kept.sum(dim=1) == k).all()  # randn: no kept entry is 0
    assert torch.equal(yc[kept], xc[kept])  # fp32 values: exact
    smallest_kept = torch.where(kept, xc.abs(), torch.inf).min(dim=1).values
    largest_dropped = torch.where(kept, -torch.inf, xc.abs()).max(dim=1).values
    assert (smallest_kept >= largest_dropped).all()


@pytest.mark.parametrize("bits", [2, 4])
def test_low_bit_values_within_the_statistical_bound(bits):
    x = torch.randn(256, 768, generator=torch.Generator().manual_seed(1))
    exact = chunked(value_bits=32).decode(chunked(value_bits=32).encode(x))
    y = chunked(value_bits=bits).decode(chunked(value_bits=bits).encode(x))
    assert torch.equal(y != 0, exact != 0)  # the same entries
    v, v_hat = exact[exact != 0], y[exact != 0]
    # in range (within +-r std of the kept values' mean) the error is at most one bin: 2 r std / 2**bits
    r, std = DEFAULT_STAT_RANGE[bits], v.std().item()
    inside = (v - v.mean()).abs() <= r * std
    assert (v_hat - v)[inside].abs().max().item() <= 2 * r * std / 2**bits * (1 + 2**-7)
    assert ((v_hat - v).norm() / v.norm()).item() < 0.15


@pytest.mark.parametrize("bits", [32, 16, 8, 4, 2])
@pytest.mark.parametrize("shape", [(256, 768), (257, 96), (100,)])
def test_bytes_are_the_formula(bits, shape):
    comp = chunked(0.03125, bits)
    t = tiling(shape, 64)
    k = t.chunks * kept_per_chunk(t.chunk_len, 0.03125)
    index_bits = max(1, (t.chunk_len - 1).bit_length())  # 12 at 4,096
    values = {32: 4 * k, 16: 2 * k, 8: 2 + k}.get(bits) or 4 + 2 + 4 * 2**bits + math.ceil(k * bits / 8)
    expected = 32 + 8 * len(shape) + math.ceil(k * index_bits / 8) + values + 4
    p = comp.encode(torch.randn(shape))
    assert len(p) == expected == comp.payload_nbytes(shape)
    h = read_header(p)
    assert (h.granularity, h.block_size, h.count, h.mode) == ("block", 64, k, index_bits)


def test_zeros_ties_and_all_kept():
    for bits in (32, 2):
        y = chunked(value_bits=bits).decode(chunked(value_bits=bits).encode(torch.zeros(64, 128)))
        assert torch.equal(y, torch.zeros(64, 128))
    x = torch.randn(3, 5)
    assert torch.equal(chunked(0.5, 32, 4).decode(chunked(0.5, 32, 4).encode(x)), x)  # 1 x 1 tiles
    assert chunked(0.1, 32, 4096).decode(chunked(0.1, 32, 4096).encode(torch.zeros(0, 3))).shape == (0, 3)


def _reseal(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def test_malformed_payloads_are_refused():
    comp = chunked(0.25, 32, 16)  # (4, 8): tiles of 4 x 4, 2 chunks of 16, 4 kept each, 4-bit positions
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    p = comp.encode(x)
    h = read_header(p)
    assert (h.count, h.mode, h.block_size) == (8, 4, 4)
    hsize = 32 + 8 * 2
    body = bytearray(p[:-4])
    body[hsize] = 0x11  # the first chunk's first two positions: 1, 1 (a repeat)
    with pytest.raises(CompressionError, match="not increasing"):
        decode(_reseal(bytes(body)))
    for cut in (1, 5, len(p) // 2):
        with pytest.raises(CompressionError):
            decode(p[:-cut])
    # a header whose geometry does not hold: another index width, or a count no chunk split gives
    for offset, value in ((8, 5), (16, 7)):
        head = bytearray(p[:-4])
        struct.pack_into("<B" if offset == 8 else "<Q", head, offset, value)
        with pytest.raises(CompressionError):
            decode(_reseal(bytes(head)))
    # a payload of another chunk or fraction: the workers disagree on the config
    with pytest.raises(CompressionError, match="same compression config"):
        chunked(0.25, 32, 64).decode(p)
    with pytest.raises(CompressionError, match="keeps 8 of 32"):
        chunked(0.5, 32, 16).decode(p)
    with pytest.raises(CompressionError, match="same compression config"):
        get_compressor("topk", topk_fraction=0.25).decode(p)


def test_error_feedback_carries_the_residual():
    comp = chunked(0.03125, 2)
    ef = ErrorFeedback(decay=1.0)
    deltas = [torch.randn(128, 128, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    sent = torch.zeros(128, 128)
    for d in deltas:
        sent += comp.decode(ef.encode("w", d, comp))
    # what was meant = what was sent + what is still held back (decay 1, alpha 1)
    assert torch.allclose(sum(deltas), sent + ef.buffers["w"], atol=1e-5)
    assert ef.buffers["w"].norm() > 0
