"""get_compressor and the registry: argument validation, the config path, every scheme registered."""

import pytest

import muloco.compress
from muloco.compress import get_compressor, get_compressor_from_config, registered_schemes
from muloco.compress.base import scheme_class
from muloco.compress.wire import SCHEMES
from muloco.config import CompressionConfig


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
        ({"scheme": "topk", "topk_value_bits": 3}, "topk_value_bits"),
        ({"scheme": "topk", "topk_chunk": 4000}, "topk_chunk"),
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


def test_registry_lists_every_scheme():
    assert registered_schemes() == SCHEMES == ("none", "bf16", "linear", "statistical", "topk")
    for scheme in SCHEMES:
        cls = scheme_class(scheme)
        assert cls.scheme == scheme and type(get_compressor(scheme)) is cls


@pytest.mark.parametrize("lookup", [get_compressor, scheme_class])
def test_unknown_scheme_names_the_allowed_ones(lookup):
    with pytest.raises(
        ValueError, match=r"scheme must be one of none, bf16, linear, statistical, topk; got 'zip'"
    ):
        lookup("zip")


def test_every_public_name_imports():
    assert sorted(muloco.compress.__all__) == sorted(muloco.compress._EXPORTS)
    for name in muloco.compress.__all__:
        assert getattr(muloco.compress, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        muloco.compress.nonexistent  # noqa: B018
