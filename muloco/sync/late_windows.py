"""A swarm's rounds under sync.deadline: adaptive (docs/heterogeneous.md, "A deadline for stragglers"): how
long a worker's group waits for the others, and what becomes of a window that arrives late. `LateWindows`
is a part of `SwarmReducer` (swarm.py), which supplies the swarm, the searches (`_average`), the mean
(`_mean_of`) and the state loads (`_load`, `_serve`, `_swarm_progress`).

On time: the group waits until the deadline (deadline.py). Late (the others synced the round without this
worker): the window joins their next sync, after the worker takes the state they went on from. More than a
sync late, or late for the run's last sync: lost, counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from muloco.sync.reduce import Contribution, Mean, PendingMean, SharedState

LATE_POLL_S = 0.25  # how often a worker without a group looks whether the others went on
LATE_LOAD_WAIT_S = 10.0  # how long a late worker looks for the state the others went on from


class LateWindows:
    """The deadline's half of SwarmReducer: its `membership` (a RoundDeadline), `every` (H), `total_steps`,
    `_round_started`, `_progress`, `_state` and `_replicas` are SwarmReducer's fields."""

    def _start_with_deadline(self, c: Contribution, me: str) -> PendingMean:
        """On time: average at this step, the group waiting for the others until the deadline. Late (the
        swarm synced this round without this peer; seen now, or when its own search finds no group): the
        window joins the others' next sync. More than a sync late: lost, counted."""
        late = self._lateness()
        if late > 1 or (late == 1 and self._next_step(c.step) is None):
            return self._lost()
        deadline, elapsed = self.membership.seconds(), time.monotonic() - self._round_started
        if late == 1:
            handle = JoinedLate(*self._join_next(c))
        else:
            self.membership.observe(elapsed)  # on time: one more round's time
            wait_s = max(0.0, deadline - elapsed) if deadline is not None else 0.0
            first = self._average(c, c.step, self.digest, wait_s)
            handle = JoinedLate(first, self.digest, retry=lambda: self._retry_late(c))
        finish = self._mean_of(c, self.digest, me, handle)

        def finish_and_begin(result) -> Mean:
            # The next round begins when the sync's exchange ends: at once for all its members, so their
            # deadlines share a start (the outer step and the progress records that follow vary by peer).
            self._round_started = time.monotonic()
            mean = finish(result)
            # In the sync record: how the round went against its deadline (why a window was late)
            mean.details["round_s"] = round(elapsed, 3)
            mean.details["deadline_s"] = round(deadline, 3) if deadline is not None else None
            return mean

        return PendingMean(handle, finish_and_begin)

    def _lateness(self) -> int:
        """How many syncs the swarm went on without this peer this round (0: on time)."""
        return self._swarm_progress(self._progress) - self._progress

    def _next_step(self, step: int) -> int | None:
        """The step of the sync after the one at `step`: H steps on, or the run's last; None after it."""
        if self.total_steps is None:
            return step + self.every
        return min(step + self.every, self.total_steps) if step < self.total_steps else None

    def _join_next(self, c: Contribution, can_take_state: bool = True) -> tuple[Any, bytes, int]:
        """This window into the others' next sync. While they train for it, this peer takes the state
        they went on from (the global parameters after the sync it missed, its step counter a window on:
        it skips the window it has no time for), so it applies that sync's mean as they do and starts the
        next round with them. If it cannot (no donor in time, or its sync in flight), it announces no
        state digest and takes the group's after the sync (_realign). It looks for their group in short
        searches, again and again, until it is in one or they went on once more, rather than one search
        scheduled seconds ahead (hivemind's scheduled_time): after such a search, seen here, every peer's
        next search ran tens of seconds past its timeout. The others begin the sync at most a deadline
        after their round's start, which was before now. Returns the sync's handle, the digest announced
        and the sync's step."""
        self.membership.late_contributions += 1
        deadline = self.membership.seconds()
        bound = time.monotonic() + 2 * (deadline if deadline is not None else self._elapsed())
        digest = self.digest if can_take_state and self._take_swarm_state() else b""
        step = self._next_step(c.step)

        def again() -> bool:
            return time.monotonic() < bound and self._lateness() == 1

        search = _SearchAgain(lambda: self._average(c, step, digest, late=True), again, self._late_missed)
        return search, digest, step

    def _late_missed(self) -> None:
        """A late window that found no group for the next sync either: lost after all."""
        self.membership.late_contributions -= 1
        self._count_lost()

    def _elapsed(self) -> float:
        return time.monotonic() - self._round_started

    def _take_swarm_state(self) -> bool:
        state = self._state
        if state is None or not state.can_adopt():
            return False
        progress = self._progress + 1  # the others' after the sync this peer missed
        took = self._load(
            state, self._replicas, None, progress, timeout=LATE_LOAD_WAIT_S, skip_steps=self.every
        )
        if took:
            self._serve(state)
        return took

    def _retry_late(self, c: Contribution):
        """After a search that found no group: the next sync's handle if the others went on without this
        peer meanwhile, else None. They publish their progress only once their exchange is done (at most
        the averaging timeout): a search that ends first (e.g. this peer stalled inside it) looks again
        until then."""
        timeouts = getattr(self.swarm, "timeouts", None)
        settle = time.monotonic() + (timeouts[c.fragment].averaging_timeout if timeouts else 0.0)
        while (late := self._lateness()) == 0 and time.monotonic() < settle:
            time.sleep(LATE_POLL_S)
        if late == 1 and self._next_step(c.step) is not None:
            return self._join_next(c, can_take_state=False)  # its sync is in flight: it takes it after
        if late >= 1:
            self._count_lost()
            return LOST
        return None

    def _lost(self) -> PendingMean:
        """A window more than a sync late, or late for the run's last sync: left out, counted; the peer
        takes the swarm's state after the sync (or the final agreement's)."""
        self._count_lost()
        return PendingMean.completed(Mean(None, 0, 0, details={"group_size": 1, "lost_window": True}))

    def _count_lost(self) -> None:
        self.membership.lost_windows += 1
        self.membership.lost_steps += self.every

    def _begin_round(self, state: SharedState) -> None:
        self._progress = state.fragment_syncs
        if self._round_started is None:  # the first round: from the start of training
            self._round_started = time.monotonic()


LOST = "lost"  # _retry_late: the swarm went on without this window too far for it to join: lost, counted


class JoinedLate:
    """A sync under sync.deadline: its first search's handle, then, if that found no group because the
    swarm went on without this peer, the others' next sync's (retry() gives it and the digest announced
    there, None, or LOST). `late`, `lost` and `digest` tell the mean which it was."""

    def __init__(
        self, handle, digest: bytes, step: int | None = None, retry: Callable[[], Any] | None = None
    ) -> None:
        self.handle, self.digest, self.step, self.retry, self.late = (
            handle,
            digest,
            step,
            retry,
            retry is None,
        )
        self.lost = False

    def done(self) -> bool:
        if not self.handle.done():
            return False
        return self.retry is None or self.handle.wait().averaged  # else wait() searches again

    def wait(self):
        result = self.handle.wait()
        if self.retry is not None and not result.averaged:
            second, self.retry = self.retry(), None
            self.lost = second is LOST
            if second is not None and not self.lost:
                (self.handle, self.digest, self.step), self.late = second, True
                result = self.handle.wait()
        self.lost = self.lost or (self.late and not result.averaged)  # no group at the next sync either
        return result


class _SearchAgain:
    """Searches for a group, one after another while `again()` holds and none found one; missed() if
    none did."""

    def __init__(
        self, start: Callable[[], Any], again: Callable[[], bool], missed: Callable[[], None]
    ) -> None:
        self.start, self.again, self.missed = start, again, missed
        self.handle = start()

    def done(self) -> bool:
        return self.handle.done() and (self.handle.wait().averaged or not self.again())

    def wait(self):
        while not (result := self.handle.wait()).averaged and self.again():
            self.handle = self.start()
        if not result.averaged and self.missed is not None:
            self.missed, _ = None, self.missed()
        return result
