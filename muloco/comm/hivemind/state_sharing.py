"""Joining: a peer serves its global state to joiners, and a joiner loads it before its first sync.

hivemind's state sharing on a dedicated averager (DHT prefix f"{run_id}_state") that never averages: a
joiner asks the peers that share their state in priority order and downloads (tensors, metadata) from one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.utils.serializer import MSGPackSerializer

log = logging.getLogger("muloco")

GetState = Callable[[], tuple[list[torch.Tensor], dict]]


class _StateServer(DecentralizedAverager):
    """Serves this peer's global state to joiners through hivemind's state sharing; never averages."""

    get_state: GetState | None = None

    def get_current_state(self):
        # Runs in this (host) process, in hivemind's background thread, when a joiner asks.
        assert self.get_state is not None, "state sharing is on without a get_state callback"
        tensors, meta = self.get_state()
        return {"muloco_state": meta}, [t.detach().cpu() for t in tensors], None


def share_state(server: _StateServer, get_state: GetState) -> None:
    """Serve this peer's state to joiners from now on: get_state() -> (tensors, metadata), called when
    a joiner asks (e.g. global parameters + outer momentum, {"outer_step": 12}), from a hivemind
    background thread: return tensors that the training loop does not modify meanwhile (copies taken
    at the last outer step). The metadata must be msgpack-serializable (numbers, strings, bytes, lists,
    dicts); it is checked once here."""
    tensors, meta = get_state()
    if not isinstance(meta, dict) or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError("get_state must return (list of tensors, dict)")
    MSGPackSerializer.dumps(meta)  # raises now rather than in hivemind's thread when a joiner asks
    server.get_state = get_state
    server.allow_state_sharing = True


def load_state_from_peers(server: _StateServer, timeout: float) -> tuple[list[torch.Tensor], dict] | None:
    """A joiner's first act: download (tensors, metadata) from a peer that shares its state (hivemind
    tries donors in priority order). None if there is none, it fails, or it sends non-finite tensors."""
    try:
        got = server.load_state_from_peers(wait=True, timeout=timeout)
    except Exception as exc:  # TimeoutError, P2P errors
        log.warning("hivemind: could not load state from peers: %s: %s", type(exc).__name__, exc)
        return None
    if got is None:
        log.info("hivemind: no peer shares its state (a new swarm?)")
        return None
    meta, tensors = got
    if not isinstance(meta, dict) or not isinstance(meta.get("muloco_state"), dict):
        log.warning("hivemind: a peer sent state without muloco metadata: ignored")
        return None
    for i, t in enumerate(tensors):
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            log.warning("hivemind: state tensor %d from a peer is not finite floats: ignored", i)
            return None
    return list(tensors), meta["muloco_state"]
