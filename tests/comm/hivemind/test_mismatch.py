"""The diagnostics for payloads that do not match their token (muloco/comm/hivemind/mismatch.py): each kind
of difference is named, and the dump that MULOCO_PAYLOAD_DUMP turns on round-trips."""

import pytest

pytest.importorskip("hivemind")

from muloco.comm.hivemind import mismatch, wrap_payload  # noqa: E402
from muloco.comm.hivemind.auth import SwarmAuth  # noqa: E402
from muloco.comm.hivemind.payloads import payload_token  # noqa: E402
from muloco.comm.hivemind.transfer import PayloadServer  # noqa: E402

SENT = [b"alpha-0123", b"beta-45678", b"gamma-9"]


@pytest.mark.parametrize(
    "received, kind",
    [
        (list(SENT), "identical"),
        ([b"alpha-0123", b"beta-4"], "truncated"),
        ([b"beta-45678", b"alpha-0123", b"gamma-9"], "reordered"),
        ([b"alpha-0123", b"alpha-0123", b"gamma-9"], "duplicated"),
        ([b"another peer's"], "other_payload"),
        ([b"alpha-0123", b"beta-45679", b"gamma-8"], "bytes_flipped (2 of 27)"),
        ([b"something else entirely"], "different"),
    ],
)
def test_each_kind_of_difference_is_named(received, kind):
    assert mismatch.classify(received, SENT, {"other": [b"another peer's"]}) == kind


def test_a_payload_the_server_did_not_keep_is_unknown():
    assert mismatch.classify(SENT, None, {}) == "unknown"


def test_the_dump_keeps_what_a_server_offers_under_its_token(tmp_path, monkeypatch):
    messages = [wrap_payload(b) for b in SENT]
    token = payload_token(messages)
    PayloadServer(1, SwarmAuth("run")).offer(0, token, messages)  # off: nothing written
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv(mismatch.DUMP_ENV, str(tmp_path))
    PayloadServer(1, SwarmAuth("run")).offer(0, token, messages)
    blob = (tmp_path / "served" / f"{token.hex()}.bin").read_bytes()
    assert mismatch.decode(blob) == SENT and mismatch.encode(SENT) == blob
