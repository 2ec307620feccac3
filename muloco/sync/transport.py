"""Which transport a compressed sync takes (`sync.transport`), decided once when the engine is built.

fp32 syncs are always a ring all-reduce (already a reduce-scatter then an all-gather). Compressed ones are
an all-gather of every worker's message (codec.py) or a reduce-scatter of its parts (scatter.py); `auto`
asks the WAN model (wan.faster_transport) with the configured link, or compares the bytes without one.
"""

from __future__ import annotations

import logging

from muloco.errors import UserError
from muloco.wan import Link, faster_transport

log = logging.getLogger("muloco")


def choose_transport(
    requested: str,
    workers: int | None,
    compressed: bool,
    link: Link | None,
    message_bytes: float,
    mean_bytes: float,
) -> str:
    """all_reduce (fp32), all_gather or reduce_scatter; logged with the reason. `workers` is None for a
    swarm (groups change every sync: no fixed part owners)."""
    if not compressed:
        return "all_reduce"
    if workers is None:
        if requested == "reduce_scatter":
            raise UserError("sync.transport=reduce_scatter needs backend.kind local or torch; use auto")
        return "all_gather"
    chosen = requested if requested != "auto" else faster_transport(link, message_bytes, mean_bytes, workers)
    log.info(
        "sync.transport=%s: %s (K=%d, message %.0f B, owners' mean %.0f B, link %s)",
        requested,
        chosen,
        workers,
        message_bytes,
        mean_bytes,
        f"{link.bandwidth_mbps} Mbit/s {link.latency_ms} ms" if link else "none: fewer bytes",
    )
    return chosen


__all__ = ["choose_transport"]
