"""The run's metrics.jsonl records, all timed alike (tokens, elapsed time, bytes sent): those written now
(eval) and those whose means over the processes are still on their way (sync and dp train records,
pending_records.py), which are written in order once they arrive and at the latest before the next record
or checkpoint."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from muloco.comm import Backend, ProcessMeans, means_over_processes
from muloco.run.metrics import MetricsLogger, timed_record
from muloco.run.pending_records import PendingRecords
from muloco.sync import SyncRecord
from muloco.sync.counters import CommLedger


class RunLog:
    def __init__(
        self,
        metrics: MetricsLogger,
        backend: Backend,
        ledger: CommLedger,
        tokens_at: Callable[[int], int],
        total_steps: int,
        elapsed_at_start: float,
    ) -> None:
        """tokens_at(step): the tokens all workers trained up to inner step `step`; elapsed_at_start: the
        run's wall time in earlier sessions (a resumed run's clock goes on)."""
        self.metrics, self.backend, self.ledger = metrics, backend, ledger
        self.tokens_at, self.total_steps = tokens_at, total_steps
        self.started, self.elapsed_at_start = time.perf_counter(), elapsed_at_start
        self._pending = PendingRecords()

    def elapsed(self) -> float:
        return self.elapsed_at_start + time.perf_counter() - self.started

    def now(self, kind: str, step: int, **values: Any) -> None:
        """One record at `step`, after the records still waiting."""
        self.flush()
        self.metrics.log(timed_record(kind, step, *self._timing(step), **values))

    def sync(self, record: SyncRecord, step_times: tuple[tuple[float, int], ...] = ()) -> None:
        """An applied sync: its train loss and pseudogradient norm averaged over the processes, and
        `step_times`' (seconds, inner steps) of each worker in its round as `step_s`, a list over the K
        workers of their mean inner-step time (None for a worker that took no step)."""
        means = means_over_processes(self.backend, record.loss, record.norm, *step_times)
        names = ("train_loss", "pseudograd_norm", *(f"step_s.{w}" for w in range(len(step_times))))
        self._later("sync", record.step, means, names, record.fields)

    def train(self, step: int, loss_sum_count: tuple[float, int]) -> None:
        """A dp log line: the train loss averaged over the processes."""
        self.flush(block=False)  # earlier log lines' means, those that have arrived
        self._later("train", step, means_over_processes(self.backend, loss_sum_count), ("train_loss",), {})

    def _later(self, kind: str, step: int, means: ProcessMeans, names: tuple[str, ...], fields: dict) -> None:
        """A record whose means over the processes are still on their way, timed now: over a slow link
        their all-reduce would otherwise cost every sync a round trip."""
        self._pending.add(kind, step, self._timing(step), means, names, fields)

    def flush(self, block: bool = True) -> None:
        """The records waiting for their means; block=False: those whose means have arrived. A blocking
        wait is time on the network (summary.json's comm_wait_s)."""
        self.ledger.comm_wait_s += self._pending.flush(self.metrics.log, block)

    def _timing(self, step: int) -> tuple:
        return self.tokens_at(step), self.total_steps, self.elapsed(), self.ledger.bytes_sent

    def close(self) -> None:
        self.metrics.close()
