"""What a replica sends at a sync: its pseudogradient, one compressed payload per parameter, in one message.

A process concatenates its replicas' messages into one blob; the blobs of all processes are all-gathered, and
every process decodes every replica's message, in global replica order, and averages them. So every process
computes the same mean, bit for bit, and the simulation encodes exactly what a real node would send.

Message layout (little-endian): u32 count, count x u64 lengths, then the payloads back to back.
"""

from __future__ import annotations

import logging
import math
import re
import struct

import torch

from muloco.comm.aggregate import aggregate
from muloco.compress import (
    CompressionError,
    Compressor,
    ErrorFeedback,
    get_compressor,
    get_compressor_from_config,
)
from muloco.models.roles import ParamRole

log = logging.getLogger("muloco")
_COUNT = struct.Struct("<I")
_LEN = struct.Struct("<Q")
MAX_PARTS = 1 << 20  # no model here has a million tensors: a larger count is a corrupt message


def pack(parts: list[bytes]) -> bytes:
    lengths = b"".join(_LEN.pack(len(p)) for p in parts)
    return _COUNT.pack(len(parts)) + lengths + b"".join(parts)


def pack_bound(bounds: list[int]) -> int:
    """Bytes `pack` of parts of at most `bounds` bytes each takes at most."""
    return _COUNT.size + sum(_LEN.size + b for b in bounds)


def unpack(blob: bytes) -> list[bytes]:
    """Split a message; any inconsistency raises CompressionError (checked before slicing)."""
    view = memoryview(blob)
    if len(view) < _COUNT.size:
        raise CompressionError(f"sync message of {len(view)} bytes is too short for its header")
    (count,) = _COUNT.unpack_from(view, 0)
    header = _COUNT.size + count * _LEN.size
    if count > MAX_PARTS or header > len(view):
        raise CompressionError(f"sync message declares {count} parts but holds {len(view)} bytes")
    lengths = [_LEN.unpack_from(view, _COUNT.size + i * _LEN.size)[0] for i in range(count)]
    if header + sum(lengths) != len(view):
        raise CompressionError(
            f"sync message sizes do not add up: header says {header + sum(lengths)} bytes, got {len(view)}"
        )
    parts, offset = [], header
    for length in lengths:
        parts.append(bytes(view[offset : offset + length]))
        offset += length
    return parts


def decode_payloads(
    payloads: list[bytes], compressors: list[Compressor], names: list[str], shapes: list
) -> list[torch.Tensor]:
    """Each payload decoded by its compressor and checked against its tensor's shape (CompressionError
    naming the tensor otherwise): the check of every message a sync receives, whole or in parts."""
    if len(payloads) != len(shapes):
        raise CompressionError(f"sync message holds {len(payloads)} tensors, expected {len(shapes)}")
    out = []
    for payload, comp, name, shape in zip(payloads, compressors, names, shapes, strict=True):
        decoded = comp.decode(payload)
        if tuple(decoded.shape) != tuple(shape):
            raise CompressionError(f"{name}: decoded shape {tuple(decoded.shape)} != {tuple(shape)}")
        out.append(decoded)
    return out


def is_skipped(name: str, role: ParamRole, skip: list[str]) -> bool:
    """compression.skip entries are role names (embedding, head, norm, bias, scalar) or name regexes."""
    roles = {r.value for r in ParamRole}
    return any(role.value == rule if rule in roles else re.search(rule, name) for rule in skip)


class PseudogradientCodec:
    """Per-parameter compressors and the encode / decode-and-average of whole pseudogradients."""

    def __init__(self, names: list[str], compressors: list[Compressor]) -> None:
        assert len(names) == len(compressors), f"{len(names)=} != {len(compressors)=}"
        self.names = names
        self.compressors = compressors
        self.skipped = [False] * len(names)

    @classmethod
    def from_config(cls, names: list[str], roles: dict[str, ParamRole], cfg) -> PseudogradientCodec:
        """cfg is the `compression:` section; skipped parameters travel as fp32 or bf16."""
        main = get_compressor_from_config(cfg)
        plain = get_compressor("bf16" if cfg.skip_dtype == "bf16" else "none")
        skipped = [is_skipped(n, roles[n], cfg.skip) for n in names]
        codec = cls(names, [plain if s else main for s in skipped])
        codec.skipped = skipped
        return codec

    def encode(self, delta: list[torch.Tensor], error_feedback: ErrorFeedback | None = None) -> bytes:
        """One replica's message. Error feedback applies to the compressed parameters only."""
        payloads = []
        for name, d, comp, skipped in zip(self.names, delta, self.compressors, self.skipped, strict=True):
            if error_feedback is not None and not skipped:
                payloads.append(error_feedback.encode(name, d, comp))
            else:
                payloads.append(comp.encode(d))
        return pack(payloads)

    def decode(self, message: bytes, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """One replica's decoded pseudogradient (fp32, on the CPU); CompressionError if it is malformed."""
        return decode_payloads(unpack(message), self.compressors, self.names, [t.shape for t in like])

    def decode_sum(self, message: bytes, out: list[torch.Tensor]) -> None:
        """Add one replica's decoded pseudogradient into `out` (in place; nothing added if malformed)."""
        for acc, decoded in zip(out, self.decode(message, out), strict=True):
            acc.add_(decoded.to(acc.device))

    def decode_mean(
        self,
        blobs: list[bytes],
        max_replicas: int,
        like: list[torch.Tensor],
        rule: str = "mean",
        trim: int = 1,
    ) -> tuple[list[torch.Tensor] | None, int]:
        """Mean of every replica's message and how many there were; blobs are the processes' packed
        messages in rank order (a process sends none for a replica left out of the sync). A message that
        does not decode is left out and logged, on every process alike (they all decode the same bytes).
        rule: sync.aggregate; a robust rule keeps every decoded message and combines them in replica order."""
        total = [torch.zeros_like(t) for t in like] if rule == "mean" else None
        decoded: list[list[torch.Tensor]] = []
        seen = position = 0
        for blob in blobs:
            for message in unpack(blob):
                try:
                    if total is not None:
                        self.decode_sum(message, total)
                    else:
                        values = self.decode(message, like)
                        if not all(bool(torch.isfinite(v).all()) for v in values):
                            raise CompressionError("non-finite values (a robust rule needs finite inputs)")
                        decoded.append([d.to(t.device) for d, t in zip(values, like, strict=True)])
                    seen += 1
                except CompressionError as exc:
                    log.warning("message=%d: left out of the mean: %s", position, exc)
                position += 1
        if position > max_replicas:
            raise CompressionError(f"sync received {position} replica messages, more than K = {max_replicas}")
        if not seen:
            return None, 0
        if total is None:
            return aggregate(decoded, rule, trim), seen
        return [t.div_(seen) for t in total], seen

    def packed_bound(self, shapes: list[torch.Size], messages: int) -> int:
        """Bytes `pack` of up to `messages` of this codec's messages can take (payload_nbytes is exact, an
        upper bound for topk): the same on every process, so an all-gather can pad to it without first
        gathering the sizes (a round trip of its own over a slow link)."""
        return _COUNT.size + messages * (_LEN.size + math.ceil(self.payload_bits(shapes) / 8))

    def payload_bits(self, shapes: list[torch.Size]) -> float:
        """Bits one replica's message takes (payloads and the message header)."""
        body = sum(c.payload_nbytes(tuple(s)) for c, s in zip(self.compressors, shapes, strict=True))
        return 8.0 * (body + _COUNT.size + _LEN.size * len(shapes))


__all__ = ["PseudogradientCodec", "decode_payloads", "is_skipped", "pack", "pack_bound", "unpack"]
