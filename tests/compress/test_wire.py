"""Malformed payloads raise CompressionError (a ValueError) with a clear message, never anything else."""

import struct
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from muloco.compress import CompressionError, decode, get_compressor, read_header

COMPRESSORS = [
    get_compressor("none"),
    get_compressor("bf16"),
    get_compressor("linear", 4),
    get_compressor("linear", 2, "block", 4, "minmax"),
    get_compressor("statistical", 8),
    get_compressor("statistical", 1, "tensor"),
    get_compressor("topk", topk_fraction=0.2),
    get_compressor("topk", topk_fraction=0.3, topk_value_bits=16),
    get_compressor("topk", topk_fraction=0.3, topk_value_bits=8),
    get_compressor("topk", topk_fraction=0.3, topk_value_bits=4),
    get_compressor("topk", topk_fraction=0.2, topk_value_bits=2, topk_chunk=9),  # tiles of 3 x 1
    get_compressor("topk", topk_fraction=0.5, topk_value_bits=32, topk_chunk=4),  # tiles of 1 x 1: keeps all
]
IDS = [repr(c) for c in COMPRESSORS]


def payload_of(comp, shape=(3, 5), seed=0):
    return comp.encode(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))


def with_crc(body: bytes) -> bytes:
    """Re-seal a tampered payload (body = everything but the CRC) so only semantic checks can catch it."""
    return body + struct.pack("<I", zlib.crc32(body))


def expect_error(payload, match=None):
    with pytest.raises(CompressionError, match=match):
        decode(payload)


@pytest.mark.parametrize("comp", COMPRESSORS, ids=IDS)
def test_truncated_at_every_length(comp):
    p = payload_of(comp)
    assert decode(p).shape == (3, 5)
    for cut in range(len(p)):
        expect_error(p[:cut])


@pytest.mark.parametrize("comp", COMPRESSORS, ids=IDS)
def test_every_single_bit_flip_is_caught(comp):
    p = bytearray(payload_of(comp, (2, 3)))
    for i in range(len(p) * 8):
        p[i // 8] ^= 1 << (i % 8)
        expect_error(bytes(p))
        p[i // 8] ^= 1 << (i % 8)


@pytest.mark.parametrize("comp", COMPRESSORS, ids=IDS)
def test_trailing_bytes(comp):
    expect_error(payload_of(comp) + b"\x00", "trailing bytes|CRC")


def test_header_fields_are_validated_before_the_crc():
    p = payload_of(get_compressor("statistical", 4))
    body = bytearray(p[:-4])
    cases = {
        "magic": (0, b"XXXX", "wrong magic"),
        "version": (4, b"\x02", "version 2"),
        "scheme": (5, b"\x09", "unknown scheme"),
        "granularity": (7, b"\x07", "unknown granularity"),
        "dtype": (9, b"\x09", "unknown dtype"),
        "ndim": (10, b"\x09", "ndim 9"),
        "reserved": (11, b"\x01", "reserved"),
        "bits": (6, b"\x03", "bits 3"),
        "groups": (16, struct.pack("<Q", 4), "groups"),
        "body size": (24, struct.pack("<Q", 10**6), "body"),
    }
    for offset, value, match in cases.values():
        tampered = bytearray(body)
        tampered[offset : offset + len(value)] = value
        with pytest.raises(CompressionError, match=match):
            decode(with_crc(bytes(tampered)))
        with pytest.raises(CompressionError):
            decode(bytes(tampered) + p[-4:])  # without re-sealing: caught too, by a check or the CRC


def test_absurd_sizes_are_rejected_without_allocating():
    p = payload_of(get_compressor("none"))
    body = bytearray(p[:-4])
    body[32:40] = struct.pack("<Q", 2**62)  # shape[0]: 2**62 x 5 elements
    expect_error(with_crc(bytes(body)), "absurd shape")
    body[32:40] = struct.pack("<Q", 2**20)  # a plausible 5M elements, but the payload holds 15
    body[24:32] = struct.pack("<Q", 4 * 5 * 2**20)  # consistent body size -> caught by the length check
    expect_error(with_crc(bytes(body)), "truncated")


def test_semantic_checks_behind_a_valid_crc():
    # A negative step (a sender bug, not a transmission error) is refused, not decoded.
    comp = get_compressor("linear", 8, "tensor")  # body: step (2 bytes) + codes
    p = payload_of(comp)
    hsize = 32 + 8 * 2
    body = bytearray(p[:-4])
    body[hsize : hsize + 2] = struct.pack("<h", torch.tensor([-1.0]).bfloat16().view(torch.int16).item())
    expect_error(with_crc(bytes(body)), "steps")
    # A top-k index beyond the tensor.
    x = torch.zeros(3, 5)
    x.view(-1)[12:] = 1.0  # kept: indices 12, 13, 14 -> gaps 12, 0, 0 -> 4-bit gaps, 2 index bytes
    p = get_compressor("topk", topk_fraction=0.2).encode(x)
    h = read_header(p)
    assert (h.scheme, h.count, h.mode) == ("topk", 3, 4)
    body = bytearray(p[:-4])
    body[hsize : hsize + 2] = b"\xff\xff"  # gaps 15, 15, 15: indices 15, 31, 47 >= 15
    expect_error(with_crc(bytes(body)), "top-k index")


def test_decode_rejects_a_payload_of_another_configuration():
    p = payload_of(get_compressor("linear", 4))
    with pytest.raises(CompressionError, match="same compression config"):
        get_compressor("statistical", 4).decode(p)
    with pytest.raises(CompressionError, match="same compression config"):
        get_compressor("linear", 8).decode(p)
    assert decode(p).shape == (3, 5)  # the module-level decode reads any payload


@pytest.mark.parametrize("bad", [None, "text", 3, [1, 2]])
def test_non_bytes(bad):
    expect_error(bad, "bytes")


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=200))
def test_random_bytes(data):
    expect_error(data)


@settings(max_examples=300, deadline=None)
@given(tail=st.binary(max_size=120), version=st.sampled_from([b"\x01", b"\x02"]))
def test_random_bytes_after_a_valid_magic(tail, version):
    expect_error(b"MLCQ" + version + tail)


@settings(max_examples=200, deadline=None)
@given(idx=st.integers(0, 10**6), value=st.integers(0, 255), comp=st.sampled_from(COMPRESSORS))
def test_random_byte_replacement_resealed(idx, value, comp):
    """Any byte changed and the CRC recomputed: decodes to a well-formed tensor or raises CompressionError."""
    p = bytearray(payload_of(comp)[:-4])
    p[idx % len(p)] = value
    p = with_crc(bytes(p))
    for dec in (decode, comp.decode):
        try:
            y = dec(p)
        except CompressionError:
            continue
        assert isinstance(y, torch.Tensor) and y.dtype == torch.float32
        # never allocates from an absurd size: dense payloads hold every element; top-k payloads are
        # bounded by (k + 1) * 2**20 (module-level decode; k as the tampered header says) or by the
        # compressor's own fraction
        assert y.numel() <= ((read_header(p).count + 1) << 20 if dec is decode else 100)
