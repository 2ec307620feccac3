"""Schemes none and bf16: exact and round-to-nearest."""

import pytest
import torch

from muloco.compress import CompressionError, get_compressor


def test_none_is_exact_and_bf16_rounds_to_nearest():
    x = torch.randn(17, 33) * torch.pow(10.0, torch.randint(-20, 20, (17, 33)).float())
    assert torch.equal(get_compressor("none").decode(get_compressor("none").encode(x)), x)
    y = get_compressor("bf16").decode(get_compressor("bf16").encode(x))
    assert torch.equal(y, x.bfloat16().float())
    assert ((y - x).abs() <= x.abs() * 2**-8).all()


def test_bf16_refuses_values_beyond_its_range():
    with pytest.raises(CompressionError, match="bf16"):
        get_compressor("bf16").encode(torch.tensor([3.4e38]))
