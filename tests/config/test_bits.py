"""The allowed bit widths (muloco/config/bits.py): one definition, used by the config and the compressors."""

import subprocess
import sys

import pytest

from muloco.compress import get_compressor
from muloco.config import CompressionConfig
from muloco.config.bits import QUANT_BITS, TOPK_VALUE_BITS, one_of


def test_one_of():
    assert one_of(QUANT_BITS) == "1, 2, 4 or 8"
    assert one_of(TOPK_VALUE_BITS) == "2, 4, 8, 16 or 32"
    assert one_of((3,)) == "3"


def test_config_and_compressors_accept_the_same_widths():
    for bits in QUANT_BITS:
        assert get_compressor("linear", bits).bits == CompressionConfig(bits=bits).bits == bits
    for bits in TOPK_VALUE_BITS:
        assert get_compressor("topk", topk_value_bits=bits).value_bits == bits
        assert CompressionConfig(topk_value_bits=bits).topk_value_bits == bits
    with pytest.raises(ValueError, match="bits must be 1, 2, 4 or 8, got 3"):
        CompressionConfig(bits=3)
    with pytest.raises(ValueError, match="topk_value_bits must be 2, 4, 8, 16 or 32, got 3"):
        CompressionConfig(topk_value_bits=3)


def test_loading_the_config_schema_does_not_import_torch():
    code = "import sys, muloco.config; assert 'torch' not in sys.modules, 'muloco.config imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
