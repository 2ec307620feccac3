"""Scheme linear: settings in the repr and on the wire, no lookup table sent."""

import pytest
import torch

from muloco.compress import CompressionError, LinearQuantizer, get_compressor, read_header


def test_repr_names_the_settings():
    assert "block_size=64" in repr(get_compressor("linear", 2, "block", 64))
    assert repr(LinearQuantizer(4, mode="minmax")) == (
        "LinearQuantizer(bits=4, granularity='row', linear_mode='minmax')"
    )


def test_mode_travels_and_is_checked():
    x = torch.randn(5, 30)
    p = get_compressor("linear", 4, linear_mode="minmax").encode(x)
    assert read_header(p).mode == 1  # LINEAR_MODES.index("minmax")
    with pytest.raises(CompressionError, match="same compression config"):
        get_compressor("linear", 4, linear_mode="absmax").decode(p)


def test_absmax_error_is_within_half_a_step():
    x = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    comp = get_compressor("linear", 8)
    y = comp.decode(comp.encode(x))
    step = x.abs().amax(dim=1, keepdim=True) / 127  # before the bf16 round-up of the step
    assert ((y - x).abs() <= step / 2 * (1 + 2**-7) + 1e-7).all()
