"""`TorchftGroup`: this worker's membership in an elastic torchft run (backend.kind=torchft).

torchft (PyTorch's fault-tolerance engine, `pip install -e ".[torchft]"`) does the membership: a Rust
lighthouse forms a quorum of the workers that ask for one, a worker that stops heartbeating is left out of
the next, and a worker behind the quorum's step is healed with a live copy of a healthy member's state
(torchft's checkpoint transport, HTTP). This module wraps one `torchft.Manager` (a replica group of one
rank, its own TCPStore) and gives the sync engine's reducer (sync/elastic.py) the collectives it needs over
the current quorum: a sum all-reduce and an all-gather of bytes. It knows nothing about optimizers.

A collective that fails (a member died mid-sync) does not raise: torchft records the error and the sync's
commit vote fails, so the reducer retries it with a new quorum.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from muloco.comm.base import frame, unframe
from muloco.config import TorchftBackendConfig
from muloco.errors import UserError, one_line

log = logging.getLogger("muloco")

# torchft logs every quorum at INFO (Python loggers, and Rust's, read from RUST_LOG when first loaded);
# ours say what matters (quorum size, heals, retries).
os.environ.setdefault("RUST_LOG", "warn")
for _name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
    logging.getLogger(_name).setLevel(logging.ERROR)  # (its warnings: e.g. no NCCL flight recorder on CPU)

_HEARTBEATING = re.compile(r"\[(\d+) heartbeating\]")
_QUORUM_ID = re.compile(r"Current quorum_id:\s*(\d+)")


def lighthouse_address(section: TorchftBackendConfig) -> str:
    address = section.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not address:
        raise UserError(
            "backend.torchft.lighthouse is not set (nor TORCHFT_LIGHTHOUSE): give the lighthouse's address, "
            "e.g. http://head-node:29510, or start the run with `muloco launch --backend torchft`"
        )
    return address if "://" in address else f"http://{address}"


def lighthouse_status(address: str, timeout_s: float = 5.0) -> tuple[int, int]:
    """The lighthouse's (quorum id, workers heartbeating), from its status page; raises UserError when it
    cannot be reached. Quorum id 0: no quorum yet, a new run."""
    try:
        with urllib.request.urlopen(f"{address}/status", timeout=timeout_s) as response:
            page = response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise UserError(
            f"backend.torchft.lighthouse: cannot reach the lighthouse at {address} ({one_line(exc)}); start "
            "it (`torchft_lighthouse --min_replicas 1`) or fix the address"
        ) from None
    quorum_id, heartbeating = _QUORUM_ID.search(page), _HEARTBEATING.search(page)
    return (int(quorum_id.group(1)) if quorum_id else 0, int(heartbeating.group(1)) if heartbeating else 0)


def _checkpoint_transport(host: str, timeout: timedelta):
    """torchft's HTTP checkpoint server (a healing worker downloads a donor's state from it), advertised
    under `host`: torchft's own advertises the machine's hostname, which may not resolve elsewhere."""
    from torchft.checkpointing import HTTPTransport

    class AdvertisedHTTPTransport(HTTPTransport):
        def address(self) -> str:
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return AdvertisedHTTPTransport(timeout=timeout, num_chunks=0)


class QuorumFailed(RuntimeError):
    """No quorum formed within backend.torchft.quorum_timeout_s."""


class TorchftGroup:
    """One worker's torchft manager, its process group over the quorum and its state callbacks."""

    def __init__(
        self,
        section: TorchftBackendConfig,
        replica_id: int,
        save_state: Callable[[], dict[str, Any]],
        load_state: Callable[[dict[str, Any]], None],
    ) -> None:
        try:
            from torchft import Manager, ProcessGroupGloo
        except ImportError:
            raise UserError(
                'backend.kind=torchft needs torchft: pip install -e ".[torchft]"; or another backend.kind'
            ) from None

        self.section, self.replica_id = section, replica_id
        self.lighthouse = lighthouse_address(section)
        lighthouse_status(self.lighthouse)  # unreachable: one line and exit 2, before anything starts
        timeout = timedelta(seconds=section.timeout_s)
        # The name the quorum's other members reach this worker by: its manager, its store (the quorum's
        # process group meets at its first member's store) and its checkpoint server are advertised under it.
        host = section.hostname or socket.gethostname()
        # The replica group's own store (a group of one rank: this process hosts it; it listens everywhere).
        self._store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self.pg = ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=self.pg,
            load_state_dict=load_state,
            state_dict=save_state,
            min_replica_size=section.min_replicas,
            use_async_quorum=False,  # heal before the sync's collectives, on this thread
            timeout=timeout,
            quorum_timeout=timedelta(seconds=section.quorum_timeout_s),
            connect_timeout=timedelta(seconds=min(section.timeout_s, 30.0)),
            rank=0,
            world_size=1,
            store_addr=host,
            store_port=self._store.port,
            lighthouse_addr=self.lighthouse,
            replica_id=f"muloco{replica_id}",
            hostname=host,
            checkpoint_transport=_checkpoint_transport(host, timeout),
            init_sync=False,  # every worker starts from the same seeded weights
        )

    # -- membership -----------------------------------------------------------------------------------
    def wait_for_workers(self, count: int, timeout_s: float) -> None:
        """A new run (no quorum yet): wait until `count` workers heartbeat at the lighthouse, so the first
        quorum, which waits for every live worker, has them all. A worker joining a running job goes on."""
        deadline = time.monotonic() + timeout_s
        while True:
            quorum_id, heartbeating = lighthouse_status(self.lighthouse)
            if quorum_id > 0 or heartbeating >= count:
                return
            if time.monotonic() > deadline:
                log.warning(
                    "torchft: %d of backend.torchft.wait_for_workers=%d after %.0f s: starting anyway",
                    heartbeating,
                    count,
                    timeout_s,
                )
                return
            time.sleep(0.2)

    def form_quorum(self) -> None:
        """Join the next quorum (waits for the live workers to ask too); a worker behind the quorum's
        step adopts a healthy member's state (the load callback) before this returns."""
        try:
            self.manager.start_quorum(allow_heal=True)
        except Exception as exc:  # the lighthouse's timeout, or it went away
            # start_quorum first waits on the previous attempt's future, which would raise this again at
            # once: drop it, so that the next attempt asks the lighthouse anew.
            self.manager._quorum_future = None
            raise QuorumFailed(one_line(exc)) from None
        if self.manager.errored() is not None:  # e.g. the heal's transfer failed
            raise QuorumFailed(one_line(self.manager.errored().original_exception))

    @property
    def size(self) -> int:
        return self.manager.num_participants()

    @property
    def quorum_id(self) -> int:
        return self.manager._quorum_id  # torchft exposes no getter; the logs name quorums by it

    @property
    def step(self) -> int:
        """Committed syncs, as torchft counts them (the lighthouse heals a worker behind the max)."""
        return self.manager.current_step()

    def set_step(self, step: int) -> None:
        """A worker resumed from its own checkpoint is at that checkpoint's sync count."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    # -- collectives over the quorum ------------------------------------------------------------------
    def all_reduce_sum(self, flat: torch.Tensor) -> torch.Tensor:
        """Sum `flat` over the quorum in place. A failure is recorded (commit() then votes no)."""
        from torch.distributed import ReduceOp

        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        return flat

    def all_gather_bytes(self, payload: bytes, capacity: int | None = None) -> list[bytes]:
        """Every member's payload, in quorum order (the same on every member); [] after a failure. With
        `capacity` (a bound on every member's payload): one all-gather of buffers of that size, each led
        by its length; without, the lengths first (a round trip of its own over a slow link)."""
        from torch.distributed.distributed_c10d import AllgatherOptions

        if self.manager.errored() is not None:
            return []
        n = self.size
        try:
            if capacity is not None:
                mine = torch.frombuffer(bytearray(frame(payload, capacity)), dtype=torch.uint8)
                blobs = [torch.empty_like(mine) for _ in range(n)]
                self.pg.allgather([blobs], [mine], AllgatherOptions()).wait()
                return [unframe(bytes(b.numpy())) for b in blobs]
            length = torch.tensor([len(payload)], dtype=torch.int64)
            lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
            self.pg.allgather([lengths], [length], AllgatherOptions()).wait()
            longest = max(int(t.item()) for t in lengths)
            mine = torch.zeros(longest, dtype=torch.uint8)
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            blobs = [torch.empty(longest, dtype=torch.uint8) for _ in range(n)]
            self.pg.allgather([blobs], [mine], AllgatherOptions()).wait()
        except Exception as exc:  # a member died mid-sync: recorded, the commit vote fails
            self.manager.report_error(exc)
            return []
        return [bytes(b[: int(size.item())].numpy()) for b, size in zip(blobs, lengths, strict=True)]

    def commit(self) -> bool:
        """Whether the sync's collectives succeeded here and the quorum is large enough (torchft's vote,
        within this worker's replica group); counts a committed sync."""
        return self.manager.should_commit()

    def close(self) -> None:
        self.manager.shutdown(wait=False)
