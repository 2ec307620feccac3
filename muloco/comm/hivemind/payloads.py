"""What travels between peers: muloco payloads inside hivemind's tensor message, and their hash."""

from __future__ import annotations

import hashlib
import math

import torch
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.proto import runtime_pb2

from muloco.compress import CompressionError, Compressor, NoCompression

# ---- compression adapter --------------------------------------------------------------------------------


def wrap_payload(payload: bytes) -> runtime_pb2.Tensor:
    """A muloco payload as hivemind's tensor message: dtype uint8, shape [nbytes], compression NONE. Any
    hivemind code that deserializes it gets the payload bytes back, never misread values."""
    return runtime_pb2.Tensor(
        buffer=payload, size=[len(payload)], dtype="uint8", compression=runtime_pb2.CompressionType.NONE
    )


def unwrap_payload(message: runtime_pb2.Tensor) -> bytes:
    """The payload bytes of `wrap_payload`'s message; CompressionError if it is not one."""
    if message.dtype != "uint8" or message.compression != runtime_pb2.CompressionType.NONE:
        raise CompressionError(
            f"expected a muloco payload (uint8, compression NONE), got dtype {message.dtype!r}, "
            f"compression {runtime_pb2.CompressionType.Name(message.compression)}"
        )
    if list(message.size) != [len(message.buffer)]:
        raise CompressionError(
            f"payload message declares size {list(message.size)}, holds {len(message.buffer)} B"
        )
    return bytes(message.buffer)


class MulocoCompression(CompressionBase):
    """hivemind's CompressionBase over a muloco compressor: `compress` encodes with our wire format and wraps
    the payload (`wrap_payload`); `extract` validates and decodes it (fp32, CPU; CompressionError if bad)."""

    compression_type = runtime_pb2.CompressionType.NONE  # the payload travels as plain uint8 bytes

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False
    ) -> runtime_pb2.Tensor:
        return wrap_payload(self.compressor.encode(tensor))

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return self.compressor.decode(unwrap_payload(serialized_tensor))

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        shape = tuple(info.descriptor.size)
        raw = math.prod(shape) * torch.empty((), dtype=info.descriptor.dtype).element_size()
        return self.compressor.payload_nbytes(shape) / max(raw, 1)

    def __repr__(self) -> str:
        return f"MulocoCompression({self.compressor!r})"


def _adapters(
    compression: Compressor | list[list[Compressor]] | None, shapes: list[list[torch.Size]]
) -> list[list[MulocoCompression]]:
    """One MulocoCompression per tensor of every fragment."""
    if compression is None:
        compression = NoCompression()
    if isinstance(compression, Compressor):
        return [[MulocoCompression(compression) for _ in fragment] for fragment in shapes]
    if len(compression) != len(shapes) or any(
        len(cs) != len(ss) for cs, ss in zip(compression, shapes, strict=False)
    ):
        raise ValueError("compression: give one Compressor, or one per tensor of every fragment")
    return [[MulocoCompression(c) for c in cs] for cs in compression]


# ---- payload hashing ------------------------------------------------------------------------------------


def payload_token(messages: list[runtime_pb2.Tensor]) -> bytes:
    """A 16-byte hash of a contribution's payloads: members check that they all decode the same bytes."""
    digest = hashlib.blake2b(digest_size=16)
    for m in messages:
        digest.update(len(m.buffer).to_bytes(8, "little"))
        digest.update(m.buffer)
    return digest.digest()
