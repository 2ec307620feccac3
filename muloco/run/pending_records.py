"""Log records waiting for their means over the processes (the trainer's sync and dp log lines).

Each record's means are an all-reduce started when the record is made (comm.ProcessMeans). Over a slow
link that all-reduce takes longer than an inner step (~85 ms for 4 ranks over 20 ms links against a ~30 ms
pico step), so a round writes only the records whose means have arrived, in order, and leaves the rest for
a later round; a checkpoint, an eval record and the end of the run write them all, waiting if need be.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from muloco.comm import ProcessMeans
from muloco.run.metrics import timed_record


class PendingRecords:
    def __init__(self) -> None:
        self._records: deque[tuple] = deque()

    def __len__(self) -> int:
        return len(self._records)

    def add(
        self, kind: str, step: int, timing: tuple, means: ProcessMeans, names: tuple[str, ...], fields: dict
    ) -> None:
        """A record of `kind` at `step`, timed (`timing`: timed_record's) now, whose `names` are `means`."""
        self._records.append((kind, step, timing, means, names, fields))

    def flush(self, write: Callable[[dict[str, Any]], None], block: bool = True) -> float:
        """Write the waiting records in order; block=False: only up to the first whose means are still on
        their way. Returns the seconds spent waiting for means (time on the network)."""
        waited = 0.0
        while self._records:
            kind, step, timing, means, names, fields = self._records[0]
            if not block and not means.ready():
                break
            t0 = time.perf_counter()
            values = _lists(dict(zip(names, means(), strict=True)))
            waited += time.perf_counter() - t0
            write(timed_record(kind, step, *timing, **values, **fields))
            self._records.popleft()
        return waited


def _lists(values: dict[str, float]) -> dict[str, Any]:
    """Means named "name.i" as one list `name` in index order, a mean over nothing (0 / 0) there as None."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        base, _, index = name.partition(".")
        if index:
            out.setdefault(base, []).append(None if math.isnan(value) else round(value, 6))
        else:
            out[name] = value
    return out
