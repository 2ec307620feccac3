"""The reduce-scatter transport's messages: bytes per worker that do not grow with K.

An all-gather of compressed messages costs each worker (K-1) x its message per sync; a ring all-reduce
of fp32 costs 2 (K-1)/K x the fp32 size whatever K is. `sync.transport: reduce_scatter` keeps the
compression and the constant factor:

1. scatter  each replica cuts its pseudogradient into K parts (parts.py: whole rows, balanced by bytes),
            encodes each part on its own (with its error feedback) and sends part j to part j's owner,
            replica j;
2. average  the owner decodes the contributions it received in replica order (a malformed one is left out
            and logged), averages them and quantizes the mean once, with its own error-feedback buffer for
            this second quantization (`compression.mean_bits`);
3. gather   every worker all-gathers the owners' encoded means and decodes them: every worker holds the
            same mean, bit for bit, whichever process hosts it (the owner too decodes its own bytes).

Bytes per worker per sync: (K-1)/K x the message in step 1 plus (K-1)/K x the encoded mean in step 3.

A replica's message is `pack` of its K part messages; a part message is `pack` of its pieces' payloads; an
owner's mean message is `pack` of the contributor count (u32) and the pieces' payloads.
"""

from __future__ import annotations

import logging
import struct

import torch

from muloco.compress import CompressionError, Compressor, ErrorFeedback
from muloco.sync.codec import (
    PseudogradientCodec,
    decode_each,
    decode_payloads,
    encode_payloads,
    pack,
    pack_bound,
    unpack,
)
from muloco.sync.parts import Piece, assign_parts

log = logging.getLogger("muloco")
_COUNT = struct.Struct("<I")


class PartitionedCodec:
    """A fragment's codec for reduce-scatter: K parts, their per-piece compressors (the fragment codec's,
    the piece inheriting its tensor's) and the compressors of the owners' means."""

    def __init__(
        self,
        codec: PseudogradientCodec,
        shapes: list[torch.Size],
        parts: int,
        mean_compressors: list[Compressor],
    ) -> None:
        costs = [float(c.payload_nbytes(tuple(s))) for c, s in zip(codec.compressors, shapes, strict=True)]
        self.codec, self.shapes = codec, shapes
        self.parts: list[list[Piece]] = assign_parts(shapes, costs, parts)
        self.mean_compressors = mean_compressors

    @property
    def names(self) -> list[str]:
        return self.codec.names

    def encode(self, delta: list[torch.Tensor], error_feedback: ErrorFeedback | None = None) -> bytes:
        """One replica's message: its K part messages. Error feedback (the compressed parameters only)
        folds each whole tensor once, then sends it piece by piece."""
        c = self.codec
        residuals = [
            error_feedback.accumulate(name, d) if error_feedback is not None and not skipped else d
            for name, d, skipped in zip(c.names, delta, c.skipped, strict=True)
        ]
        pieces = [piece for part in self.parts for piece in part]  # every part's, encoded in one batch
        payloads = encode_payloads(
            [piece.of(residuals[piece.tensor]) for piece in pieces],
            [c.compressors[piece.tensor] for piece in pieces],
            [not c.skipped[piece.tensor] for piece in pieces],
            error_feedback,
        )
        messages, start = [], 0
        for part in self.parts:
            messages.append(pack(payloads[start : start + len(part)]))
            start += len(part)
        return pack(messages)

    def part_bound(self, part: int) -> int:
        """Bytes one replica's message of part `part` takes at most (payload_nbytes: exact, an upper bound
        for topk): the same on every process, so the scatter needs no exchange of sizes first."""
        return pack_bound([self._piece_bytes(p, self.codec.compressors) for p in self.parts[part]])

    def mean_bound(self, part: int) -> int:
        """Bytes part `part`'s owner's mean message takes at most (its count, then its pieces)."""
        pieces = [self._piece_bytes(p, self.mean_compressors) for p in self.parts[part]]
        return pack_bound([_COUNT.size, *pieces])

    def _piece_bytes(self, piece: Piece, compressors: list[Compressor]) -> int:
        return compressors[piece.tensor].payload_nbytes(tuple(piece.shape(self.shapes[piece.tensor])))

    def split(self, message: bytes) -> list[bytes]:
        """A replica's message -> its K part messages."""
        parts = unpack(message)
        if len(parts) != len(self.parts):
            raise CompressionError(
                f"sync message holds {len(parts)} parts, the run has K = {len(self.parts)}"
            )
        return parts

    def average(
        self, part: int, messages: list[bytes], owner_feedback: ErrorFeedback | None, like: list[torch.Tensor]
    ) -> bytes:
        """Part `part`'s owner: the mean of the contributions (in replica order), quantized once; a
        contribution that does not decode is left out with a warning. Returns the mean message."""
        pieces = self.parts[part]
        total = [torch.zeros_like(piece.of(like[piece.tensor]), dtype=torch.float32) for piece in pieces]
        count = 0
        names = [self.names[p.tensor] for p in pieces]
        shapes = [p.shape(self.shapes[p.tensor]) for p in pieces]
        compressors = [self.codec.compressors[p.tensor] for p in pieces]
        for position, decoded in enumerate(decode_each(messages, compressors, names, shapes)):
            if isinstance(decoded, CompressionError):
                log.warning(
                    "part=%d contribution=%d: left out of the part's mean: %s", part, position, decoded
                )
                continue
            for acc, d in zip(total, decoded, strict=True):
                acc.add_(d.to(acc.device))
            count += 1
        feedback = [owner_feedback is not None and not self.codec.skipped[p.tensor] for p in pieces]
        means = [
            owner_feedback.accumulate(piece.key(self.names[piece.tensor]), acc.div_(max(count, 1)))
            if kept
            else acc.div_(max(count, 1))
            for piece, acc, kept in zip(pieces, total, feedback, strict=True)
        ]
        compressors = [self.mean_compressors[p.tensor] for p in pieces]
        return pack([_COUNT.pack(count), *encode_payloads(means, compressors, feedback, owner_feedback)])

    def decode_means(
        self, mean_messages: list[bytes], like: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor] | None, int]:
        """The K owners' mean messages -> the mean pseudogradient and the fewest contributors of any part.
        Every worker decodes the same bytes, so a malformed mean message is malformed everywhere: its part
        counts 0 contributors and no worker applies the sync (None)."""
        assert len(mean_messages) == len(self.parts), f"{len(mean_messages)=} {len(self.parts)=}"
        values = [torch.zeros_like(t) for t in like]
        fewest = None
        for part, (pieces, message) in enumerate(zip(self.parts, mean_messages, strict=True)):
            try:
                header, *payloads = unpack(message, views=True)
                if len(header) != _COUNT.size:
                    raise CompressionError(f"mean message header of {len(header)} bytes")
                (count,) = _COUNT.unpack(header)
                decoded = self._decode_pieces(pieces, payloads, self.mean_compressors)
            except (CompressionError, ValueError) as exc:
                log.warning("part=%d: the owner's mean does not decode, the sync is skipped: %s", part, exc)
                count, decoded = 0, [torch.zeros(piece.shape(self.shapes[piece.tensor])) for piece in pieces]
            for piece, d in zip(pieces, decoded, strict=True):
                piece.of(values[piece.tensor]).copy_(d)
            fewest = count if fewest is None else min(fewest, count)
        fewest = fewest or 0
        return (values if fewest > 0 else None), fewest

    def _decode_pieces(
        self, pieces: list[Piece], payloads: list[bytes], compressors: list[Compressor]
    ) -> list[torch.Tensor]:
        return decode_payloads(
            payloads,
            [compressors[p.tensor] for p in pieces],
            [self.names[p.tensor] for p in pieces],
            [p.shape(self.shapes[p.tensor]) for p in pieces],
        )


__all__ = ["PartitionedCodec"]
