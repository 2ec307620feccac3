"""`muloco train` as a misbehaving peer, for tests/comm/hivemind/test_security.py.

    python rogue_peer.py --scale S [--fake-progress N] -- muloco train ARGS...

--scale S          every sync it sends S x its pseudogradient (e.g. -4: sign-flipped and scaled)
--fake-progress N  every progress record it publishes claims N fragment syncs (honest peers that believed
                   it would think they are behind and reload state)
--drift-after N    after its N-th sync it nudges its own global parameters (as if it had averaged another
                   set of contributions than its group): its next group must notice and realign it

Everything else is an ordinary peer: with the run's key it is an insider, without it an intruder that
still knows the run_id and the peers' addresses (and serves its own state to whoever asks).
"""

from __future__ import annotations

import argparse
import sys

import torch

from muloco import cli
from muloco.comm.hivemind.progress import ProgressRecords
from muloco.run.replica import Replica
from muloco.sync.swarm import SwarmReducer


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--fake-progress", type=int, default=None)
    parser.add_argument("--drift-after", type=int, default=None)
    parser.add_argument("muloco_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()

    honest_pseudogradient, honest_publish = Replica.pseudogradient, ProgressRecords.publish
    honest_after_sync = SwarmReducer.after_sync

    def pseudogradient(self, global_params, indices=None):
        return [d * args.scale for d in honest_pseudogradient(self, global_params, indices)]

    def publish(self, progress, digest=b""):
        honest_publish(self, progress if args.fake_progress is None else args.fake_progress, digest)

    def after_sync(self, state, mean, replicas):
        if state.fragment_syncs == args.drift_after:
            with torch.no_grad():
                state.global_params[0].add_(1e-3)
        honest_after_sync(self, state, mean, replicas)

    Replica.pseudogradient = pseudogradient
    ProgressRecords.publish = publish
    SwarmReducer.after_sync = after_sync
    return cli.main([a for a in args.muloco_args if a != "--"])


if __name__ == "__main__":
    sys.exit(main())
