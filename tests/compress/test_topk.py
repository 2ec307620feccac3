"""Top-k: exactly the k largest magnitudes survive, indices round-trip, sizes are as documented."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from muloco.compress import get_compressor, read_header
from muloco.compress.topk import decode_indices, encode_indices, select_topk, topk_count


def test_topk_count():
    assert topk_count(0, 0.01) == 0
    assert topk_count(1, 0.01) == 1
    assert topk_count(100, 0.01) == 1
    assert topk_count(101, 0.01) == 2
    assert topk_count(1000, 1.0) == 1000


@settings(max_examples=60, deadline=None)
@given(
    shape=st.sampled_from([(1,), (7,), (3, 5), (64, 33), (2, 2, 50)]),
    fraction=st.sampled_from([0.001, 0.01, 0.1, 0.5, 1.0]),
    value_bits=st.sampled_from([32, 16, 8]),
    seed=st.integers(0, 1000),
)
def test_kept_entries_and_error_bounds(shape, fraction, value_bits, seed):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    comp = get_compressor("topk", topk_fraction=fraction, topk_value_bits=value_bits)
    p = comp.encode(x)
    y = comp.decode(p)
    k = topk_count(x.numel(), fraction)
    assert read_header(p).count == k
    xf, yf = x.reshape(-1), y.reshape(-1)
    assert (yf != 0).sum().item() <= k
    thresh = xf.abs().topk(k).values.min()
    # kept entries are exact (fp32), bf16-rounded, or 8-bit absmax (half a step: absmax / 127 / 2, bf16 step)
    amax = xf.abs().max().item()
    tol = {32: 0.0, 16: 2**-8 * amax, 8: amax / 254 * (1 + 2**-7) * 1.0001}[value_bits]
    big = xf.abs() > thresh  # strictly above the k-th largest magnitude: surely kept
    assert (xf - yf)[big].abs().max().item() <= tol if big.any() else True
    # every entry was either dropped (decodes to 0, and then |x| <= thresh) or kept
    dropped = (yf == 0) & ((xf - yf).abs() > tol)
    assert (xf[dropped].abs() <= thresh).all()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), data=st.data())
def test_index_coding_roundtrip(n, data):
    idx = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=min(n, 200))))
    t = torch.tensor(idx)
    width, packed = encode_indices(t)
    assert width == max(1, max(b - a - 1 for a, b in zip([-1, *idx], idx, strict=False)).bit_length())
    assert decode_indices(packed, width, len(idx), n).tolist() == idx


def test_delta_coding_is_compact():
    n, fraction = 1 << 20, 0.01
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    p = get_compressor("topk", topk_fraction=fraction).encode(x)
    h = read_header(p)
    assert h.mode <= 12  # gaps ~ 1/fraction; a flat index would need 20 bits
    bits = 8 * len(p) / h.count
    assert bits < 32 + 12 + 1
    assert get_compressor("topk", topk_fraction=fraction).payload_nbytes((n,)) >= len(p)


@pytest.mark.parametrize("value_bits", [32, 16, 8])
def test_all_zeros_and_ties(value_bits):
    comp = get_compressor("topk", topk_fraction=0.1, topk_value_bits=value_bits)
    assert comp.decode(comp.encode(torch.zeros(50))).eq(0).all()
    assert comp.decode(comp.encode(torch.ones(50))).sum().item() == pytest.approx(5, rel=1e-3)


@pytest.mark.parametrize("layout", ["random", "clustered", "ties"])
def test_sampled_threshold_path_is_exact(layout):
    """Large tensors take the sampled-threshold path: it must select exactly the k largest magnitudes."""
    n, k = 1 << 18, 2000
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    if layout == "clustered":
        x[:3000] *= 100  # the big values sit where a strided sample barely looks
    elif layout == "ties":
        x = torch.randint(-3, 4, (n,), generator=torch.Generator().manual_seed(3)).float()
    idx, vals = select_topk(x, k)
    assert idx.numel() == k and bool((idx.diff() > 0).all()) and torch.equal(vals, x[idx])
    assert torch.equal(vals.abs().sort().values, x.abs().topk(k).values.sort().values)
