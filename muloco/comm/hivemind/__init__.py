"""The hivemind backend: peers on the internet form a swarm (a DHT) and average pseudogradients in groups.

The sync engine reaches the swarm through `muloco.sync.swarm.SwarmReducer` (the reducer protocol).

- `swarm.py`: `HivemindSwarm`, one peer's membership of the swarm, put together from the parts below; its
  options are `muloco.config.HivemindBackendConfig` (the config section backend.hivemind).
- `exchange.py`: one sync of one fragment (`FragmentSync`: encode, matchmaking, exchange, combine),
  `AverageResult`, `AveragingHandle`; its docstring walks through one sync.
- `transfer.py`: serving this peer's payloads over P2P and downloading the other members', by token.
- `lifecycle.py`: start-up and shutdown of the DHT, the averagers, the P2P loop thread and the executor;
  `require_fork_start_method`.
- `state_sharing.py`: serving the global state to joiners, loading it from peers.
- `progress.py`: the peers' outer steps in the DHT (who is behind).
- `settings.py`: `derive_timeouts` (timeouts from the sync size), `SyncTimeouts`, `is_loopback`, constants.
- `payloads.py`: `MulocoCompression`, hivemind's CompressionBase over a muloco compressor; payload hashes.
- `combine.py`: the pure rules that decide which contributions are averaged, and the mean; exclusion kinds.
- `mismatch.py`: diagnostics for payloads that do not match their token (MULOCO_PAYLOAD_DUMP).
"""

from muloco.comm.hivemind.combine import contribution_norm, contribution_problem, norm_outliers
from muloco.comm.hivemind.exchange import AverageResult, AveragingHandle
from muloco.comm.hivemind.lifecycle import require_fork_start_method
from muloco.comm.hivemind.payloads import MulocoCompression, unwrap_payload, wrap_payload
from muloco.comm.hivemind.settings import SyncTimeouts, derive_timeouts, is_loopback
from muloco.comm.hivemind.swarm import HivemindSwarm

__all__ = [
    "AverageResult",
    "AveragingHandle",
    "HivemindSwarm",
    "MulocoCompression",
    "SyncTimeouts",
    "contribution_norm",
    "contribution_problem",
    "derive_timeouts",
    "is_loopback",
    "norm_outliers",
    "require_fork_start_method",
    "unwrap_payload",
    "wrap_payload",
]
