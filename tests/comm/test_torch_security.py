"""torch.distributed has no authentication: `muloco train` says so once when MASTER_ADDR is a global
address (muloco/comm/torch_dist.py, docs/security.md)."""

import logging

import pytest

from muloco.comm.torch_dist import exposed_address, warn_if_exposed


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1", "localhost", "::1", "10.1.2.3", "172.16.0.9", "192.168.1.1", "198.18.0.5", "100.100.1.1"]
    + ["169.254.1.1", "fd00::1"],
)
def test_loopback_private_and_shared_addresses_are_not_exposed(host):
    assert exposed_address(host) is None


@pytest.mark.parametrize("host", ["8.8.8.8", "203.0.114.7", "2001:4860::8888"])
def test_global_addresses_are_exposed(host):
    assert exposed_address(host) == host


def test_the_warning_names_the_address_and_the_fix_once(caplog):
    with caplog.at_level(logging.WARNING, logger="muloco"):
        warn_if_exposed("127.0.0.1")
        assert not caplog.records
        warn_if_exposed("8.8.8.8")
    (record,) = caplog.records
    assert "MASTER_ADDR=8.8.8.8" in record.message and "neither authenticated nor encrypted" in record.message
    assert "private network or a tunnel" in record.message
