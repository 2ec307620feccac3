"""The hivemind backend: peers on the internet form a swarm (a DHT) and average pseudogradients in groups.

- `swarm.py`: `HivemindSwarm` (one peer's membership: matchmaking, payload exchange, state sharing, outer
  steps), `AverageResult`, `AveragingHandle`; its docstring walks through one sync.
- `settings.py`: `HivemindSettings` (backend.hivemind) and `derive_timeouts` (timeouts from the sync size).
- `payloads.py`: `MulocoCompression`, hivemind's CompressionBase over a muloco compressor; payload hashes.
- `combine.py`: the pure rules that decide which contributions are averaged, and the mean.
"""

from muloco.comm.hivemind.combine import contribution_norm, contribution_problem, mean_in_order, norm_outliers
from muloco.comm.hivemind.payloads import MulocoCompression, unwrap_payload, wrap_payload
from muloco.comm.hivemind.settings import HivemindSettings, SyncTimeouts, derive_timeouts, is_loopback
from muloco.comm.hivemind.swarm import (
    AverageResult,
    AveragingHandle,
    HivemindSwarm,
    require_fork_start_method,
)

__all__ = [
    "AverageResult",
    "AveragingHandle",
    "HivemindSettings",
    "HivemindSwarm",
    "MulocoCompression",
    "SyncTimeouts",
    "contribution_norm",
    "contribution_problem",
    "derive_timeouts",
    "is_loopback",
    "mean_in_order",
    "norm_outliers",
    "require_fork_start_method",
    "unwrap_payload",
    "wrap_payload",
]
