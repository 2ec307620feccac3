"""Matchmaking that admits only authenticated peers (backend.hivemind.auth; auth.py).

A group leader refuses a join request whose gathered metadata fails the swarm key, and a follower leaves a
group whose leader's metadata fails it (it then asks the next potential leader), so a peer without the key
cannot take a place in an honest peer's group, nor gather honest peers into one of its own. Its metadata
would be excluded from the combine anyway (exchange.py); refusing it here keeps the groups themselves, and
so the honest peers' results, what they would be without it.

hivemind 1.1.12 builds its Matchmaking inside the averager's own process from a module-level name;
`install` points that name at `GuardedMatchmaking` (which behaves as hivemind's without an `admit`), and
the averager passes `admit` through its matchmaking_kwargs.
"""

from __future__ import annotations

from collections.abc import Callable

import hivemind.averaging.averager as hivemind_averager
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

Admit = Callable[[PeerID, bytes], bool]  # (peer id, its data_for_gather) -> may it be in our group


class GuardedMatchmaking(Matchmaking):
    def __init__(self, *args, admit: Admit | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.admit = admit

    def _check_reasons_to_reject(self, request, context):
        reason = super()._check_reasons_to_reject(request, context)
        if reason is None and self.admit is not None and not self.admit(context.remote_id, request.gather):
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        return reason

    async def follower_assemble_group(self, leader: PeerID, msg: averaging_pb2.MessageFromLeader):
        if self.admit is not None:
            ordered = [PeerID(p) for p in msg.ordered_peer_ids]
            malformed = leader not in ordered or len(ordered) != len(msg.gathered)
            if malformed or not self.admit(leader, msg.gathered[ordered.index(leader)]):
                return None  # not its group: hivemind's search goes on with the next potential leader
        return await super().follower_assemble_group(leader, msg)


def install() -> None:
    """Have hivemind's averagers build GuardedMatchmaking (in the processes they fork from now on)."""
    hivemind_averager.Matchmaking = GuardedMatchmaking


def user_metadata(data_for_gather: bytes) -> object:
    """The metadata a peer passed to averager.step(gather=...), from hivemind's wrapper
    [bandwidth, mode, serialized metadata]; None if malformed."""
    try:
        wrapper = MSGPackSerializer.loads(data_for_gather)
        return MSGPackSerializer.loads(wrapper[2])
    except Exception:
        return None
