"""torch's CPU threads for a run (`train.threads`). Unset, torch takes one thread per core; on a machine
busy with other work those threads wait for each other on shared cores, and a run is several times slower
(docs/records/benchmarks.md: the quickstart beside one CPU burner on 2 cores, 3.1x its idle time; 1.3x with
train.threads=1). torch's choice is kept, with one warning naming the fix, rather than a thread count that
depends on the load of the moment (the maths of a CPU run may change with its thread count). `muloco launch`
and `muloco sweep --jobs` give each process its share of the cores."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

log = logging.getLogger("muloco")
SAMPLE_S = 0.1  # how long the cores' use is watched before the run starts (10 jiffies a core)


def set_threads(threads: int | None, device: torch.device) -> None:
    if threads:
        torch.set_num_threads(threads)
        return
    cores, mine = os.cpu_count() or 1, torch.get_num_threads()
    if device.type != "cpu" or mine == 1 or "OMP_NUM_THREADS" in os.environ:
        return  # nothing to oversubscribe, or the count was chosen (e.g. by `muloco launch`)
    busy = busy_cores()
    if busy is not None and busy + mine > cores + 0.5:
        fits = max(1, cores - round(busy))
        log.warning(
            "the machine is busy (%.1f of %d cores in use by other work) and torch uses %d threads: threads "
            "waiting for each other on shared cores slow this run several times over; set train.threads=%d",
            *(busy, cores, mine, fits),
        )


def busy_cores() -> float | None:
    """How many cores other work keeps busy now: the machine's CPU use over SAMPLE_S (this process idles
    meanwhile), from /proc/stat; elsewhere the 1-minute load average; None if neither is available. (The
    load average alone would count a run that just ended, such as the previous command's.)"""
    stat = Path("/proc/stat")
    if stat.is_file():
        before = _cpu_times(stat)
        time.sleep(SAMPLE_S)
        after = _cpu_times(stat)
        total, idle = (a - b for a, b in zip(after, before, strict=True))
        return (os.cpu_count() or 1) * (1 - idle / total) if total > 0 else None
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _cpu_times(stat: Path) -> tuple[int, int]:
    """(all jiffies, idle + iowait jiffies) of the machine's `cpu` line."""
    fields = [int(v) for v in stat.read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields), fields[3] + fields[4]
