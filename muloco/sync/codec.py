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


def unpack(blob: bytes, views: bool = False) -> list[bytes]:
    """Split a message; any inconsistency raises CompressionError (checked before slicing). views: the
    parts as zero-copy memoryviews into `blob` (to decode; a part sent on is copied into bytes)."""
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
        part = view[offset : offset + length]
        parts.append(part if views else bytes(part))
        offset += length
    return parts


def decode_payloads(
    payloads: list[bytes], compressors: list[Compressor], names: list[str], shapes: list
) -> list[torch.Tensor]:
    """Each payload decoded by its compressor and checked against its tensor's shape (CompressionError
    naming the tensor otherwise): the check of every message a sync receives, whole or in parts."""
    if len(payloads) != len(shapes):
        raise CompressionError(f"sync message holds {len(payloads)} tensors, expected {len(shapes)}")
    out: list[torch.Tensor | None] = [None] * len(payloads)
    for comp, positions in by_compressor(compressors):
        for i, decoded in zip(positions, comp.decode_many([payloads[i] for i in positions]), strict=True):
            if tuple(decoded.shape) != tuple(shapes[i]):
                raise CompressionError(
                    f"{names[i]}: decoded shape {tuple(decoded.shape)} != {tuple(shapes[i])}"
                )
            out[i] = decoded
    return out


def decode_each(
    messages: list[bytes], compressors: list[Compressor], names: list[str], shapes: list
) -> list[list[torch.Tensor] | CompressionError]:
    """`decode_payloads` of each message (a `pack` of payloads), or the CompressionError it raised. The
    messages decode in one batch; if any is malformed, each is decoded alone to tell which."""
    try:
        payloads = [unpack(m, views=True) for m in messages]
        if any(len(p) != len(shapes) for p in payloads):
            raise CompressionError("a message with another count of tensors")
        n = len(messages)
        flat = decode_payloads([x for p in payloads for x in p], compressors * n, names * n, list(shapes) * n)
        return [flat[i * len(shapes) : (i + 1) * len(shapes)] for i in range(n)]
    except CompressionError:
        out: list[list[torch.Tensor] | CompressionError] = []
        for message in messages:
            try:
                out.append(decode_payloads(unpack(message, views=True), compressors, names, shapes))
            except CompressionError as exc:
                out.append(exc)
        return out


def by_compressor(compressors: list[Compressor]) -> list[tuple[Compressor, list[int]]]:
    """The positions of each distinct compressor, so that each encodes or decodes its tensors in one batch."""
    groups: dict[int, tuple[Compressor, list[int]]] = {}
    for i, comp in enumerate(compressors):
        groups.setdefault(id(comp), (comp, []))[1].append(i)
    return list(groups.values())


def encode_payloads(
    values: list[torch.Tensor],
    compressors: list[Compressor],
    feedback: list[bool],
    error_feedback: ErrorFeedback | None,
) -> list[bytes]:
    """Each value's payload, the values of one compressor encoded in one batch. Where `feedback[i]` (and
    there is error feedback), values[i] is an error-feedback buffer, or rows of one: it keeps the residual."""
    out: list[bytes | None] = [None] * len(values)
    for comp, positions in by_compressor(compressors):
        kept = [i for i in positions if error_feedback is not None and feedback[i]]
        plain = [i for i in positions if not (error_feedback is not None and feedback[i])]
        if kept:
            for i, p in zip(kept, error_feedback.send_many([values[i] for i in kept], comp), strict=True):
                out[i] = p
        if plain:
            for i, p in zip(plain, comp.encode_many([values[i] for i in plain]), strict=True):
                out[i] = p
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
        feedback = [error_feedback is not None and not skipped for skipped in self.skipped]
        values = [
            error_feedback.accumulate(name, d) if kept else d
            for name, d, kept in zip(self.names, delta, feedback, strict=True)
        ]
        return pack(encode_payloads(values, self.compressors, feedback, error_feedback))

    def decode(self, message: bytes, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """One replica's decoded pseudogradient (fp32, on the CPU); CompressionError if it is malformed."""
        shapes = [t.shape for t in like]
        return decode_payloads(unpack(message, views=True), self.compressors, self.names, shapes)

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
        messages = [message for blob in blobs for message in unpack(blob, views=True)]
        if len(messages) > max_replicas:
            raise CompressionError(
                f"sync received {len(messages)} replica messages, more than K = {max_replicas}"
            )
        shapes = [t.shape for t in like]
        total = [torch.zeros_like(t) for t in like] if rule == "mean" else None
        decoded: list[list[torch.Tensor]] = []
        seen = 0
        for position, values in enumerate(decode_each(messages, self.compressors, self.names, shapes)):
            robust = total is None
            if robust and isinstance(values, list) and not all(bool(torch.isfinite(v).all()) for v in values):
                values = CompressionError("non-finite values (a robust rule needs finite inputs)")
            if isinstance(values, CompressionError):
                log.warning("message=%d: left out of the mean: %s", position, values)
                continue
            if robust:
                decoded.append([d.to(t.device) for d, t in zip(values, like, strict=True)])
            else:
                for acc, d in zip(total, values, strict=True):
                    acc.add_(d.to(acc.device))
            seen += 1
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


__all__ = [
    "PseudogradientCodec",
    "by_compressor",
    "decode_each",
    "decode_payloads",
    "encode_payloads",
    "is_skipped",
    "pack",
    "pack_bound",
    "unpack",
]
