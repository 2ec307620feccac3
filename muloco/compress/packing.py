"""Dense bit packing of small unsigned codes into uint8, as pure vectorized torch functions.

Layout (the wire format relies on it): little-endian within a byte. With `bits` b and `per = 8 // b` codes
per byte, code i goes to byte i // per at bit offset (i % per) * b. The last byte is zero-padded.
`pack_uint` / `unpack_uint` pack unsigned integers of any width 1..40 the same way (LSB first), which is
what top-k uses for its indices: where a whole number of bytes holds a few values in one int64 (widths 12,
10, 14, ... : lcm(width, 8) <= 56 bits) a group at a time, otherwise bit by bit; both give the same bytes.
"""

from __future__ import annotations

import math

import torch

from muloco.config.bits import QUANT_BITS

MAX_UINT_WIDTH = 40  # top-k index gaps: tensors of up to 2**40 elements


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that `n` codes of `bits` bits occupy once packed."""
    return math.ceil(n * bits / 8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a flat uint8 tensor of codes < 2**bits into ceil(n * bits / 8) bytes."""
    assert bits in QUANT_BITS, f"{bits=}"
    assert codes.dtype == torch.uint8 and codes.dim() == 1, f"{codes.dtype=} {codes.shape=}"
    if bits == 8:
        return codes
    per = 8 // bits
    n = codes.numel()
    full = n // per
    out = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=codes.device)
    main = codes[: full * per].view(full, per)  # (full, per): the codes of each whole byte
    body = out[:full]
    body.copy_(main[:, 0])
    for k in range(1, per):  # a loop over bit positions in a byte (<= 7), not over elements
        body.bitwise_or_(main[:, k] << (k * bits))
    if n % per:  # the last, partial byte
        tail = codes[full * per :].to(torch.int32)
        shifts = torch.arange(tail.numel(), device=codes.device, dtype=torch.int32) * bits
        out[full] = (tail << shifts).sum().to(torch.uint8)
    return out


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_codes`: the first `n` codes as a flat uint8 tensor."""
    assert bits in QUANT_BITS, f"{bits=}"
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(n, bits), f"{packed.shape=} {n=}"
    if bits == 8:
        return packed.reshape(-1)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)  # (8 // bits,)
    codes = (packed.reshape(-1, 1) >> shifts) & ((1 << bits) - 1)  # (m, per)
    return codes.reshape(-1)[:n]


def uint_width(max_value: int) -> int:
    """Bits needed to store unsigned integers up to `max_value` (at least 1)."""
    return max(1, int(max_value).bit_length())


# A group of values fills a whole number of bytes in lcm(width, 8) bits; up to 56 of them fit an int64
# with room for the shifts, so such a group packs in a few int64 operations instead of a bit matrix
# (12-bit chunk positions: 2 values in 3 bytes).
MAX_GROUP_BITS = 56


def _group(width: int) -> tuple[int, int] | None:
    """(values, bytes) of the smallest group of `width`-bit values that fills whole bytes, if it fits."""
    bits = math.lcm(width, 8)
    return (bits // width, bits // 8) if bits <= MAX_GROUP_BITS else None


def pack_uint(values: torch.Tensor, width: int) -> torch.Tensor:
    """Pack non-negative int64 values < 2**width, LSB first, into ceil(k * width / 8) bytes."""
    assert 1 <= width <= MAX_UINT_WIDTH, f"{width=}"
    assert values.dim() == 1, f"{values.shape=}"
    values = values.to(torch.int64)
    group = _group(width)
    if group is None:
        shifts = torch.arange(width, dtype=torch.int64, device=values.device)
        bit_matrix = ((values.unsqueeze(1) >> shifts) & 1).to(torch.uint8)  # (k, width)
        return pack_codes(bit_matrix.reshape(-1), 1)
    per, nbytes = group
    k = values.numel()
    padded = torch.nn.functional.pad(values, (0, -k % per)).view(-1, per)  # zero values: zero bits
    word = padded[:, 0].clone()
    for j in range(1, per):  # a loop over a group's values (<= 8), not over elements
        word.bitwise_or_(padded[:, j] << (j * width))
    shifts = torch.arange(0, 8 * nbytes, 8, dtype=torch.int64, device=values.device)
    out = ((word.unsqueeze(1) >> shifts) & 0xFF).to(torch.uint8).reshape(-1)  # (groups * nbytes,)
    return out[: packed_nbytes(k, width)]


def unpack_uint(packed: torch.Tensor, width: int, k: int) -> torch.Tensor:
    """Inverse of `pack_uint`: `k` int64 values."""
    assert 1 <= width <= MAX_UINT_WIDTH, f"{width=}"
    group = _group(width)
    if group is None:
        bit_matrix = unpack_codes(packed, 1, k * width).view(k, width).to(torch.int64)  # (k, width)
        shifts = torch.arange(width, dtype=torch.int64, device=packed.device)
        return (bit_matrix << shifts).sum(dim=1)
    assert packed.numel() == packed_nbytes(k, width), f"{packed.shape=} {k=}"
    per, nbytes = group
    padded = torch.nn.functional.pad(packed.to(torch.int64), (0, -packed.numel() % nbytes)).view(-1, nbytes)
    word = padded[:, 0].clone()
    for b in range(1, nbytes):
        word.bitwise_or_(padded[:, b] << (8 * b))
    shifts = torch.arange(0, per * width, width, dtype=torch.int64, device=packed.device)
    return ((word.unsqueeze(1) >> shifts) & ((1 << width) - 1)).reshape(-1)[:k]
