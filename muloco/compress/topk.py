"""Top-k sparsification as pure functions: which entries to keep and how their indices travel.

Indices are sorted and delta-coded (gap_0 = i_0, gap_j = i_j - i_(j-1) - 1 >= 0), then packed at the
minimal width that holds the largest gap. With k = fraction * n entries spread over n, the gaps are about
1 / fraction, so indices cost ~log2(1 / fraction) + a few bits each instead of log2(n) (e.g. ~12 instead
of 24 bits at 1% of 16M).
"""

from __future__ import annotations

import math

import torch

from muloco.compress.errors import CompressionError
from muloco.compress.packing import pack_uint, uint_width, unpack_uint


def topk_count(n: int, fraction: float) -> int:
    """Entries kept out of `n`: ceil(fraction * n), at least 1 (for n > 0), at most n."""
    if n == 0:
        return 0
    return max(1, min(n, math.ceil(fraction * n - 1e-9)))


def select_topk(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` largest-magnitude entries of a flat tensor: (indices ascending int64, their values).

    Large tensors: a threshold from a strided sample keeps ~1.5 k candidates, and an exact top-k runs on
    those (10x faster than torch.topk over 16M entries on a CPU). Exact: if at least k entries reach the
    threshold, the k largest are among them; otherwise we fall back to the full top-k. Ties are broken
    arbitrarily, as by torch.topk.
    """
    n = flat.numel()
    if k == n:
        idx = torch.arange(k, device=flat.device)
        return idx, flat[idx]
    mag = flat.abs()
    cand = None
    if n >= 1 << 18 and 4 * k < n:
        stride = max(1, n // (1 << 16))
        sample = mag[::stride]
        rank = min(sample.numel(), math.ceil(1.5 * k * sample.numel() / n) + 16)
        threshold = torch.topk(sample, rank, sorted=False).values.min()
        above = torch.nonzero(mag >= threshold).squeeze(1)  # (m,) ascending
        if above.numel() >= k:
            cand = above
    if cand is None:
        idx = torch.topk(mag, k, sorted=False).indices
    else:
        idx = cand[torch.topk(mag[cand], k, sorted=False).indices]
    idx = idx.sort().values
    return idx, flat[idx]


def encode_indices(idx: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(width, packed bytes) of ascending unique indices, delta-coded."""
    if idx.numel() == 0:
        return 1, torch.empty(0, dtype=torch.uint8)
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1)) - 1  # (k,) >= 0
    width = uint_width(int(gaps.max()))
    return width, pack_uint(gaps, width)


def decode_indices(packed: torch.Tensor, width: int, k: int, n: int) -> torch.Tensor:
    """Inverse of `encode_indices`; checks that every index is < n (gaps >= 0 make them unique)."""
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    gaps = unpack_uint(packed, width, k)
    # The last index is sum(gaps) + k - 1; summed in fp64 first so that absurd gaps cannot wrap int64.
    last = float(gaps.double().sum()) + k - 1
    if last >= n:
        raise CompressionError(f"malformed compressed payload: top-k index {last:.0f} >= numel {n}")
    return torch.cumsum(gaps + 1, dim=0) - 1  # (k,) strictly increasing
