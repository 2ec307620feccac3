"""The public API: factories and their validation, exact schemes, NaN/Inf, dtypes, sizes on the wire."""

import math

import pytest
import torch

from muloco.compress import (
    CompressionError,
    Compressor,
    decode,
    get_compressor,
    get_compressor_from_config,
    read_header,
)
from muloco.config import CompressionConfig

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


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"scheme": "gzip"}, "scheme"),
        ({"scheme": "linear", "bits": 3}, "bits"),
        ({"scheme": "linear", "bits": True}, "bits"),
        ({"scheme": "linear", "granularity": "column"}, "granularity"),
        ({"scheme": "linear", "block_size": 0}, "block_size"),
        ({"scheme": "linear", "block_size": 2.5}, "block_size"),
        ({"scheme": "linear", "linear_mode": "max"}, "linear_mode"),
        ({"scheme": "statistical", "stat_range": -1.0}, "stat_range"),
        ({"scheme": "statistical", "stat_range": float("nan")}, "stat_range"),
        ({"scheme": "topk", "topk_fraction": 0.0}, "topk_fraction"),
        ({"scheme": "topk", "topk_fraction": 1.5}, "topk_fraction"),
        ({"scheme": "topk", "topk_fraction": 1e-7}, "topk_fraction"),
        ({"scheme": "topk", "topk_value_bits": 4}, "topk_value_bits"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        get_compressor(**kwargs)


def test_from_config_matches_the_config():
    assert get_compressor_from_config(CompressionConfig()).scheme == "none"
    cfg = CompressionConfig(scheme="statistical", bits=2, granularity="block", block_size=64, stat_range=2.5)
    comp = get_compressor_from_config(cfg)
    assert (comp.scheme, comp.bits, comp.granularity, comp.block_size, comp.stat_range) == (
        "statistical", 2, "block", 64, 2.5)  # fmt: skip
    cfg = CompressionConfig(scheme="topk", topk_fraction=0.05, topk_value_bits=16)
    comp = get_compressor_from_config(cfg)
    assert (comp.fraction, comp.value_bits) == (0.05, 16)
    comp = get_compressor_from_config(CompressionConfig(scheme="linear", bits=1, linear_mode="minmax"))
    assert (comp.bits, comp.kind) == (1, "minmax")


def test_none_is_exact_and_bf16_rounds_to_nearest():
    x = torch.randn(17, 33) * torch.pow(10.0, torch.randint(-20, 20, (17, 33)).float())
    assert torch.equal(get_compressor("none").decode(get_compressor("none").encode(x)), x)
    y = get_compressor("bf16").decode(get_compressor("bf16").encode(x))
    assert torch.equal(y, x.bfloat16().float())
    assert ((y - x).abs() <= x.abs() * 2**-8).all()


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


def test_integer_and_non_tensor_input_are_refused():
    with pytest.raises(CompressionError, match="floating-point"):
        get_compressor("linear").encode(torch.arange(10))
    with pytest.raises(CompressionError, match="torch.Tensor"):
        get_compressor("linear").encode([1.0, 2.0])


def test_values_too_large_for_the_scales_raise_instead_of_garbage():
    x = torch.tensor([3.0e38, -3.0e38, 1.0, 0.0])
    for comp in [get_compressor("linear", 1, linear_mode="minmax"), get_compressor("statistical", 8)]:
        try:
            y = comp.decode(comp.encode(x))
        except CompressionError as e:
            assert "too large" in str(e)
        else:
            assert torch.isfinite(y).all()
    with pytest.raises(CompressionError, match="bf16"):
        get_compressor("bf16").encode(torch.tensor([3.4e38]))


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


def test_repr_names_the_settings():
    assert repr(get_compressor("statistical", 4)) == (
        "StatisticalQuantizer(bits=4, granularity='row', stat_range=3.75)"
    )
    assert "block_size=64" in repr(get_compressor("linear", 2, "block", 64))
