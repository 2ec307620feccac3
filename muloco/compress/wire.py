"""The wire format: a versioned, fixed-layout header, the body sections, and a CRC32 trailer.

Every payload is self-describing and validated before anything is allocated from it:

    offset  size     field
    0       4        magic b"MLCQ"
    4       1        version (1)
    5       1        scheme: 0 none, 1 bf16, 2 linear, 3 statistical, 4 topk
    6       1        bits: 32 (none), 16 (bf16), 1/2/4/8 (linear, statistical), 32/16/8/4/2 (topk values)
    7       1        granularity: 0 tensor, 1 row, 2 block (linear, statistical; topk: 2 chunked; else 0)
    8       1        mode: linear 0 absmax / 1 minmax; topk: index width in bits (1..40); else 0
    9       1        dtype of the tensor that was encoded: 0 float32, 1 bfloat16, 2 float16, 3 float64
    10      1        ndim (0..8)
    11      1        reserved (0)
    12      4  u32   block_size (granularity block; chunked topk: the tile side; else 0)
    16      8  u64   count: groups G (linear, statistical), kept entries k (topk), else 0
    24      8  u64   body_nbytes
    32      8*ndim   shape, u64 each
    ...     body_nbytes  the body sections (see `body_layout`)
    end-4   4  u32   CRC32 (zlib) of everything before it

All integers are little-endian. The body size is a pure function of the header fields, so a payload whose
length does not match its header (truncated, trailing bytes, absurd sizes) is rejected before its body is
read.

Chunked top-k (granularity block) carries the side of its tiles; the tiling is a pure function of the shape
and the side (chunks.py), so the header alone says how many chunks there are, how many entries each keeps
(count / chunks) and the index width (that of chunk_len - 1), and all three are checked. Older readers
refuse these payloads (a topk granularity or value bits they do not know): no wrong tensor either way.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

import torch

from muloco.compress.chunks import tiling
from muloco.compress.errors import CompressionError
from muloco.compress.packing import MAX_UINT_WIDTH, packed_nbytes, uint_width
from muloco.compress.quantize import GRANULARITIES, LINEAR_MODES, num_groups
from muloco.config.bits import QUANT_BITS, TOPK_VALUE_BITS, one_of

MAGIC = b"MLCQ"
VERSION = 1
MAX_NDIM = 8
MAX_NUMEL = 1 << 40  # ~1.1e12 elements: far above any single tensor we send, far below int64 overflow
TOPK_MAX_EXPANSION = 1 << 20  # a top-k payload of k entries decodes to at most (k + 1) * 2**20 elements

SCHEMES = ("none", "bf16", "linear", "statistical", "topk")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

_FIXED = struct.Struct("<4sBBBBBBBBIQQ")  # magic .. body_nbytes: 32 bytes
CRC_NBYTES = 4


@dataclass(frozen=True)
class Header:
    scheme: str
    bits: int
    granularity: str  # "tensor" for schemes without groups
    mode: int  # linear: index into LINEAR_MODES; topk: index width; else 0
    dtype: torch.dtype
    shape: tuple[int, ...]
    block_size: int
    count: int
    body_nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Header size in bytes (the CRC trailer not included)."""
        return _FIXED.size + 8 * len(self.shape)


def header_nbytes(ndim: int) -> int:
    return _FIXED.size + 8 * ndim


def body_layout(h: Header) -> list[tuple[str, int]]:
    """The body sections (name, nbytes), in order, as implied by the header alone."""
    n = h.numel
    if h.scheme == "none":
        return [("values", 4 * n)]
    if h.scheme == "bf16":
        return [("values", 2 * n)]
    if h.scheme in ("linear", "statistical"):
        g = h.count
        out = []
        if h.scheme == "statistical" or LINEAR_MODES[h.mode] == "minmax":
            out.append(("offsets", 4 * g))  # fp32
        out.append(("steps", 2 * g))  # bf16
        if h.scheme == "statistical":
            out.append(("lut", 4 * 2**h.bits))  # fp32
        out.append(("codes", packed_nbytes(n, h.bits)))
        return out
    assert h.scheme == "topk", f"{h.scheme=}"
    k = h.count
    out = [("indices", packed_nbytes(k, h.mode))]
    if h.bits == 8:
        out += [("steps", 2), ("values", k)]  # linear absmax 8-bit, one bf16 step
    elif h.bits in (2, 4):  # statistical over the kept values: offset fp32, step bf16, lut fp32, codes
        out += [("offsets", 4), ("steps", 2), ("lut", 4 * 2**h.bits), ("values", packed_nbytes(k, h.bits))]
    else:
        out.append(("values", k * h.bits // 8))
    return out


def pack_header(h: Header) -> bytes:
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        SCHEMES.index(h.scheme),
        h.bits,
        GRANULARITIES.index(h.granularity),
        h.mode,
        DTYPES.index(h.dtype),
        len(h.shape),
        0,
        h.block_size,
        h.count,
        h.body_nbytes,
    )
    return fixed + struct.pack(f"<{len(h.shape)}Q", *h.shape)


def assemble(h: Header, sections: list) -> bytes:
    """header + sections (bytes-like) + CRC32 trailer, in one copy."""
    head = pack_header(h)
    crc = zlib.crc32(head)
    for s in sections:
        crc = zlib.crc32(s, crc)
    return b"".join([head, *sections, struct.pack("<I", crc)])


def _fail(msg: str) -> CompressionError:
    return CompressionError(f"malformed compressed payload: {msg}")


def parse(payload) -> tuple[Header, memoryview]:
    """Validate a payload fully (sizes, enums, CRC) and return its header and body (a zero-copy view).

    Raises CompressionError on anything malformed; never allocates from a size it has not checked against
    the payload's real length.
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise CompressionError(f"payload must be bytes, got {type(payload).__name__}")
    mv = memoryview(payload).cast("B")
    total = mv.nbytes
    if total < _FIXED.size + CRC_NBYTES:
        raise _fail(f"{total} bytes is shorter than the smallest header ({_FIXED.size + CRC_NBYTES} bytes)")
    magic, version, scheme, bits, gran, mode, dtype, ndim, reserved, block_size, count, body_nbytes = (
        _FIXED.unpack_from(mv, 0)
    )
    if magic != MAGIC:
        raise _fail(f"wrong magic {bytes(magic)!r} (expected {MAGIC!r}): not a muloco compressed tensor")
    if version != VERSION:
        raise _fail(
            f"wire format version {version}, this muloco reads version {VERSION}: "
            "run the same muloco version on all workers"
        )
    if scheme >= len(SCHEMES):
        raise _fail(f"unknown scheme code {scheme}")
    if gran >= len(GRANULARITIES):
        raise _fail(f"unknown granularity code {gran}")
    if dtype >= len(DTYPES):
        raise _fail(f"unknown dtype code {dtype}")
    if ndim > MAX_NDIM:
        raise _fail(f"ndim {ndim} > {MAX_NDIM}")
    if reserved != 0:
        raise _fail(f"reserved byte is {reserved}, expected 0")
    hsize = header_nbytes(ndim)
    if total < hsize + CRC_NBYTES:
        raise _fail(f"truncated: {total} bytes, the header alone needs {hsize + CRC_NBYTES}")
    shape = struct.unpack_from(f"<{ndim}Q", mv, _FIXED.size)
    # Python ints: no overflow; each dim and the product are bounded before anything is sized from them.
    if any(d > MAX_NUMEL for d in shape) or math.prod(shape) > MAX_NUMEL:
        raise _fail(f"absurd shape {shape} (more than {MAX_NUMEL} elements)")
    sname = SCHEMES[scheme]
    h = Header(sname, bits, GRANULARITIES[gran], mode, DTYPES[dtype], shape, block_size, count, body_nbytes)
    _check_fields(h)
    expected = sum(n for _, n in body_layout(h))
    if body_nbytes != expected:
        raise _fail(f"header declares a {body_nbytes}-byte body, its fields imply {expected} bytes")
    if total != hsize + body_nbytes + CRC_NBYTES:
        what = "truncated" if total < hsize + body_nbytes + CRC_NBYTES else "trailing bytes"
        raise _fail(f"{what}: {total} bytes, the header declares {hsize + body_nbytes + CRC_NBYTES}")
    (crc,) = struct.unpack_from("<I", mv, total - CRC_NBYTES)
    actual = zlib.crc32(mv[: total - CRC_NBYTES])
    if crc != actual:
        raise _fail(f"CRC32 mismatch (stored {crc:#010x}, computed {actual:#010x}): corrupted in transit")
    return h, mv[hsize : total - CRC_NBYTES]


def _check_fields(h: Header) -> None:
    """Per-scheme consistency of the header fields (everything `body_layout` relies on)."""
    n = h.numel
    fixed_bits = {"none": 32, "bf16": 16}
    if h.scheme in fixed_bits:
        if h.bits != fixed_bits[h.scheme] or h.granularity != "tensor" or h.mode or h.block_size or h.count:
            raise _fail(f"inconsistent header fields for scheme {h.scheme}: {h}")
        return
    if h.scheme in ("linear", "statistical"):
        if h.bits not in QUANT_BITS:
            raise _fail(f"bits {h.bits} for scheme {h.scheme} (expected {one_of(QUANT_BITS)})")
        if h.mode >= (len(LINEAR_MODES) if h.scheme == "linear" else 1):
            raise _fail(f"unknown mode {h.mode} for scheme {h.scheme}")
        if (h.granularity == "block") != (h.block_size > 0):
            raise _fail(f"block_size {h.block_size} with granularity {h.granularity}")
        groups = num_groups(h.shape, h.granularity, h.block_size or 1)
        if h.count != groups:
            raise _fail(f"{h.count} groups declared, shape {h.shape} with {h.granularity} has {groups}")
        return
    # topk
    if h.bits not in TOPK_VALUE_BITS:
        raise _fail(f"topk value bits {h.bits} (expected {one_of(TOPK_VALUE_BITS)})")
    if h.granularity not in ("tensor", "block") or (h.granularity == "block") != (h.block_size > 0):
        raise _fail(f"inconsistent header fields for topk: {h}")
    if h.count > n or (n > 0 and h.count == 0):
        raise _fail(f"topk keeps {h.count} of {n} elements")
    if h.granularity == "block":
        t = tiling(h.shape, h.block_size)
        if t.chunks and (h.count % t.chunks or h.mode != uint_width(t.chunk_len - 1)):
            raise _fail(
                f"chunked topk: {h.count} entries over {t.chunks} chunks of {t.chunk_len} with {h.mode}-bit "
                f"indices (shape {h.shape}, tiles of side {h.block_size})"
            )
    # The dense output of a sparse payload is not bounded by the payload's length: bound it here (fractions
    # down to ~1e-6 pass). A configured TopK.decode also checks k against its own fraction.
    if n > (h.count + 1) * TOPK_MAX_EXPANSION:
        raise _fail(f"absurd shape {h.shape}: {n} elements from {h.count} top-k entries")
    if not 1 <= h.mode <= MAX_UINT_WIDTH:
        raise _fail(f"topk index width {h.mode} (expected 1..{MAX_UINT_WIDTH})")


def read_header(payload) -> Header:
    """The validated header of a payload (the whole payload is checked, CRC included)."""
    return parse(payload)[0]
