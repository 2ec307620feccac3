"""The swarm's options (backend.hivemind, muloco.config.HivemindBackendConfig) and the timeouts derived from
the sync size (muloco/comm/hivemind/settings.py)."""

import math

import pytest
from pydantic import ValidationError

pytest.importorskip("hivemind")

from muloco.comm.hivemind import derive_timeouts, is_loopback  # noqa: E402
from muloco.config import HivemindBackendConfig, validate  # noqa: E402
from muloco.errors import ConfigError  # noqa: E402


def test_derived_timeouts_follow_the_documented_formula():
    # 10 MB over 100 Mbit/s to 3 others: transfer = 8 x 1e7 x 3 / 1e8 = 2.4 s.
    t = derive_timeouts(10_000_000, bandwidth_mbps=100, group_size=4)
    assert t.averaging_timeout == pytest.approx(max(15.0, 3 * 2.4 + 2))
    assert t.matchmaking_time == pytest.approx(5.0)  # the WAN floor beats 2.4 / 2
    assert t.request_timeout < t.matchmaking_time  # hivemind's deadlock note
    assert t.worst_case == pytest.approx(2 * t.matchmaking_time + t.averaging_timeout)

    slow = derive_timeouts(100_000_000, bandwidth_mbps=10, group_size=8)  # 8 x 1e8 x 7 / 1e7 = 560 s
    assert slow.averaging_timeout == pytest.approx(3 * 560 + 2)
    assert slow.matchmaking_time == 30.0  # capped
    assert slow.request_timeout == 5.0


def test_derived_timeouts_floors_defaults_and_explicit_values():
    tiny = derive_timeouts(1000, loopback=True)
    assert (tiny.matchmaking_time, tiny.averaging_timeout) == (2.0, 5.0)
    assert (derive_timeouts(1000).matchmaking_time, derive_timeouts(1000).averaging_timeout) == (5.0, 15.0)
    # No bandwidth: 100 Mbit/s; no group size: 4.
    assert derive_timeouts(50_000_000) == derive_timeouts(50_000_000, 100.0, 4)
    explicit = derive_timeouts(50_000_000, matchmaking_time=7.0, averaging_timeout=42.0)
    assert (explicit.matchmaking_time, explicit.averaging_timeout) == (7.0, 42.0)
    # More bytes, less bandwidth, bigger groups: never shorter.
    assert derive_timeouts(2e8).averaging_timeout > derive_timeouts(1e8).averaging_timeout
    assert derive_timeouts(1e8, 10).averaging_timeout > derive_timeouts(1e8, 100).averaging_timeout
    assert derive_timeouts(1e8, group_size=16).averaging_timeout > derive_timeouts(1e8).averaging_timeout


def test_is_loopback():
    assert is_loopback(["/ip4/127.0.0.1/tcp/0", "/ip6/::1/tcp/4000"])
    assert not is_loopback(["/ip4/127.0.0.1/tcp/0", "/ip4/0.0.0.0/tcp/31337"])


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"run_id": "a.b"}, "run_id"),
        ({"min_group_size": 1}, "min_group_size"),
        ({"target_group_size": 1}, "target_group_size"),
        ({"on_no_group": "wait"}, "on_no_group"),
        ({"bandwidth_mbps": 0}, "bandwidth_mbps"),
        ({"matchmaking_time": -1.0}, "matchmaking_time"),
        ({"max_norm_ratio": 1.0}, "max_norm_ratio"),
        ({"initial_peers": "/ip4/1.2.3.4/tcp/1"}, "initial_peers"),
        ({"host_maddrs": []}, "host_maddrs"),
        ({"announce_maddrs": [1]}, "announce_maddrs"),
        ({"min_group_size": 4, "target_group_size": 3}, "target_group_size"),
        ({"averaging_timeout": math.inf}, "averaging_timeout"),
        ({"bandwidth_mbps": True}, "bandwidth_mbps"),
        ({"max_norm_ratio": math.nan}, "max_norm_ratio"),
        ({"outer_step_ttl": 0}, "outer_step_ttl"),
    ],
)
def test_settings_name_the_bad_field(overrides, field):
    """backend.hivemind (HivemindBackendConfig) is the swarm's only schema: a bad value fails the config."""
    with pytest.raises(ConfigError, match=f"backend.hivemind.{field}"):
        validate({"backend": {"hivemind": overrides}})
    with pytest.raises(ValidationError, match=field):  # also when a script builds the section itself
        HivemindBackendConfig(**overrides)


def test_settings_accept_what_the_swarm_allows():
    assert HivemindBackendConfig(max_norm_ratio=math.inf).max_norm_ratio == math.inf  # inf: no norm check
    assert HivemindBackendConfig(min_group_size=3, target_group_size=3).target_group_size == 3
