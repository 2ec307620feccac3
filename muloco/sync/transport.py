"""Which transport a compressed sync takes (`sync.transport`), decided once when the engine is built.

fp32 syncs are always a ring all-reduce (already a reduce-scatter then an all-gather). Compressed ones are
an all-gather of every worker's message (codec.py) or a reduce-scatter of its parts (scatter.py); `auto`
asks the WAN model (wan.faster_transport) with the configured link, or compares the bytes without one.
"""

from __future__ import annotations

import logging

from muloco.errors import UserError
from muloco.net.wan import Link, faster_transport

log = logging.getLogger("muloco")


def choose_transport(
    requested: str,
    workers: int | None,
    compressed: bool,
    link: Link | None,
    message_bytes: float,
    mean_bytes: float,
    supported: tuple[str, ...] = ("all_gather", "reduce_scatter"),
    overlapped: bool = False,
) -> str:
    """all_reduce (fp32), all_gather or reduce_scatter; logged with the reason. `supported`: the reducer's
    compressed transports (Reducer.transports): `auto` picks only among them, and an explicit request
    for another is a UserError. `workers` is None when the group is not fixed (the Python API's swarm).
    overlapped (sync.overlap > 0): `auto` takes all_gather, whose one collective runs under the inner
    steps; reduce_scatter's second, the owners' all-gather, starts only when the sync is waited for (over
    7.4 Mbit/s 20 ms links streaming P = 3 tau = 4 trained at 134 ms a step with it, 74 with all_gather:
    docs/records/benchmarks.md)."""
    if not compressed:
        return "all_reduce"
    if requested != "auto" and requested not in supported:
        raise UserError(
            f"sync.transport={requested} needs backend.kind local or torch (fixed part owners); this "
            f"backend carries {', '.join(supported)}: use sync.transport=auto"
        )
    if workers is None or "reduce_scatter" not in supported:
        return "all_gather"
    if requested == "auto" and overlapped:
        log.info("sync.transport=auto: all_gather (the sync overlaps the inner steps: one collective)")
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
