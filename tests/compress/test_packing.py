"""Bit packing is exact for every width and length, and its byte layout is the documented one."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from muloco.compress.packing import pack_codes, pack_uint, packed_nbytes, unpack_codes, unpack_uint


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 1003])
def test_pack_unpack_roundtrip_exact(bits, n):
    g = torch.Generator().manual_seed(n * 10 + bits)
    codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8, generator=g)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(n, bits) == -(-n * bits // 8)
    assert torch.equal(unpack_codes(packed, bits, n), codes)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_extreme_codes(bits):
    for value in (0, 2**bits - 1):
        codes = torch.full((37,), value, dtype=torch.uint8)
        assert torch.equal(unpack_codes(pack_codes(codes, bits), bits, 37), codes)


def test_layout_is_little_endian_within_a_byte():
    # 2-bit codes 1, 2, 3, 0 | 1 -> byte0 = 1 | 2<<2 | 3<<4 | 0<<6 = 0x39; byte1 = 1 (zero-padded)
    packed = pack_codes(torch.tensor([1, 2, 3, 0, 1], dtype=torch.uint8), 2)
    assert packed.tolist() == [0x39, 0x01]
    assert pack_codes(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.uint8), 1).tolist() == [0x81, 1]
    assert pack_codes(torch.tensor([0xA, 0x5, 0xF], dtype=torch.uint8), 4).tolist() == [0x5A, 0x0F]


@settings(max_examples=60, deadline=None)
@given(width=st.integers(1, 40), data=st.data())
def test_pack_uint_roundtrip(width, data):
    values = data.draw(st.lists(st.integers(0, 2**width - 1), min_size=0, max_size=50))
    t = torch.tensor(values, dtype=torch.int64)
    packed = pack_uint(t, width)
    assert packed.numel() == packed_nbytes(len(values), width)
    assert unpack_uint(packed, width, len(values)).tolist() == values


def bit_by_bit(values: list[int], width: int) -> list[int]:
    """The documented layout, written out: value i's bit j is bit i * width + j of the stream, LSB first."""
    out = [0] * -(-len(values) * width // 8)
    for i, v in enumerate(values):
        for j in range(width):
            if v >> j & 1:
                pos = i * width + j
                out[pos // 8] |= 1 << (pos % 8)
    return out


@pytest.mark.parametrize("width", [3, 6, 10, 12, 14, 16, 20, 24, 9, 13, 40])  # grouped and bit-matrix paths
@pytest.mark.parametrize("n", [0, 1, 2, 5, 7, 8, 9, 33])
def test_pack_uint_bytes_are_the_documented_layout(width, n):
    g = torch.Generator().manual_seed(width * 100 + n)
    values = torch.randint(0, 2**width, (n,), dtype=torch.int64, generator=g)
    values[: min(n, 2)] = 2**width - 1  # the widest value reaches the group's top bits
    packed = pack_uint(values, width)
    assert packed.tolist() == bit_by_bit(values.tolist(), width)
    assert torch.equal(unpack_uint(packed, width, n), values)
