"""How each fragment's pseudogradients travel, decided once when the engine is built: its codec (a
replica's message, codec.py), the transport (transport.py) and, for reduce_scatter, the part owners'
second quantization and error feedback (scatter.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from muloco.compress import Compressor, ErrorFeedback, NoCompression
from muloco.config import CompressionConfig, SyncConfig
from muloco.models.roles import param_roles
from muloco.net.wan import Link
from muloco.sync.codec import PseudogradientCodec
from muloco.sync.scatter import PartitionedCodec
from muloco.sync.transport import choose_transport


def owner_feedback(
    compression: CompressionConfig | Compressor | None, transport: str
) -> ErrorFeedback | None:
    """A part owner's error feedback for its second quantization (reduce_scatter only): as
    compression.mean_error_feedback says, with the section's ef_decay / ef_alpha; on, with the defaults,
    for a bare compressor (the Python API)."""
    if transport != "reduce_scatter":
        return None
    if isinstance(compression, CompressionConfig):
        on = compression.mean_error_feedback
        return ErrorFeedback(compression.ef_decay, compression.ef_alpha) if on else None
    return ErrorFeedback()


def mean_compression(compression: CompressionConfig | Compressor | None):
    """The compression of the part owners' means (reduce_scatter): a section's second_stage_bits; a bare
    compressor (the Python API) compresses both stages."""
    if isinstance(compression, CompressionConfig):
        return compression.model_copy(update={"bits": compression.second_stage_bits})
    return compression


def build_codecs(
    model: nn.Module, fragments: list[list[int]], compression: CompressionConfig | Compressor | None
) -> list[PseudogradientCodec]:
    """One codec per fragment: a `compression:` section (skip rules as in `muloco train`), or one
    compressor for every parameter; none when uncompressed."""
    names = [name for name, _ in model.named_parameters()]
    if compression is None or getattr(compression, "scheme", None) == "none":
        return []
    if isinstance(compression, Compressor):
        return [PseudogradientCodec([names[i] for i in f], [compression] * len(f)) for f in fragments]
    roles = param_roles(model)
    return [PseudogradientCodec.from_config([names[i] for i in f], roles, compression) for f in fragments]


def is_chunked_topk(compression: CompressionConfig | Compressor | None) -> bool:
    """Chunked top-k (a section's topk_chunk, or a bare TopK with a chunk)."""
    if isinstance(compression, CompressionConfig):
        return compression.scheme == "topk" and compression.topk_chunk is not None
    return getattr(compression, "scheme", None) == "topk" and getattr(compression, "chunk", None) is not None


@dataclass
class MessagePlan:
    codecs: list  # one per fragment (PseudogradientCodec or PartitionedCodec); none: fp32 all-reduce
    transport: str  # all_reduce | all_gather | reduce_scatter
    compressed: bool = True  # by compression: (fp32 messages of a robust rule are not)


def plan_messages(
    model: nn.Module,
    fragments: list[list[int]],
    shapes: list[list[torch.Size]],
    compression: CompressionConfig | Compressor | None,
    sync: SyncConfig,
    reducer,
    link: Link | None,
    sharded: bool,
) -> MessagePlan:
    """The fragments' codecs and the transport. A robust sync.aggregate needs every contribution whole:
    messages (fp32 when uncompressed), all-gathered (comm/aggregate.py). sync.transport is resolved among the
    reducer's transports; reduce_scatter wraps each fragment's codec into K parts whose owners re-quantize
    the mean with `compression.mean_bits`."""
    codecs = build_codecs(model, fragments, compression)
    workers = reducer.workers
    if sync.aggregate != "mean":  # the owners of parts could not apply a rule on whole messages
        if codecs:
            return MessagePlan(codecs, "all_gather", compressed=True)
        names = [name for name, _ in model.named_parameters()]
        whole = [PseudogradientCodec([names[i] for i in f], [NoCompression()] * len(f)) for f in fragments]
        return MessagePlan(whole, "all_gather", compressed=False)
    if not codecs:
        return MessagePlan([], "all_reduce", compressed=False)  # fp32: a ring all-reduce (transport.py)
    mean_codecs = build_codecs(model, fragments, mean_compression(compression))
    message = sum(c.payload_bits(s) / 8 for c, s in zip(codecs, shapes, strict=True))
    mean = sum(c.payload_bits(s) / 8 for c, s in zip(mean_codecs, shapes, strict=True))
    # A reducer that does not declare its transports (a user's own, via the Python API) gets all_gather.
    supported = getattr(reducer, "transports", ("all_gather",))
    if is_chunked_topk(compression):  # sparse parts travel as they are (config/schema.py)
        supported = tuple(t for t in supported if t != "reduce_scatter")
    overlapped = sync.overlap > 0
    transport = choose_transport(sync.transport, workers, True, link, message, mean, supported, overlapped)
    if transport == "reduce_scatter" and sharded:
        transport = "all_gather"  # its part owners' buffers are per rank, not resharded (config/schema.py)
    if transport == "reduce_scatter":
        codecs = [
            PartitionedCodec(c, s, workers, m.compressors)
            for c, s, m in zip(codecs, shapes, mean_codecs, strict=True)
        ]
    return MessagePlan(codecs, transport, compressed=True)
