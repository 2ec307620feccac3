"""Training over hivemind (loopback swarms started by `muloco launch --backend hivemind`): peers stay equal,
a killed peer costs the others at most a timeout, a late joiner catches up, another run_id never mixes."""

import json
import time
from pathlib import Path

import psutil
import pytest
import torch
from test_helpers import (
    LineReader,
    assert_same_global_params,
    final_global_params,
    launched_ranks,
    run_muloco,
    start_muloco,
    sync_records,
)

pytest.importorskip("hivemind")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
QS = str(ROOT / "configs/quickstart.yaml")


def common(tmp_path, TINY, total_tokens=6144):
    return [
        *TINY,
        "workers=3",
        "train.batch_tokens=384",
        f"train.total_tokens={total_tokens}",
        "sync.every=3",
        "backend.hivemind.target_group_size=3",  # a full group starts at once (no matchmaking wait)
        "backend.hivemind.averaging_timeout=15",  # 2 busy cores: a download is not given up under load
        f"run.output_dir={tmp_path}",
        "run.name=swarm",
    ]


@pytest.mark.parametrize(
    "compression", [[], ["compression.scheme=statistical", "compression.bits=4"]], ids=["fp32", "stat4"]
)
# Time (~20-40 s a case): a launch of 3 peers, each with its DHT node and p2p daemon, then 6 syncs; fp32
# and 4-bit payloads take different paths through the codec and the receivers' checks.
def test_three_peers_average_every_sync_and_stay_equal(tmp_path, TINY, compression):
    result = run_muloco(
        "launch",
        "--nproc",
        3,
        "--backend",
        "hivemind",
        QS,
        *common(tmp_path, TINY),
        # Every sync a group of all three, as asserted: a peer that reaches matchmaking late on busy cores
        # is waited for (a pair's group is disbanded and retried, up to 2 x matchmaking_time) instead of
        # left alone; the group starts as soon as all three are in.
        "backend.hivemind.min_group_size=3",
        "backend.hivemind.matchmaking_time=10",
        *compression,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    peers = [tmp_path / f"swarm-peer{i}" for i in range(3)]
    for run_dir in peers:
        records = sync_records(run_dir)  # 16 steps: syncs at 3, 6, ..., 15 and 16
        # Under load a member's own averaging can fail after the others' succeeded (CI: a peer's sync at 12
        # met the others' group at 15, its contribution excluded as other_step); it then adopts the swarm's
        # state, moving to the others' step (no outer step of its own: outer_update_norm null), and the
        # sync it skipped has no record. Every sync still a group of all three, and all end equal (below).
        caught_up = [r for r in records if r["outer_update_norm"] is None]
        assert len(records) + len(caught_up) == 6 and records[-1]["step"] == 16, records
        assert all(r["group_size"] == 3 for r in records)
        assert all(r["replicas_left_out"] == 0 for r in records)
    # Every peer decodes the same bytes in the same order; a contribution a member could not download
    # (under heavy load) is realigned at the next sync, or by the final agreement after the last one.
    assert_same_global_params(*peers)
    summaries = [json.loads((p / "summary.json").read_text()) for p in peers]
    assert len({s["final_val_loss"] for s in summaries}) == 1
    assert len({s["final_state_digest"] for s in summaries}) == 1
    assert all(s["bytes_sent_per_worker"] > 0 for s in summaries)


# Time (~35 s): the survivors' bound is the claim: they must wait out one averaging_timeout (5 s) after the
# kill, on top of a 3-peer swarm's start-up.
def test_a_killed_peer_costs_the_others_at_most_a_timeout(tmp_path, TINY):
    overrides = [
        *common(tmp_path, TINY, total_tokens=13824),
        "backend.hivemind.averaging_timeout=5",
    ]  # 12 syncs
    launcher = start_muloco("launch", "--nproc", 3, "--backend", "hivemind", QS, *overrides)
    try:
        # The kill must come after the victim has averaged in a group of all three: on busy cores a peer
        # that starts late can be left out of the first syncs (CI once saw [2, 2] for syncs 1-2), so a kill
        # at a fixed sync would not test the loss of a member. Up to 8 of 12 syncs are allowed for it.
        victim_dir = tmp_path / "swarm-peer2"
        deadline = time.monotonic() + 150
        victim_groups: list[int] = []
        while time.monotonic() < deadline and 3 not in victim_groups and len(victim_groups) < 8:
            if (victim_dir / "metrics.jsonl").exists():
                victim_groups = [r["group_size"] for r in sync_records(victim_dir)]
            time.sleep(0.1)
        assert 3 in victim_groups, f"no group of 3 before the kill: the victim's groups were {victim_groups}"
        victim = launched_ranks(launcher)[2]  # its own children: hivemind's DHT, averagers, p2pd
        victim_tree = victim.children(recursive=True)
        victim.kill()  # SIGKILL
        _, err = launcher.communicate(timeout=180)
    finally:
        launcher.kill()
        launcher.wait(timeout=10)
    assert launcher.returncode != 0 and "rank 2 exited" in err  # the launcher reports the dead peer ...
    time.sleep(1)
    assert not [p for p in victim_tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]  # no orphans
    for i in (0, 1):  # ... and the other two finished every step
        summary = json.loads((tmp_path / f"swarm-peer{i}" / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["outer_steps"] == 12
        groups = [r["group_size"] for r in sync_records(tmp_path / f"swarm-peer{i}")]
        assert 3 in groups and groups[-1] == 2  # averaged with the victim before the kill, only 2 at the end
    assert_same_global_params(tmp_path / "swarm-peer0", tmp_path / "swarm-peer1")


# Time (~47 s): the swarm must still be running when the joiner arrives (20 syncs), and the other run_id's
# 4 syncs each wait out a matchmaking deadline with no group.
def test_a_late_joiner_catches_up_and_another_run_id_never_mixes(tmp_path, TINY):
    overrides = common(tmp_path, TINY, total_tokens=23040)  # 20 syncs; groups of up to 3
    launcher = start_muloco("launch", "--nproc", 2, "--backend", "hivemind", QS, *overrides)
    others = []
    try:
        reader = LineReader(launcher.stderr)
        line = reader.wait_for("join with backend.hivemind.initial_peers=", 60)
        maddrs = line.split("initial_peers=")[1].strip()
        first = tmp_path / "swarm-peer0"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
            (first / "metrics.jsonl").exists() and len(sync_records(first)) >= 2
        ):
            time.sleep(0.1)
        assert launcher.poll() is None, "the swarm finished before the joiner could join"
        join = [*overrides, "backend.kind=hivemind", f"backend.hivemind.initial_peers={maddrs}"]
        others.append(start_muloco("train", QS, *join, "backend.hivemind.peer_index=2", "run.name=joiner"))
        others.append(
            start_muloco(
                "train",
                QS,
                *join,
                "backend.hivemind.run_id=other",
                "backend.hivemind.peer_index=2",
                "run.name=intruder",
                # 4 syncs, all while the swarm runs: each finds no group and waits out its matchmaking
                # deadline, so its 20 syncs took 80 s of the test's 112 s
                "train.total_tokens=4608",
            )
        )
        outputs = [p.communicate(timeout=240) for p in others]
        launcher.wait(timeout=240)
    finally:
        for p in (launcher, *others):
            p.kill()
            p.wait(timeout=10)
    assert launcher.returncode == 0
    for p, (_, err) in zip(others, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    joiner_err = outputs[0][1]
    loaded = [x for x in joiner_err.splitlines() if "hivemind: loaded the state of peer=" in x]
    assert loaded and "step=0 " not in loaded[0]  # it started from the swarm's state, mid-run
    groups = [r["group_size"] for r in sync_records(tmp_path / "joiner")]
    first_averaged = groups.index(3)  # (a sync it started while still behind the others finds no group)
    assert first_averaged <= 2 and all(g == 3 for g in groups[first_averaged:]), groups
    for a, b in zip(final_global_params(tmp_path / "joiner"), final_global_params(first), strict=True):
        assert torch.equal(a, b)
    # The intruder (run_id=other) joined the same DHT but never averaged with the swarm, nor it with it.
    assert all(r["group_size"] == 1 for r in sync_records(tmp_path / "intruder"))
    assert max(r["group_size"] for r in sync_records(first)) == 3


# Time (~35 s): 7 syncs of rounds ~2.4 s (inner steps emulated at speed 0.05: they sleep, so the rounds hold
# under load), one peer at 0.03: each of its windows ends ~0.67 of a round after the others' deadline.
def test_a_straggler_does_not_stall_the_others_and_its_windows_join_the_next_sync(tmp_path, TINY):
    """sync.deadline: adaptive. The others go on without the straggler at the deadline; its window joins
    their next sync (counted late), for which it takes their state and then starts its next window with
    them; a window that misses that one too is lost, counted. All three end with the same model."""
    result = run_muloco(
        "launch",
        "--nproc",
        3,
        "--backend",
        "hivemind",
        QS,
        *common(tmp_path, TINY, total_tokens=384 * 70),  # 7 syncs of H = 10
        "sync.every=10",
        "sync.deadline=adaptive",
        "train.speed=[0.05, 0.05, 0.03]",
        "train.eval_every=100",  # no evaluation inside the rounds: their times vary less
        "backend.hivemind.matchmaking_time=0.5",  # the wait past the deadline for a group that is short
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    straggler = sync_records(tmp_path / "swarm-peer2")
    late = [r for r in straggler if r.get("late")]
    joined = [r for r in late if not r.get("lost_window")]
    # Its late windows joined a later sync's mean (a group of 2 or more), in place of its next window, or
    # found no group there either and were lost after all (counted so); which peers met varies (at the
    # start, before a peer has its deadline, and on busy cores, a full-speed one can be late too), so the
    # records are checked, not the groups' members.
    assert joined and all(r["group_size"] >= 2 for r in joined) and len(straggler) < 7, straggler
    summary = json.loads((tmp_path / "swarm-peer2/summary.json").read_text())
    assert summary["late_contributions"] == len(joined)
    assert summary["lost_steps"] == 10 * summary["lost_windows"]
    assert summary["lost_windows"] == sum(1 for r in straggler if r.get("lost_window"))
    synced = set()  # the syncs held in a group of 2 or more, on time or joined late
    for i in range(3):
        run = tmp_path / f"swarm-peer{i}"
        synced |= {r.get("joined_step", r["step"]) for r in sync_records(run) if r["group_size"] >= 2}
        if i < 2:
            assert json.loads((run / "summary.json").read_text())["absent_contributions"] >= 1
    assert synced >= {40, 50, 60, 70}, synced  # never stalled: past the first rounds, a sync every round
    digests = {json.loads((tmp_path / f"swarm-peer{i}/summary.json").read_text())["final_state_digest"]
               for i in range(3)}  # fmt: skip
    assert len(digests) == 1
