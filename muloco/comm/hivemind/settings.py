"""The timing of the hivemind swarm's syncs, derived from their size, and its constants.

The swarm's options are `muloco.config.HivemindBackendConfig` (the config section backend.hivemind)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# ---- timeouts -------------------------------------------------------------------------------------------

DEFAULT_BANDWIDTH_MBPS = 100.0  # assumed upload when bandwidth_mbps is unset: a modest WAN link
ASSUMED_GROUP_SIZE = 4  # group size in the formula when target_group_size is unset
TRANSFER_SAFETY = 3.0  # x the ideal transfer time: TCP ramp-up, contention, decoding
TRANSFER_SLACK_S = 2.0  # + round trips to open the streams
# Floors (matchmaking_time, averaging_timeout). Loopback: what the tests here need on 2 busy CPU cores.
# WAN: hivemind's default min_matchmaking_time is 5 s; DHT lookups take several round trips.
LOOPBACK_FLOORS_S = (2.0, 5.0)
WAN_FLOORS_S = (5.0, 15.0)
MAX_DERIVED_MATCHMAKING_S = 30.0
MAX_REQUEST_TIMEOUT_S = 5.0
DHT_OP_TIMEOUT_S = 15.0  # a DHT store / get: a few round trips, bounded so that a call never hangs
HANDLE_SLACK_S = 10.0  # AveragingHandle.wait's hard bound past the worst case: a stuck averager


@dataclass(frozen=True)
class SyncTimeouts:
    """The timing of one fragment's sync (seconds), chosen by `derive_timeouts`."""

    sync_bytes: int  # one peer's payloads for this fragment
    matchmaking_time: float  # hivemind's min_matchmaking_time: how long a leader gathers its group
    averaging_timeout: float  # the payload exchange, once the group is formed
    request_timeout: float  # hivemind: a join request's answer, the dummy all-reduce's chunks

    @property
    def group_deadline(self) -> float:
        """A peer looks for a group this long (two matchmaking rounds), then gives up: no group."""
        return 2.0 * self.matchmaking_time

    @property
    def worst_case(self) -> float:
        """The longest a sync takes: look for a group, then exchange payloads."""
        return self.group_deadline + self.averaging_timeout


def derive_timeouts(
    sync_bytes: int,
    bandwidth_mbps: float | None = None,
    group_size: int | None = None,
    loopback: bool = False,
    matchmaking_time: float | None = None,
    averaging_timeout: float | None = None,
) -> SyncTimeouts:
    """Timeouts from the sync size instead of guesses; explicit values win.

    transfer_s        = 8 x sync_bytes x (G - 1) / (bandwidth_mbps x 1e6): one peer uploads its payloads to
                        the G - 1 others (G = group_size, else ASSUMED_GROUP_SIZE; bandwidth else 100 Mbit/s)
    averaging_timeout = max(floor, 3 x transfer_s + 2 s)
    matchmaking_time  = min(max(floor, transfer_s / 2), 30 s): peers that finish their inner steps a little
                        apart should still meet; missing the group wastes a whole round's contribution, so
                        bigger syncs are worth a longer wait
    request_timeout   = min(matchmaking_time / 2, 5 s): hivemind needs it below min_matchmaking_time
    Floors: 2 s / 5 s on loopback, 5 s / 15 s otherwise.
    """
    group = group_size or ASSUMED_GROUP_SIZE
    bandwidth = bandwidth_mbps or DEFAULT_BANDWIDTH_MBPS
    transfer_s = 8.0 * sync_bytes * (group - 1) / (bandwidth * 1e6)
    mm_floor, avg_floor = LOOPBACK_FLOORS_S if loopback else WAN_FLOORS_S
    if averaging_timeout is None:
        averaging_timeout = max(avg_floor, TRANSFER_SAFETY * transfer_s + TRANSFER_SLACK_S)
    if matchmaking_time is None:
        matchmaking_time = min(max(mm_floor, transfer_s / 2.0), MAX_DERIVED_MATCHMAKING_S)
    request_timeout = min(matchmaking_time / 2.0, MAX_REQUEST_TIMEOUT_S)
    return SyncTimeouts(int(sync_bytes), float(matchmaking_time), float(averaging_timeout), request_timeout)


def is_loopback(maddrs: Sequence[str]) -> bool:
    """True when every multiaddr is on 127.0.0.0/8 or ::1 (a local swarm: tighter timeout floors)."""
    return all(str(m).startswith(("/ip4/127.", "/ip6/::1/")) for m in maddrs)


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
