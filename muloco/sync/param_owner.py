"""The parameter owner of asynchronous outer updates over processes (sync.mode: async on backend.kind=torch;
docs/heterogeneous.md). Rank 0 holds the global parameters and the outer rule's book (arrivals.py); a
thread there answers the other ranks over their own gloo group (comm/point_to_point.py) while rank 0's
main thread trains worker 0 and hands its windows in by a direct call.

The exchange, one per window: a worker sends its window's pseudogradient (compressed with its own error
feedback, or fp32) and its loss; the owner applies it at once by delayed Nesterov, books it, and answers
with the worker's next window (its steps, cut to the run's budget; 0: done), the lr schedule's step to start
it at, and the new global parameters, which the worker trains from. The first exchange of a worker (at the
start, or after a resume) is a pull: no window, only the answer.

A signal at any rank reaches the owner with that rank's next window: from then on every answer is 0 steps,
so each worker finishes the window it is in, hands it in and stops (nothing trained is lost).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from muloco.comm.point_to_point import PointToPoint
from muloco.sync.arrivals import Arrivals, fp32_message

log = logging.getLogger("muloco")

PULL, WINDOW, LEFT_OUT = 0.0, 1.0, 2.0  # a message's kind (LEFT_OUT: a non-finite window, no payload)


@dataclass
class WindowIn:
    """What a worker hands in: its window's steps, loss (sum, count) and pseudogradient norm, and its
    message (None for a pull or a non-finite window)."""

    kind: float
    steps: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    norm: float = 0.0
    stop: bool = False
    message: bytes | None = None

    def header(self) -> list[float]:
        return [self.kind, self.steps, self.loss_sum, self.loss_count, self.norm, float(self.stop)]

    @classmethod
    def parse(cls, header: list[float], payload: bytes) -> WindowIn:
        kind, steps, loss_sum, loss_count, norm, stop = header[:6]
        return cls(kind, int(steps), loss_sum, int(loss_count), norm, bool(stop), payload or None)


@dataclass
class Answer:
    """The owner's answer: the next window's steps (0: done), the lr schedule's step it starts at, the
    arrivals applied so far, and the global parameters (fp32 bytes)."""

    steps: int
    start_step: int
    arrivals: int
    credited: int
    params: bytes


@dataclass
class Arrived:
    """One applied window, for rank 0's log."""

    worker: int
    window: WindowIn
    staleness: int  # arrivals applied between the worker's pull and this arrival
    started_step: int
    update_norm: float | None
    payload_bytes: float
    arrivals: int  # after it
    credited: int


class ParameterOwner:
    def __init__(self, book: Arrivals, channel: PointToPoint | None) -> None:
        self.book, self.channel = book, channel
        self.lock = threading.Lock()
        self.arrived: list[Arrived] = []  # taken by rank 0's main thread (drain)
        self.pulled_at = [0] * book.workers
        self.started_at = [0] * book.workers
        self.stopping = False
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """The thread that answers ranks 1..K-1 until each is done (K = the book's workers)."""
        if self.book.workers > 1 and self.thread is None:
            self.thread = threading.Thread(target=self._serve, name="muloco-param-owner", daemon=True)
            self.thread.start()

    def exchange(self, worker: int, window: WindowIn) -> Answer:
        """Apply `worker`'s window (if any) and hand it its next one."""
        with self.lock:
            if self.error is not None:
                raise self.error
            self.stopping |= window.stop
            if window.kind != PULL:
                message = window.message if window.kind == WINDOW else None
                update_norm, payload = self.book.apply(window.steps, message)
                staleness = self.book.arrivals - 1 - self.pulled_at[worker]
                self.arrived.append(
                    Arrived(
                        worker,
                        window,
                        staleness,
                        self.started_at[worker],
                        update_norm,
                        payload,
                        self.book.arrivals,
                        self.book.credited,
                    )
                )
            steps = 0 if self.stopping else self.book.claim(worker)
            start = min(self.book.credited // self.book.workers, max(self.book.total_steps - 1, 0))
            self.pulled_at[worker], self.started_at[worker] = self.book.arrivals, start
            params = fp32_message(self.book.params)
            return Answer(steps, start, self.book.arrivals, self.book.credited, params)

    def drain(self) -> list[Arrived]:
        with self.lock:
            arrived, self.arrived = self.arrived, []
        return arrived

    def snapshot(self) -> list[torch.Tensor]:
        """A copy of the global parameters (the owner's thread updates them meanwhile)."""
        with self.lock:
            return [p.detach().clone() for p in self.book.params]

    def stop(self) -> None:
        with self.lock:
            self.stopping = True

    def join(self) -> None:
        """Wait until every other worker is done; raise what stopped the owner's thread, if anything."""
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error

    def _serve(self) -> None:
        remaining = self.book.workers - 1
        try:
            while remaining:
                sender, header, payload = self.channel.receive()
                answer = self.exchange(sender, WindowIn.parse(header, payload))
                header = [answer.steps, answer.start_step, answer.arrivals, answer.credited]
                self.channel.send(sender, header, answer.params)
                remaining -= answer.steps == 0
        except BaseException as error:  # raised in rank 0's main thread at its next exchange or join
            log.error("the parameter owner stopped: %s", error)
            with self.lock:
                self.error, self.stopping = error, True


def exchange_with_owner(channel: PointToPoint, window: WindowIn) -> Answer:
    """A worker on rank > 0: hand `window` to rank 0's owner and wait for the answer."""
    channel.send(0, window.header(), window.message or b"")
    _, header, payload = channel.receive(0)
    steps, start, arrivals, credited = (int(x) for x in header[:4])
    return Answer(steps, start, arrivals, credited, payload)
