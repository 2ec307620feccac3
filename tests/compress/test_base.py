"""The Compressor contract, for every scheme: NaN/Inf, input types, shapes and dtypes, sizes on the wire."""

import math

import pytest
import torch

from muloco.compress import CompressionError, Compressor, decode, get_compressor, read_header

ALL = [
    ("none", {}),
    ("bf16", {}),
    ("linear", {"bits": 4}),
    ("linear", {"bits": 8, "linear_mode": "minmax", "granularity": "block"}),
    ("statistical", {"bits": 2}),
    ("statistical", {"bits": 8, "granularity": "tensor"}),
    ("topk", {}),
    ("topk", {"topk_value_bits": 8, "topk_fraction": 0.5}),
]
ALL_IDS = [f"{s}-{kw}" for s, kw in ALL]


@pytest.mark.parametrize("scheme, kw", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_a_clear_error(scheme, kw, bad):
    x = torch.randn(4, 50)
    x[2, 7] = bad
    with pytest.raises(CompressionError, match="NaN.*Inf|finite"):
        get_compressor(scheme, **kw).encode(x)


@pytest.mark.parametrize("scheme, kw", ALL, ids=ALL_IDS)
def test_shapes_dtypes_and_views(scheme, kw):
    comp: Compressor = get_compressor(scheme, **kw)
    base = torch.randn(6, 40, requires_grad=True)
    for x, dtype in [
        (base, torch.float32),
        (base.detach().t(), torch.float32),  # non-contiguous
        (base.detach().bfloat16(), torch.bfloat16),
        (base.detach().half(), torch.float16),
        (base.detach().double(), torch.float64),
        (torch.tensor(1.5), torch.float32),
        (torch.randn(2, 1, 3, 1, 2), torch.float32),
        (torch.zeros(0, 4), torch.float32),
    ]:
        p = comp.encode(x)
        assert isinstance(p, bytes) and read_header(p).dtype == dtype
        y = comp.decode(p)
        assert y.dtype == torch.float32 and y.shape == x.shape and y.device.type == "cpu"
        assert torch.equal(decode(p), y)
        assert len(p) <= comp.payload_nbytes(x.shape)  # exact, or an upper bound for top-k
        if scheme != "topk":
            assert len(p) == comp.payload_nbytes(x.shape)


@pytest.mark.parametrize("scheme, kw", ALL, ids=ALL_IDS)
def test_decode_refuses_another_schemes_payload(scheme, kw):
    other = "bf16" if scheme == "none" else "none"
    p = get_compressor(other).encode(torch.randn(3, 4))
    with pytest.raises(CompressionError, match="same compression config"):
        get_compressor(scheme, **kw).decode(p)


def test_integer_and_non_tensor_input_are_refused():
    with pytest.raises(CompressionError, match="floating-point"):
        get_compressor("linear").encode(torch.arange(10))
    with pytest.raises(CompressionError, match="torch.Tensor"):
        get_compressor("linear").encode([1.0, 2.0])


def test_effective_bits_per_parameter():
    shape = (256, 1024)
    expected = {  # bits + (48 per row: fp32 offset + bf16 step) / 1024, + header (48 bytes) and CRC (4)
        1: 1 + 48 / 1024,
        2: 2 + 48 / 1024,
        4: 4 + 48 / 1024,
        8: 8 + 48 / 1024,
    }
    n = math.prod(shape)
    for bits, bpp in expected.items():
        comp = get_compressor("statistical", bits)
        lut = 32 * 2**bits / n
        assert comp.estimate_bits_per_param(shape) == pytest.approx(bpp + lut + 8 * 52 / n)
        assert get_compressor("linear", bits).estimate_bits_per_param(shape) == pytest.approx(
            bits + 16 / 1024 + 8 * 52 / n
        )
        assert comp.estimate_bits_per_param(shape) <= 1.15 * bits or bits == 1
    assert get_compressor("none").estimate_bits_per_param(shape) == pytest.approx(32, rel=1e-3)
    assert get_compressor("bf16").estimate_bits_per_param(shape) == pytest.approx(16, rel=1e-3)
