"""A child's end when its parent dies, however the parent dies (even by SIGKILL): Linux's parent-death
signal (prctl PR_SET_PDEATHSIG), so no rank is left waiting on a collective and no helper process is
orphaned. Elsewhere both helpers are no-ops.

Imports nothing of muloco: the launcher and the preloaded server (its ranks) and the swarm's reducer (its
forked hivemind helpers) call it from different layers (docs/design.md).
"""

from __future__ import annotations

import signal


def _load_prctl():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()  # loaded in the parent: after fork (threads running) the child only calls it
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def sigterm_when_parent_dies() -> None:
    """In the child, before exec: ask Linux to SIGTERM it when the launcher dies, so that it can end
    cleanly (a rank writes nothing more and leaves its collectives)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


def die_with_parent() -> None:
    """In a forked helper process (hivemind's DHT and averagers): SIGKILL it when its parent dies, so a
    killed peer leaves no orphans behind."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
