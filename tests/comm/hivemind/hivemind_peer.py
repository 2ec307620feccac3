"""A hivemind swarm peer driven over stdin/stdout, for tests/comm/hivemind/test_swarm.py.

One JSON command per line on stdin, one JSON reply per line on the protocol stream (the original stdout;
fd 1 is pointed at stderr so that library output cannot corrupt the protocol). Commands:

    {"cmd": "open", "settings": {...backend.hivemind}, "shapes": [[8, 16], [16]],
     "compression": null | {"scheme": "statistical", "bits": 4}}  -> {"visible_maddrs", "peer_id", "timeouts"}
    {"cmd": "average", "step": 3, "tensors": [[...], ...], "tamper": null | "nan_payload" | ...,
     "rule": null | ["trimmed_mean", 1]}
                                                                  -> AverageResult as JSON, plus "elapsed_s"
    {"cmd": "share_state", "tensors": [...], "meta": {...counters}} -> {"digest"}
    {"cmd": "load_state", "like": [...], "timeout": 10} -> {"tensors", "meta", "donor"} | null
    {"cmd": "publish_outer_step", "step": 4} / {"cmd": "swarm_outer_step"} -> {"step", "peers"}
    {"cmd": "close"} / {"cmd": "exit"}

tamper="stall_serving" makes the peer hang when others download its payloads (it prints STALL_MARKER to
stderr first), so that a test can SIGKILL it mid-exchange. Any exception is replied as {"error": "..."};
the peer keeps serving.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from collections import OrderedDict

import numpy as np
import torch

from muloco.comm.hivemind import HivemindSwarm, wrap_payload
from muloco.comm.hivemind.exchange import _Contribution
from muloco.comm.hivemind.payloads import payload_token
from muloco.compress import NoCompression, get_compressor
from muloco.compress.wire import Header, assemble
from muloco.config import HivemindBackendConfig

STALL_MARKER = "hivemind_peer: stalled while serving payloads"


def to_tensors(values: list, shapes: list[list[int]]) -> list[torch.Tensor]:
    return [torch.tensor(v, dtype=torch.float32).reshape(s) for v, s in zip(values, shapes)]


def nan_payload(shape: torch.Size) -> bytes:
    """A well-formed fp32 ("none") payload holding a NaN: what a buggy or hostile peer could send (our own
    encoder refuses non-finite tensors, so the receivers' check is the only guard)."""
    values = np.zeros(int(np.prod(shape)), dtype="<f4")
    values[0] = np.nan
    return assemble(
        Header("none", 32, "tensor", 0, torch.float32, tuple(shape), 0, 0, 4 * values.size), [values]
    )


class StalledServing(OrderedDict):
    """The served payloads of a peer that hangs once asked for them (its P2P loop blocks), until killed."""

    def get(self, key, default=None):
        print(STALL_MARKER, file=sys.stderr, flush=True)
        time.sleep(3600)


class Peer:
    def __init__(self) -> None:
        self.swarm: HivemindSwarm | None = None
        self.shapes: list[list[int]] = []

    def open(self, settings: dict, shapes: list[list[int]], compression: dict | None) -> dict:
        comp = get_compressor(**compression) if compression else None
        self.shapes = shapes
        self.swarm = HivemindSwarm(HivemindBackendConfig(**settings), [[torch.Size(s) for s in shapes]], comp)
        t = self.swarm.timeouts[0]
        return {
            "visible_maddrs": self.swarm.visible_maddrs,
            "peer_id": str(self.swarm.peer_id),
            "timeouts": {
                "sync_bytes": t.sync_bytes,
                "matchmaking_time": t.matchmaking_time,
                "averaging_timeout": t.averaging_timeout,
                "worst_case": t.worst_case,
            },
        }

    def average(self, step: int, tensors: list, tamper: str | None = None, rule: list | None = None) -> dict:
        t0 = time.monotonic()
        combine = (rule[0], int(rule[1])) if rule else ("mean", 1)  # (sync.aggregate, sync.trim)
        if tamper == "stall_serving":
            self.swarm.payloads.served[0] = StalledServing(self.swarm.payloads.served[0])
        if tamper == "nan_payload":
            # Skips the sender's own checks (start_average would withhold it): only receivers can catch it.
            payloads = [nan_payload(torch.Size(s)) for s in self.shapes]
            messages = [wrap_payload(p) for p in payloads]
            decoded = [NoCompression().decode(p) for p in payloads]
            own = _Contribution(step, messages, decoded, None, payload_token(messages), combine)
            handle = self.swarm.fragments[0].launch(own, 0.0)
        else:
            handle = self.swarm.start_average(0, to_tensors(tensors, self.shapes), step, combine)
        r = handle.wait()
        return {
            "mean": None if r.mean is None else [t.reshape(-1).tolist() for t in r.mean],
            "group_size": r.group_size,
            "excluded": r.excluded,
            "averaged": r.averaged,
            "excluded_reasons": r.excluded_reasons,
            "elapsed_s": time.monotonic() - t0,
        }

    def share_state(self, tensors: list, meta: dict) -> dict:
        digest = self.swarm.share_state([torch.tensor(v, dtype=torch.float32) for v in tensors], meta)
        return {"digest": digest.hex()}

    def load_state(self, like: list, timeout: float) -> dict | None:
        got = self.swarm.load_state_from_peers([torch.tensor(v, dtype=torch.float32) for v in like], timeout)
        if got is None:
            return None
        return {"tensors": [t.tolist() for t in got[0]], "meta": got[1], "donor": str(got[2])}

    def publish_outer_step(self, step: int) -> dict:
        self.swarm.publish_outer_step(step)
        return {}

    def swarm_outer_step(self) -> dict:
        return {"step": self.swarm.swarm_outer_step(), "peers": self.swarm.peer_outer_steps()}

    def close(self) -> dict:
        if self.swarm is not None:
            self.swarm.close()
            self.swarm = None
        return {}


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed from here on goes to stderr
    sys.stdout = sys.stderr
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")  # key=value logs
    peer = Peer()
    commands = {
        "open": peer.open,
        "average": peer.average,
        "share_state": peer.share_state,
        "load_state": peer.load_state,
        "publish_outer_step": peer.publish_outer_step,
        "swarm_outer_step": peer.swarm_outer_step,
        "close": peer.close,
    }
    for line in sys.stdin:
        command = json.loads(line)
        name = command.pop("cmd")
        if name == "exit":
            break
        try:
            reply = commands[name](**command)
        except Exception as exc:
            traceback.print_exc()
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        protocol.write(json.dumps(reply) + "\n")
    peer.close()


if __name__ == "__main__":
    main()
