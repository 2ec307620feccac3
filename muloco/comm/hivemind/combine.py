"""The group's combine rule (pure functions): which contributions are averaged, and how.

Every member applies these to the same bytes, so members that downloaded the same payloads exclude the same
contributions and hold the same mean, bit for bit.
"""

from __future__ import annotations

import math

import torch

from muloco.comm.hivemind.exclusion import Exclusion
from muloco.comm.hivemind.settings import is_int

# ---- the group's combine rule (pure functions) ----------------------------------------------------------


def contribution_problem(tensors: list[torch.Tensor], shapes: list[torch.Size]) -> Exclusion | None:
    """Why a decoded contribution cannot be used (count, shape, dtype, non-finite values), or None."""
    if len(tensors) != len(shapes):
        return Exclusion("malformed", f"{len(tensors)} tensors, expected {len(shapes)}")
    for i, (t, shape) in enumerate(zip(tensors, shapes, strict=True)):
        if t.shape != shape:
            return Exclusion("malformed", f"tensor {i} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if t.dtype != torch.float32:
            return Exclusion("malformed", f"tensor {i} has dtype {t.dtype}, expected torch.float32")
        if not bool(torch.isfinite(t).all()):
            return Exclusion("non_finite", f"tensor {i} holds non-finite values")
    return None


def contribution_norm(tensors: list[torch.Tensor]) -> float:
    """The L2 norm of a contribution, all tensors together. Per tensor in fp32 (fast); a tensor whose norm
    overflows fp32 (values ~1e19) gives inf, which norm_outliers always flags."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(t)) ** 2 for t in tensors))


def norm_outliers(norms: dict[str, float], max_norm_ratio: float) -> dict[str, Exclusion]:
    """Contributions whose norm exceeds max_norm_ratio x the lower median norm -> the reason.

    The lower median (the smaller middle value) so that of two contributions the larger is flagged when it
    is ratio x the smaller (with the mean of the two, a 100x one would pass). A median of 0 flags nothing.
    """
    if len(norms) < 2:
        return {}
    ordered = sorted(norms.values())
    median = ordered[(len(ordered) - 1) // 2]
    if median <= 0 or math.isinf(median):
        return {}  # all zero, or most overflowed: the mean's own finiteness check decides
    return {
        key: Exclusion("outlier", f"norm {n:.3g} > {max_norm_ratio:g} x the group's median {median:.3g}")
        for key, n in norms.items()
        if n > max_norm_ratio * median
    }


WITHHELD = "withheld by its peer"  # how a sender's own unusable contribution reads (exchange.py)


def withheld(why: str) -> Exclusion:
    """A contribution its own peer does not send (non-finite or unencodable): it sends no token."""
    return Exclusion("non_finite", f"{WITHHELD}: {why}")


def _metadata_problem(meta, step: int, rule: tuple[str, int]) -> Exclusion | None:
    """Why a member's gathered metadata rules it out (before any download), or None."""
    if not isinstance(meta, dict) or not is_int(meta.get("step")):
        return Exclusion("malformed", "malformed metadata")
    if meta["step"] != step:
        return Exclusion("other_step", f"at outer step {meta['step']}, this peer at {step}")
    if meta.get("rule") != list(rule):
        return Exclusion(
            "rule", f"combines by sync.aggregate/trim {meta.get('rule')}, this peer by {list(rule)}"
        )
    token = meta.get("token")
    if token is None:
        return Exclusion("non_finite", f"{WITHHELD} (non-finite or unencodable contribution)")
    if not isinstance(token, bytes) or len(token) != 16:
        return Exclusion("malformed", "malformed metadata")
    return None


def unauthenticated_metadata(auth, fragment: int, peer, meta) -> Exclusion | None:
    """Why a member's gathered metadata fails the swarm's authentication (auth.SwarmAuth), or None. The
    tag covers the fragment, step, sender, payload token, state digest and combine rule
    (exchange.FragmentSync)."""
    if not isinstance(meta, dict) or not (isinstance(meta.get("rule"), list) and len(meta["rule"]) == 2):
        return Exclusion("malformed", "malformed metadata")
    token, digest = meta.get("token") or b"", meta.get("digest", b"")
    fields = (fragment, meta.get("step"), peer, token, digest, *meta["rule"])
    return auth.check(peer, "group metadata", meta.get("tag"), *fields)
