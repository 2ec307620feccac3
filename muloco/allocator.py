"""Keep freed memory for the next allocation of its size, instead of giving it back to the OS at once.

glibc serves an allocation above its mmap threshold (dynamic, at most 32 MiB on 64-bit) with a fresh mmap,
and a fresh mapping costs a page fault per 4 KiB on first touch. A sync allocates the same large buffers
every time (a 1B model's decoded tensors are 64 MiB and more), so each sync paid those faults again: a 16M
fp32 decode took 87 ms at one thread, 25 ms with its memory kept (bench_sync_cost.py records the effect on a
whole sync). Raising the mmap and trim thresholds keeps freed blocks in the heap for reuse; the process's
resident memory then stays near its peak instead of falling between syncs, which a training process reaches
again at its next sync anyway.

`muloco train` (the Trainer) calls `keep_freed_memory()`; the Python API leaves the user's process as it is
(call it yourself to opt in). MULOCO_MALLOC=system turns it off. A no-op where libc is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_THRESHOLD = 1 << 30  # blocks up to 1 GiB come from the heap; at most 1 GiB of free heap stays untrimmed
_done: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process; True if they are set (False: not glibc, or turned off)."""
    global _done
    if _done is None:
        _done = False
        name = ctypes.util.find_library("c")
        if os.environ.get("MULOCO_MALLOC", "keep") != "system" and name:
            libc = ctypes.CDLL(name)
            if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version"):
                _done = bool(libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD)) and bool(
                    libc.mallopt(_M_TRIM_THRESHOLD, _THRESHOLD)
                )
    return _done
