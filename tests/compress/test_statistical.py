"""Scheme statistical: settings in the repr, the default range, the lookup table on the wire."""

import pytest
import torch

from muloco.compress import DEFAULT_STAT_RANGE, CompressionError, get_compressor
from muloco.compress.wire import CRC_NBYTES, assemble, parse


def test_repr_names_the_settings():
    assert repr(get_compressor("statistical", 4)) == (
        "StatisticalQuantizer(bits=4, granularity='row', stat_range=3.75)"
    )


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_default_range_per_bits(bits):
    assert get_compressor("statistical", bits).stat_range == DEFAULT_STAT_RANGE[bits]
    assert get_compressor("statistical", bits, stat_range=2).stat_range == 2.0


def test_a_non_finite_lookup_table_is_malformed():
    comp = get_compressor("statistical", 2, "tensor")
    h, body = parse(comp.encode(torch.randn(4, 10)))
    lut_at = 4 + 2  # one group: fp32 offset, bf16 step, then the 4-entry fp32 table
    bad = bytearray(body)
    bad[lut_at : lut_at + 4] = torch.tensor([float("nan")]).numpy().tobytes()
    p = assemble(h, [bytes(bad)])
    assert len(p) == h.nbytes + h.body_nbytes + CRC_NBYTES
    with pytest.raises(CompressionError, match="lookup table"):
        comp.decode(p)
