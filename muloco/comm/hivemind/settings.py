"""Options of the hivemind swarm (backend.hivemind) and the timing of its syncs, derived from their size."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from muloco.errors import ConfigError

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


# ---- settings -------------------------------------------------------------------------------------------


def _default_host_maddrs() -> list[str]:
    return ["/ip4/127.0.0.1/tcp/0"]


@dataclass
class HivemindSettings:
    """Options of the hivemind swarm (the config section backend.hivemind)."""

    run_id: str = "muloco"  # DHT prefix: swarms with different run_ids never mix, even on one DHT
    initial_peers: list[str] = field(default_factory=list)  # multiaddrs to join; empty: start a new swarm
    # Where to listen. Loopback by default (a local swarm); for other machines use "/ip4/0.0.0.0/tcp/PORT".
    host_maddrs: list[str] = field(default_factory=_default_host_maddrs)
    announce_maddrs: list[str] = field(default_factory=list)  # public addresses to announce (behind NAT)
    use_relay: bool = True  # accept relayed connections (libp2p circuit relay; hivemind's default)
    use_auto_relay: bool = False  # behind NAT: find relays among the peers and be reached through them
    identity_path: str | None = None  # private key file: a persistent peer id (created if missing)
    matchmaking_time: float | None = None  # seconds a leader gathers its group; None: derive_timeouts
    averaging_timeout: float | None = None  # seconds for the payload exchange; None: derive_timeouts
    min_group_size: int = 2  # fewer peers than this: no group
    target_group_size: int | None = None  # a group starts as soon as it has this many; None: no limit
    on_no_group: Literal["apply_own", "skip"] = "apply_own"  # no group in time: own contribution, or none
    bandwidth_mbps: float | None = None  # this peer's expected upload (Mbit/s), for derive_timeouts
    max_norm_ratio: float = 10.0  # exclude a contribution whose norm > ratio x the group's (lower) median
    outer_step_ttl: float = 600.0  # seconds a published outer step counts as a live peer's

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", self.run_id):
            raise ConfigError(
                f"backend.hivemind.run_id must be letters, digits, '_' or '-' (it prefixes DHT keys), "
                f"got {self.run_id!r}"
            )
        for name in ("initial_peers", "host_maddrs", "announce_maddrs"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
                raise ConfigError(
                    f"backend.hivemind.{name} must be a list of multiaddr strings, got {value!r}"
                )
        if not self.host_maddrs:
            raise ConfigError("backend.hivemind.host_maddrs must not be empty (e.g. /ip4/0.0.0.0/tcp/0)")
        for name in ("matchmaking_time", "averaging_timeout", "bandwidth_mbps"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and value > 0):
                raise ConfigError(f"backend.hivemind.{name} must be a positive number or null, got {value!r}")
        if not _is_number(self.outer_step_ttl) or self.outer_step_ttl <= 0:
            raise ConfigError(
                f"backend.hivemind.outer_step_ttl must be positive, got {self.outer_step_ttl!r}"
            )
        if not _is_int(self.min_group_size) or self.min_group_size < 2:
            raise ConfigError(
                f"backend.hivemind.min_group_size must be an integer >= 2, got {self.min_group_size!r}"
            )
        if self.target_group_size is not None and not (
            _is_int(self.target_group_size) and self.target_group_size >= self.min_group_size
        ):
            raise ConfigError(
                f"backend.hivemind.target_group_size must be null or an integer >= min_group_size "
                f"({self.min_group_size}), got {self.target_group_size!r}"
            )
        if self.on_no_group not in ("apply_own", "skip"):
            raise ConfigError(
                f"backend.hivemind.on_no_group must be apply_own or skip, got {self.on_no_group!r}"
            )
        if (
            not (_is_number(self.max_norm_ratio) or self.max_norm_ratio == math.inf)
            or self.max_norm_ratio <= 1
        ):
            raise ConfigError(
                f"backend.hivemind.max_norm_ratio must be a number > 1 (inf disables the check), "
                f"got {self.max_norm_ratio!r}"
            )


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
