"""Swarm membership (muloco/comm/hivemind/auth.py) and the records it guards, in one process: key files,
tags, the payload and state handlers, progress records and group metadata. Malformed and oversized records
(fuzzed) are rejected, never raised. Real swarms with an intruder: test_security.py (slow)."""

import asyncio
import os
import random

import pytest
import torch

pytest.importorskip("hivemind")

from hivemind.dht.routing import DHTID  # noqa: E402
from hivemind.dht.validation import DHTRecord  # noqa: E402
from hivemind.p2p import P2PContext, PeerID  # noqa: E402
from hivemind.proto import averaging_pb2  # noqa: E402
from hivemind.utils.serializer import MSGPackSerializer  # noqa: E402
from hivemind.utils.timed_storage import get_dht_time  # noqa: E402
from test_helpers import run_muloco, run_muloco_here  # noqa: E402

from muloco.comm.digest import state_digest  # noqa: E402
from muloco.comm.hivemind.auth import SwarmAuth, read_key, write_key  # noqa: E402
from muloco.comm.hivemind.exchange import FragmentSync, _Contribution  # noqa: E402
from muloco.comm.hivemind.progress import SwarmRecordValidator, record_problem  # noqa: E402
from muloco.comm.hivemind.state_sharing import StateServer, _checked_state  # noqa: E402
from muloco.comm.hivemind.transfer import PayloadServer  # noqa: E402
from muloco.config import HivemindBackendConfig  # noqa: E402
from muloco.errors import ConfigError  # noqa: E402

KEY, OTHER_KEY = bytes(range(32)), bytes(32)
ALICE, BOB, MALLORY = (PeerID(bytes([0x12, 0x20, i]) + bytes(32)) for i in (1, 2, 3))
COUNTERS = {"step": 6, "outer_steps": 3, "fragment_syncs": 3}


def served(generator) -> list:
    """Everything an async handler streams."""

    async def collect():
        return [reply async for reply in generator]

    return asyncio.run(collect())


def context(remote: PeerID, local: PeerID = ALICE) -> P2PContext:
    return P2PContext(handle_name="test", local_id=local, remote_id=remote)


# ---- key files and the CLI --------------------------------------------------------------------------


def test_a_new_key_is_private_random_and_never_overwritten(tmp_path):
    path = str(tmp_path / "swarm.key")
    write_key(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert len(read_key(path)) == 32
    with pytest.raises(ConfigError, match="already exists"):
        write_key(path)
    write_key(str(tmp_path / "second.key"))
    assert read_key(str(tmp_path / "second.key")) != read_key(path)


@pytest.mark.parametrize(
    ("mode", "content", "message"),
    [
        (0o644, None, "accessible by other users .*chmod 600"),
        (0o600, "not hex\n", "does not hold a 64-hex-digit key"),
        (0o600, "ab" * 16 + "\n", "does not hold a 64-hex-digit key"),
    ],
)
def test_bad_key_files_are_one_line_config_errors(tmp_path, mode, content, message):
    path = tmp_path / "swarm.key"
    write_key(str(path))
    if content is not None:
        path.write_text(content)
    os.chmod(path, mode)
    with pytest.raises(ConfigError, match=message):
        read_key(str(path))
    with pytest.raises(ConfigError, match="does not exist; create one with `muloco swarm-key"):
        read_key(str(tmp_path / "missing.key"))


def test_the_cli_writes_a_key_and_refuses_to_overwrite_it(tmp_path):
    first = run_muloco_here("swarm-key", tmp_path / "k")
    assert first.returncode == 0 and os.stat(tmp_path / "k").st_mode & 0o777 == 0o600
    again = run_muloco_here("swarm-key", tmp_path / "k")
    assert again.returncode == 2 and again.stderr.strip().count("\n") == 0
    assert "already exists" in again.stderr


@pytest.mark.slow  # processes of their own (CLI runs or ranks): 5-17 s on 2 cores
def test_a_train_run_with_a_bad_key_file_exits_2_in_one_line(tmp_path):
    key = tmp_path / "k"
    key.write_text("00" * 32)
    key.chmod(0o644)
    overrides = ["backend.kind=hivemind", f"backend.hivemind.auth.key_file={key}", "train.total_tokens=4096"]
    result = run_muloco("train", "configs/pico.yaml", f"run.output_dir={tmp_path}", *overrides)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("muloco: error: backend.hivemind.auth.key_file")
    assert "chmod 600" in result.stderr


def test_a_peer_list_needs_a_key_and_a_stable_identity():
    with pytest.raises(ValueError, match="allowed_peers needs auth.key_file and .*identity_path"):
        HivemindBackendConfig(auth={"key_file": "k", "allowed_peers": ["Qm"]})
    HivemindBackendConfig(auth={"key_file": "k", "allowed_peers": ["Qm"]}, identity_path="id")


# ---- tags -------------------------------------------------------------------------------------------


def test_a_tag_binds_the_key_the_run_the_kind_and_every_field(caplog):
    auth = SwarmAuth("run", KEY)
    tag = auth.tag("progress", ALICE, 3, b"digest")
    assert len(tag) == 32 and auth.check(ALICE, "progress", tag, ALICE, 3, b"digest") is None
    assert auth.check(ALICE, "progress", tag, ALICE, 4, b"digest") is not None  # another step
    assert auth.check(BOB, "progress", tag, BOB, 3, b"digest") is not None  # another sender
    assert SwarmAuth("run", OTHER_KEY).check(ALICE, "progress", tag, ALICE, 3, b"digest") is not None
    assert SwarmAuth("other-run", KEY).check(ALICE, "progress", tag, ALICE, 3, b"digest") is not None
    assert auth.check(ALICE, "state", tag, ALICE, 3, b"digest") is not None  # another kind
    for _ in range(3):
        auth.check(MALLORY, "progress", b"forged", MALLORY, 1, b"")
    assert sum(str(MALLORY) in r.message for r in caplog.records) == 1  # logged once per peer and kind


def test_without_a_key_everyone_is_admitted_and_tags_are_empty():
    auth = SwarmAuth("run")
    assert auth.tag("progress", ALICE, 1) == b"" and auth.check(MALLORY, "progress", b"", MALLORY, 1) is None


def test_a_closed_swarm_admits_only_the_listed_peers():
    auth = SwarmAuth("run", KEY, [str(ALICE), str(BOB)])
    assert auth.check(BOB, "progress", auth.tag("progress", BOB), BOB) is None
    reason = auth.check(MALLORY, "progress", auth.tag("progress", MALLORY), MALLORY)  # right key, not listed
    assert reason == "not in backend.hivemind.auth.allowed_peers"


# ---- payloads, state, progress, group metadata ------------------------------------------------------


def test_payloads_are_served_only_to_peers_that_hold_the_key():
    auth = SwarmAuth("run", KEY)
    server = PayloadServer(1, auth)
    token = bytes(range(16))
    server.offer(0, token, [averaging_pb2.DownloadData().tensor_part])
    good = token + auth.tag("payload request", 0, BOB, token)
    assert len(served(server.serve(0, averaging_pb2.DownloadData(metadata=good), context(BOB)))) == 1
    forged = token + SwarmAuth("run", OTHER_KEY).tag("payload request", 0, MALLORY, token)
    assert served(server.serve(0, averaging_pb2.DownloadData(metadata=forged), context(MALLORY))) == []
    replayed = good  # Bob's request sent by Mallory: the tag names Bob, libp2p says Mallory
    assert served(server.serve(0, averaging_pb2.DownloadData(metadata=replayed), context(MALLORY))) == []


def state_tensors() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(4, 3), torch.randn(3), torch.zeros(4, 3), torch.zeros(3)]


def fetch_state(server: StateServer, requester: PeerID, auth: SwarmAuth):
    replies = served(
        server.serve(
            averaging_pb2.DownloadData(metadata=auth.tag("state request", requester)), context(requester)
        )
    )
    if not replies:
        return [], b""
    from hivemind.utils.streaming import combine_from_streaming

    header, messages = (
        bytes(replies[0].metadata),
        [combine_from_streaming([r.tensor_part]) for r in replies[1:]],
    )
    return messages, header


def test_the_state_travels_only_between_key_holders_and_exactly_as_tagged():
    auth, tensors = SwarmAuth("run", KEY), state_tensors()
    donor = StateServer(auth, ALICE)
    digest = donor.offer(tensors, COUNTERS)
    assert digest == state_digest(tensors)
    messages, header = fetch_state(donor, BOB, auth)
    got = _checked_state(auth, ALICE, BOB, header, messages, tensors)
    assert not isinstance(got, str), got
    assert got[1] == COUNTERS and all(torch.equal(a, b) for a, b in zip(got[0], tensors, strict=True))

    outsider = SwarmAuth("run", OTHER_KEY)
    assert fetch_state(donor, MALLORY, outsider) == ([], b"")  # no state for a requester without the key
    bogus = StateServer(outsider, MALLORY)  # an intruder serving a state of its own
    bogus.offer([t + 1 for t in tensors], COUNTERS)
    messages, header = fetch_state(bogus, BOB, outsider)
    assert "not authenticated" in _checked_state(auth, MALLORY, BOB, header, messages, tensors)

    messages, header = fetch_state(donor, BOB, auth)
    messages[0].buffer = bytes(len(messages[0].buffer))  # the tensors altered on the way
    assert _checked_state(auth, ALICE, BOB, header, messages, tensors) == (
        "the tensors do not match the digest it tagged"
    )
    messages, header = fetch_state(donor, BOB, auth)
    wrong_shape = [torch.zeros(5, 3), *tensors[1:]]
    assert "expected torch.float32 (5, 3)" in _checked_state(auth, ALICE, BOB, header, messages, wrong_shape)


def test_fuzzed_state_headers_and_tensors_are_rejected_never_raised():
    auth, tensors = SwarmAuth("run", KEY), state_tensors()
    donor = StateServer(auth, ALICE)
    donor.offer(tensors, COUNTERS)
    messages, header = fetch_state(donor, BOB, auth)
    rng = random.Random(0)
    headers = [b"", b"\x00", rng.randbytes(64), rng.randbytes(5000), MSGPackSerializer.dumps({"meta": 1})]
    headers += [MSGPackSerializer.dumps({"meta": b"x", "digest": 3, "tag": None})]
    for _ in range(200):
        h = bytearray(header)
        for _ in range(rng.randint(1, 4)):
            h[rng.randrange(len(h))] = rng.randrange(256)
        headers.append(bytes(h))
    for h in headers:
        assert isinstance(_checked_state(auth, ALICE, BOB, h, messages, tensors), str)
    for _ in range(100):
        broken = [type(m).FromString(m.SerializeToString()) for m in messages]
        victim = rng.randrange(len(broken))
        broken[victim].buffer = rng.randbytes(rng.randint(0, 80))
        if rng.random() < 0.5:
            broken[victim].dtype = rng.choice(["float32", "int64", "garbage", ""])
        assert isinstance(_checked_state(auth, ALICE, BOB, header, broken, tensors), str)


def test_malformed_forged_replayed_and_oversized_progress_records_are_ignored():
    auth, digest, expires = SwarmAuth("run", KEY), bytes(16), 1000.0
    assert (
        record_problem(auth, BOB, [3, digest, auth.tag("progress", BOB, 3, digest, expires)], expires) is None
    )
    rng = random.Random(1)
    bad_values = [
        None,
        3,
        "3",
        [3],
        [3, digest],
        [3, digest, b"tag"],
        [True, digest, b""],
        [3, b"short", b""],
        [3, digest, auth.tag("progress", BOB, 4, digest, expires)],  # the tag of another step
        [3, digest, auth.tag("progress", BOB, 3, digest, expires - 600)],  # an old record, re-stored
        [
            10**6,
            digest,
            SwarmAuth("run", OTHER_KEY).tag("progress", BOB, 10**6, digest, expires),
        ],  # an intruder
        [2**63, digest, b""],
        [-1, digest, b""],
        [2**70, digest, b""],  # beyond int64: rejected, not raised
        {"progress": 3},
        [3, rng.randbytes(1 << 20), b""],
        [3.5, digest, b""],
    ]
    bad_values += [[rng.randint(-9, 9), rng.randbytes(16), rng.randbytes(32)] for _ in range(50)]
    for value in bad_values:
        assert record_problem(auth, BOB, value, expires) is not None


def test_the_dht_itself_refuses_unkeyed_forged_and_far_future_records():
    """With the key every DHT record carries a tag (appended by the storing node, stripped before hivemind
    reads it): a peer without the key can neither publish progress nor declare itself for matchmaking.
    With or without a key, a progress record may not expire in 10^300 s (it would hide a peer's real ones:
    the DHT keeps a subkey's latest-expiring value)."""
    auth = SwarmAuth("run", KEY)
    validator = SwarmRecordValidator(auth, "run", ttl=60.0)
    progress_key = DHTID.generate(source="run_outer_step").to_bytes()
    subkey = MSGPackSerializer.dumps(BOB.to_bytes())
    soon, far = get_dht_time() + 60.0, 1e300

    def record(value, expiration, key=progress_key, signer=validator):
        raw = DHTRecord(key, subkey, MSGPackSerializer.dumps(value), expiration)
        return DHTRecord(key, subkey, signer.sign_value(raw), expiration)

    good = [5, bytes(16), auth.tag("progress", BOB, 5, bytes(16), soon)]
    signed = record(good, soon)
    assert validator.validate(signed)
    assert MSGPackSerializer.loads(validator.strip_value(signed)) == good
    assert not validator.validate(DHTRecord(progress_key, subkey, signed.value, soon + 1.0))  # re-dated
    assert not validator.validate(record([5, bytes(16), auth.tag("progress", BOB, 5, bytes(16), far)], far))
    outsider = SwarmRecordValidator(SwarmAuth("run"), "run", ttl=60.0)  # a peer without the key
    assert not validator.validate(record(good, soon, signer=outsider))
    assert not validator.validate(record(True, soon, key=b"matchmaking key", signer=outsider))  # a leader
    assert validator.validate(record(True, soon, key=b"matchmaking key"))  # a key holder's declaration
    assert not validator.validate(DHTRecord(progress_key, b"\xc1", b"\xc1" * 40, soon))  # not even msgpack
    # An open swarm (no key): no tags, but the progress records' shape and expiration still checked.
    open_validator = SwarmRecordValidator(SwarmAuth("run"), "run", ttl=60.0)
    plain = [5, bytes(16), b""]
    assert open_validator.validate(record(plain, soon, signer=open_validator))
    assert not open_validator.validate(record(plain, far, signer=open_validator))
    assert not open_validator.validate(record([2**63, bytes(16), b""], soon, signer=open_validator))


def fragment_sync(auth: SwarmAuth, me: PeerID) -> FragmentSync:
    return FragmentSync(
        fragment=0,
        shapes=[torch.Size([2])],
        codecs=[],
        timeouts=None,
        settings=None,
        peer_id=me,
        auth=auth,
        averager=None,
        payloads=None,
        runtime=None,
    )


def metadata(auth: SwarmAuth, peer: PeerID, step: int = 4, token: bytes = bytes(16), rule=("mean", 1)):
    digest, fields = b"d" * 16, (0, step, peer, token, b"d" * 16, *rule)
    tag = auth.tag("group metadata", *fields)
    return {"step": step, "token": token, "digest": digest, "rule": list(rule), "tag": tag}


def test_a_member_without_the_key_is_excluded_before_any_download():
    auth = SwarmAuth("run", KEY)
    sync = fragment_sync(auth, ALICE)
    own = _Contribution(4, [], [], None, bytes(16), digest=b"d" * 16)
    members = {
        ALICE: metadata(auth, ALICE),
        BOB: metadata(auth, BOB),
        MALLORY: metadata(SwarmAuth("run", OTHER_KEY), MALLORY),  # same run_id, another key
    }
    forged = metadata(auth, BOB)  # Bob's authentic metadata, replayed by Mallory under its own id
    members[PeerID(b"\x12\x20\x08" + bytes(32))] = metadata(
        auth, PeerID(b"\x12\x20\x08" + bytes(32)), rule=("median", 1)
    )
    tokens, reasons, digests = sync._tokens_to_fetch(
        own, {**members, PeerID(b"\x12\x20\x09" + bytes(32)): forged}
    )
    assert set(tokens) == {BOB}
    assert reasons[str(MALLORY)].startswith("not authenticated") and len(reasons) == 3
    assert any("combines by sync.aggregate/trim ['median', 1]" in r for r in reasons.values())  # another rule
    assert set(digests) == {str(ALICE), str(BOB)}  # only authenticated members count for consistency
    fuzz = random.Random(2)
    for _ in range(100):
        values = [None, 1, 2**63, -(2**70), 1.5, b"x", "s", [1], {}]
        meta = {k: fuzz.choice(values) for k in ("step", "token", "digest", "tag")}
        _, why, _ = sync._tokens_to_fetch(own, {MALLORY: meta})
        assert why[str(MALLORY)]  # excluded, with a reason; never raised
