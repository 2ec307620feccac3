"""`muloco train` as a misbehaving peer, for tests/comm/hivemind/test_security.py.

    python rogue_peer.py --scale S [--fake-progress N] -- muloco train ARGS...

--scale S          every sync it sends S x its pseudogradient (e.g. -4: sign-flipped and scaled)
--fake-progress N  every progress record it publishes claims N fragment syncs (honest peers that believed
                   it would think they are behind and reload state)
--drift-after N... after its N-th sync (each N given) it nudges its own global parameters (as if it had
                   averaged another set of contributions than its group): its next group must notice and
                   realign it
--drift-at-end     the same nudge once its run's syncs are over: the final agreement must realign it
--malformed        every sync it serves payloads that do not decode (one message too many), under their true
                   token: every other member downloads them and must exclude them as malformed
--sleep-per-step S an honest but slow peer: it sleeps S seconds in each of its first --slow-steps inner
                   steps, falls behind the swarm and must catch up by loading its state

Everything else is an ordinary peer: with the run's key it is an insider, without it an intruder that
still knows the run_id and the peers' addresses (and serves its own state to whoever asks).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from muloco import cli
from muloco.comm.hivemind.exchange import FragmentSync
from muloco.comm.hivemind.payloads import payload_token
from muloco.comm.hivemind.progress import ProgressRecords
from muloco.run.replica import Replica
from muloco.sync.swarm import SwarmReducer


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--fake-progress", type=int, default=None)
    parser.add_argument("--drift-after", type=int, nargs="*", default=[])
    parser.add_argument("--drift-at-end", action="store_true")
    parser.add_argument("--malformed", action="store_true")
    parser.add_argument("--sleep-per-step", type=float, default=0.0)
    parser.add_argument("--slow-steps", type=int, default=10**9)
    parser.add_argument("muloco_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()

    honest_pseudogradient, honest_publish = Replica.pseudogradient, ProgressRecords.publish
    honest_after_sync, honest_conclude = SwarmReducer.after_sync, SwarmReducer.conclude
    honest_own_contribution, honest_train_step = FragmentSync.own_contribution, Replica.train_step

    def pseudogradient(self, global_params, indices=None):
        return [d * args.scale for d in honest_pseudogradient(self, global_params, indices)]

    def publish(self, progress, digest=b""):
        honest_publish(self, progress if args.fake_progress is None else args.fake_progress, digest)

    def after_sync(self, state, mean, replicas):
        if state.fragment_syncs in args.drift_after:
            with torch.no_grad():
                state.global_params[0].add_(1e-3)
        honest_after_sync(self, state, mean, replicas)

    def conclude(self, state, replicas):
        if args.drift_at_end:
            with torch.no_grad():
                state.global_params[0].add_(1e-3)
        return honest_conclude(self, state, replicas)

    def own_contribution(self, step, messages):
        own = honest_own_contribution(self, step, messages)
        if own.messages is not None:
            own.messages = [*own.messages, own.messages[-1]]  # decoded as its own, served one too many
            own.token = payload_token(own.messages)
        return own

    slow_steps = [0]

    def train_step(self, *step_args, **kwargs):
        if slow_steps[0] < args.slow_steps:
            slow_steps[0] += 1
            time.sleep(args.sleep_per_step)
        return honest_train_step(self, *step_args, **kwargs)

    Replica.pseudogradient = pseudogradient
    if args.malformed:
        FragmentSync.own_contribution = own_contribution
    if args.sleep_per_step:
        Replica.train_step = train_step
    ProgressRecords.publish = publish
    SwarmReducer.after_sync, SwarmReducer.conclude = after_sync, conclude
    return cli.main([a for a in args.muloco_args if a != "--"])


if __name__ == "__main__":
    sys.exit(main())
