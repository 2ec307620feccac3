"""Round-trip error bounds of the quantizers, derived per scheme, checked over many shapes and values.

Bounds (step = the group's bf16 step, which is the fp32 statistic rounded *up* by at most 2**-7 relative):
- linear absmax, bits >= 2: step <= absmax / (2**(b-1) - 1) * (1 + 2**-7); 1 bit: step <= absmax *
  (1 + 2**-7); every element: |x - x_hat| <= step / 2.
- linear minmax: step <= (max - min) / (2**b - 1) * (1 + 2**-7); every element: |x - x_hat| <= step / 2.
- statistical: step = 2 r std / 2**b (rounded up); elements within r std - step of the mean land in an
  interior bin and decode to a centroid inside it: |x - x_hat| <= step. (The two outer bins also hold the
  clipped values, so their centroids may lie outside the bin: no per-element bound there.) The centroid
  table makes the quantizer unbiased per bin: for each code, sum((x - x_hat) / step) = 0 over the elements
  with that code.
fp32 arithmetic adds a relative slop of ~1e-6 of the values' magnitude, allowed for below.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from muloco.compress import DEFAULT_STAT_RANGE, get_compressor
from muloco.compress.quantize import dequantize_codes, quantize, round_up_bf16, segments

BF16_UP = 1 + 2**-7
SLOP = 4e-6


def groups(x: torch.Tensor, granularity: str, block_size: int) -> list[torch.Tensor]:
    """Reference grouping, written independently of quantize.segments: a list of 1-D groups."""
    flat = x.reshape(-1)
    if flat.numel() == 0:
        return []
    if granularity == "tensor":
        return [flat]
    if granularity == "row":
        rows = x.shape[0] if x.dim() >= 2 else 1
        return list(flat.view(rows, -1))
    return list(flat.split(block_size))


def roundtrip(comp, x):
    y = comp.decode(comp.encode(x))
    assert y.dtype == torch.float32 and y.shape == x.shape
    return y


shapes = st.one_of(
    st.just(()),
    st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple),
    st.sampled_from([(1,), (7, 300), (3, 257), (2, 3, 5, 7), (1, 1, 1), (4, 0), (0,)]),
)


@st.composite
def tensors(draw):
    shape = draw(shapes)
    kind = draw(
        st.sampled_from(["normal", "huge_range", "zeros", "constant_rows", "outliers", "tiny", "big"])
    )
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "huge_range":
        x = x * torch.pow(10.0, torch.randint(-30, 30, shape, generator=g).float())
    elif kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "constant_rows":
        x = torch.zeros(shape) + (
            torch.randn(shape[:1] + (1,) * (len(shape) - 1), generator=g) if shape else 3.0
        )
    elif kind == "outliers":
        x = torch.where(torch.rand(shape, generator=g) < 0.05, x * 1000, x)
    elif kind == "tiny":
        x = x * 1e-25  # sums of squares underflow fp32
    elif kind == "big":
        x = x * 1e25  # sums of squares overflow fp32
    return x


granularity = st.sampled_from(["tensor", "row", "block"])
block_size = st.sampled_from([1, 3, 8, 256])


@settings(max_examples=150, deadline=None)
@given(x=tensors(), bits=st.sampled_from([1, 2, 4, 8]), gran=granularity, bs=block_size)
def test_linear_absmax_error_at_most_half_a_step(x, bits, gran, bs):
    y = roundtrip(get_compressor("linear", bits, gran, bs, "absmax"), x)
    qmax = 1 if bits == 1 else 2 ** (bits - 1) - 1
    for xg, yg in zip(groups(x, gran, bs), groups(y, gran, bs), strict=True):
        absmax = xg.abs().max().item()
        bound = absmax / qmax * BF16_UP / 2 * (1 + SLOP) + SLOP * absmax
        assert (xg - yg).abs().max().item() <= bound


@settings(max_examples=150, deadline=None)
@given(x=tensors(), bits=st.sampled_from([1, 2, 4, 8]), gran=granularity, bs=block_size)
def test_linear_minmax_error_at_most_half_a_step(x, bits, gran, bs):
    y = roundtrip(get_compressor("linear", bits, gran, bs, "minmax"), x)
    for xg, yg in zip(groups(x, gran, bs), groups(y, gran, bs), strict=True):
        lo, hi = xg.min().item(), xg.max().item()
        bound = (hi - lo) / (2**bits - 1) * BF16_UP / 2 * (1 + SLOP) + SLOP * max(abs(lo), abs(hi))
        assert (xg - yg).abs().max().item() <= bound


@settings(max_examples=150, deadline=None)
@given(x=tensors(), bits=st.sampled_from([1, 2, 4, 8]), gran=granularity, bs=block_size)
def test_statistical_in_range_error_at_most_one_step(x, bits, gran, bs):
    comp = get_compressor("statistical", bits, gran, bs)
    y = roundtrip(comp, x)
    r = comp.stat_range
    for xg, yg in zip(groups(x, gran, bs), groups(y, gran, bs), strict=True):
        xd = xg.double()
        mean, std = xd.mean().item(), xd.std(correction=0).item()
        scale = xd.abs().max().item()
        if std == 0:  # constant group: decodes to its mean, exact up to fp32 rounding
            assert (xg - yg).abs().max().item() <= SLOP * scale
            continue
        step = 2 * r * std / 2**bits * BF16_UP
        inside = (xd - mean).abs() <= (r * std - step) * (1 - 1e-3)
        err = (xg - yg).abs()[inside]
        if err.numel():
            assert err.max().item() <= step * (1 + 1e-3) + SLOP * scale


@pytest.mark.parametrize("gran", ["tensor", "row", "block"])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_statistical_centroids_are_unbiased_per_bin(bits, gran):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(33, 70, generator=g) * torch.rand(33, 1, generator=g) + torch.randn(33, 1, generator=g)
    q = quantize(x, bits, "statistical", gran, block_size=64)
    y = dequantize_codes(q, bits, x.shape, gran, 64)
    steps = torch.cat(
        [q.steps.float()[i : i + s.rows].repeat_interleave(s.length) for i, s in _starts(x, gran, 64)]
    )
    resid = (x - y).reshape(-1).double() / steps.double()  # in units of step
    for code in range(2**bits):
        sel = q.codes == code
        if sel.any():
            assert abs(resid[sel].sum().item()) <= 1e-3 * sel.sum().item()


def _starts(x, gran, bs):
    g = 0
    for s in segments(tuple(x.shape), gran, bs):
        yield g, s
        g += s.rows


@pytest.mark.parametrize("scheme", ["linear", "statistical"])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_all_zeros_and_constant_rows_are_exact(scheme, bits):
    z = torch.zeros(5, 40)
    assert torch.equal(roundtrip(get_compressor(scheme, bits), z), z)
    c = torch.arange(5.0).unsqueeze(1).expand(5, 40).contiguous() * 0.1 - 0.2
    mode = "minmax" if scheme == "linear" else "absmax"
    y = roundtrip(get_compressor(scheme, bits, linear_mode=mode), c)
    assert torch.allclose(y, c, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scheme", ["linear", "statistical"])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_rows_of_subnormal_values_encode_and_decode_finite(scheme, bits):
    # An error-feedback residual decayed to ~1e-38 once made 1/step overflow and the statistical lookup
    # table NaN (a MuLoCo 2-bit + EF run died at outer step 86): such rows decode to their offset.
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)) * 0.01
    x[1] = 1e-38 + torch.rand(64, generator=torch.Generator().manual_seed(4)) * 2e-39
    x[2] = torch.rand(64, generator=torch.Generator().manual_seed(5)) * 1e-39
    y = roundtrip(get_compressor(scheme, bits), x)
    assert torch.isfinite(y).all()
    assert (y[1:3] - x[1:3]).abs().max() < 2e-38


@pytest.mark.parametrize("bits, limit", [(8, 1e-3), (4, 3e-2), (2, 0.15), (1, 0.4)])
def test_statistical_relative_mse_on_gaussian_rows(bits, limit):
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(1))
    y = roundtrip(get_compressor("statistical", bits), x)
    assert ((x - y).square().sum() / x.square().sum()).item() < limit


@pytest.mark.parametrize("scheme", ["linear", "statistical"])
@pytest.mark.parametrize("scale", [1e-25, 1e-12, 1.0, 1e12, 1e25])
def test_relative_error_is_scale_invariant(scheme, scale):
    """Rows far from 1 take the fp64 path for their statistics; the relative error must not change (bf16
    steps round differently at other scales, so codes at bin edges may differ: compare MSE, not elements)."""
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(2))
    comp = get_compressor(scheme, 4)
    ref = (roundtrip(comp, x) - x).square().sum() / x.square().sum()
    xs = x.double().mul(scale).float()
    rel = (roundtrip(comp, xs).double() - xs.double()).square().sum() / xs.double().square().sum()
    assert abs(rel.item() / ref.item() - 1) < 0.1


def test_default_ranges_and_overhead():
    assert DEFAULT_STAT_RANGE == {1: 1.0, 2: 2.0, 4: 3.75, 8: 10.0}
    for cols in (256, 512, 1024):
        for scheme in ("linear", "statistical"):
            bpp = get_compressor(scheme, 4).estimate_bits_per_param((256, cols))
            assert bpp <= 1.15 * 4, (scheme, cols, bpp)


def test_round_up_bf16_never_rounds_down():
    x = torch.rand(10000) * torch.pow(10.0, torch.randint(-30, 30, (10000,)).float())
    up = round_up_bf16(x).float()
    assert (up >= x).all() and (up <= x * BF16_UP).all()
    assert round_up_bf16(torch.zeros(3)).float().eq(0).all()


def test_block_tail_and_one_element_tensors():
    for shape in [(), (1,), (1, 1), (257,), (3, 100)]:
        x = torch.randn(shape)
        for gran in ("tensor", "row", "block"):
            y = roundtrip(get_compressor("statistical", 8, gran, 256), x)
            assert torch.allclose(y, x, atol=0.05 * max(1.0, x.abs().max().item()))
    assert math.prod(()) == 1


@pytest.mark.parametrize("bits", [8, 2])
def test_threaded_paths_match_the_serial_ones(monkeypatch, bits):
    """With >1 torch thread, bin statistics run on a worker pool and decoding splits its table lookups; the
    bytes and the decoded tensor must not depend on it (chunks are still added in order)."""
    import muloco.compress.quantize as q

    monkeypatch.setattr(q, "CPU_CHUNK", 4096)  # many chunks
    x = torch.randn(1024, 600, generator=torch.Generator().manual_seed(5))
    comp = get_compressor("statistical", bits)
    serial = comp.encode(x)
    y_serial = comp.decode(serial)
    torch.set_num_threads(2)  # the autouse fixture sets it back to 1 for the next test
    threaded = comp.encode(x)
    assert threaded == serial
    assert torch.equal(comp.decode(threaded), y_serial)
