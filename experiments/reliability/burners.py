"""CPU burners for the reliability harnesses: processes that each spin on one core for as long as the
`with` block runs (on this 2-core machine, two burners take as much CPU as what they run beside)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from contextlib import contextmanager


def _spin() -> None:
    while True:
        pass


@contextmanager
def burners(count: int) -> Iterator[None]:
    """`count` spinning processes for the duration of the block; ended (terminated, joined) on any exit."""
    procs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(count)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
            p.join(timeout=5)
