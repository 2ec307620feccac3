"""SIGINT / SIGTERM during a run: finish the current inner step (one process) or round (several), write a
checkpoint, exit 130 / 143; a second Ctrl+C exits at once (docs/reliability.md)."""

from __future__ import annotations

import logging
import signal
import threading

import torch

from muloco.comm import Backend

log = logging.getLogger("muloco")

EXIT_INTERRUPTED = {signal.SIGINT: 130, signal.SIGTERM: 143}


class StopRequest:
    """The signal a run was asked to stop with (None: keep going), set by handlers `install` puts up."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.signal: int | None = None
        self._previous: dict | None = None
        self._pending = None  # the ranks' flags summed since the last round (several processes)

    def install(self) -> None:
        """Handlers for SIGINT and SIGTERM (main thread only; `restore` puts the previous ones back)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            if self.signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.signal = signum
            # Several processes: within two agreement periods (2 x sync.every steps; dp: 2 x log_every).
            when = "the current inner step" if self.backend.world_size == 1 else "the ranks' next agreement"
            log.warning(
                "signal=%s received: stopping after %s, writing a checkpoint (Ctrl+C again: exit at once)",
                signal.Signals(signum).name,
                when,
            )

        self._previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore(self) -> None:
        for sig, handler in (self._previous or {}).items():
            signal.signal(sig, handler)
        self._previous = None

    def now(self) -> bool:
        """Stop inside a round, after the current inner step: single-process runs only. With several
        processes the ranks agree to stop at the end of the round (`agreed`): agreeing after every inner
        step would cost a collective per step over the slow link DiLoCo is meant to spare."""
        return self.signal is not None and self.backend.world_size == 1

    def agreed_at(self, step: int, period: int) -> bool:
        """`agreed` after the round that ended at inner step `step`, asked once per `period` inner steps
        (DiLoCo: H, plain DiLoCo's every round, streaming's every 2P-th; dp: a log line's) and every round
        in a single process (no collective). Every rank answers the same: a signal stops the run within two
        periods."""
        if self.backend.world_size > 1 and step % period != 0:
            return False
        return self.agreed()

    def agreed(self) -> bool:
        """Whether any rank got SIGINT/SIGTERM. With several processes every rank calls this at the same
        rounds (`agreed_at`): the ranks' flags are summed by a collective started here
        and read at the next call, so all ranks stop after the same round and no round waits on a round
        trip of its own (over a 20 ms link a 4-rank all-reduce of one float takes ~85 ms, more than a
        pico round's compute)."""
        if self.backend.world_size == 1:
            return self.signal is not None
        previous, self._pending = self._pending, self.backend.all_reduce_sum([self._flag()])
        return previous is not None and self._read(previous)

    def settle(self) -> bool:
        """`agreed` once more, blocking, after the last round (every rank calls it once): a signal that
        reached some ranks during the last round must not send them to the checkpoint's collectives while
        the others evaluate (a sharded model's eval gathers)."""
        if self.backend.world_size == 1:
            return self.signal is not None
        previous, self._pending = self._pending, None
        earlier = previous is not None and self._read(previous)
        return self._read(self.backend.all_reduce_sum([self._flag()])) or earlier

    def _flag(self) -> torch.Tensor:
        return torch.tensor([0.0 if self.signal is None else float(self.signal)])

    def _read(self, handle) -> bool:
        stop = handle.wait()[0].item() > 0
        if stop and self.signal is None:
            self.signal = signal.SIGTERM  # another rank was told to stop
        return stop
