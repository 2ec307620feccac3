"""What linear and statistical share (GroupQuantizer): huge values, the header check, the sections."""

import pytest
import torch

from muloco.compress import CompressionError, get_compressor
from muloco.compress.wire import body_layout


def test_values_too_large_for_the_scales_raise_instead_of_garbage():
    x = torch.tensor([3.0e38, -3.0e38, 1.0, 0.0])
    for comp in [get_compressor("linear", 1, linear_mode="minmax"), get_compressor("statistical", 8)]:
        try:
            y = comp.decode(comp.encode(x))
        except CompressionError as e:
            assert "too large" in str(e)
        else:
            assert torch.isfinite(y).all()


@pytest.mark.parametrize(
    "kw, other",
    [
        ({"bits": 4}, {"bits": 2}),
        ({"granularity": "row"}, {"granularity": "tensor"}),
        ({"granularity": "block", "block_size": 64}, {"granularity": "block", "block_size": 32}),
    ],
)
@pytest.mark.parametrize("scheme", ["linear", "statistical"])
def test_decode_checks_bits_granularity_and_block_size(scheme, kw, other):
    p = get_compressor(scheme, **kw).encode(torch.randn(8, 100))
    with pytest.raises(CompressionError, match="same compression config"):
        get_compressor(scheme, **other).decode(p)


@pytest.mark.parametrize(
    "scheme, kw, sections",
    [
        ("linear", {"linear_mode": "absmax"}, ["steps", "codes"]),
        ("linear", {"linear_mode": "minmax"}, ["offsets", "steps", "codes"]),
        ("statistical", {}, ["offsets", "steps", "lut", "codes"]),
    ],
)
def test_body_sections(scheme, kw, sections):
    h = get_compressor(scheme, **kw)._body_header((8, 100))
    assert [name for name, _ in body_layout(h)] == sections
