"""The compression adapter (muloco/comm/hivemind/payloads.py): muloco payloads in hivemind tensor messages."""

import pytest
import torch

pytest.importorskip("hivemind")

from hivemind.compression import CompressionInfo, deserialize_torch_tensor  # noqa: E402

from muloco.comm.hivemind import MulocoCompression, unwrap_payload, wrap_payload  # noqa: E402
from muloco.compress import CompressionError, get_compressor  # noqa: E402


@pytest.mark.parametrize(
    "scheme, bits, rel_err", [("none", 8, 0.0), ("statistical", 4, 0.2), ("statistical", 8, 0.04)]
)
def test_compression_adapter_round_trip(scheme, bits, rel_err):
    comp = get_compressor(scheme, bits=bits, granularity="row")
    adapter = MulocoCompression(comp)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    message = adapter.compress(x, CompressionInfo.from_tensor(x))
    assert adapter.extract(message).shape == x.shape
    assert torch.equal(adapter.extract(message), comp.decode(comp.encode(x)))  # exactly our codec
    assert (adapter.extract(message) - x).norm() <= rel_err * x.norm()
    # hivemind's own deserializer reads the message as the payload bytes, never as misread values.
    raw = deserialize_torch_tensor(message)
    assert raw.dtype == torch.uint8 and raw.numpy().tobytes() == comp.encode(x)
    ratio = adapter.estimate_compression_ratio(CompressionInfo.from_tensor(x))
    assert ratio == pytest.approx(comp.payload_nbytes(x.shape) / (4 * x.numel()))


def test_compression_adapter_rejects_foreign_or_corrupt_messages():
    adapter = MulocoCompression(get_compressor("statistical", bits=4))
    payload = bytearray(adapter.compressor.encode(torch.randn(4, 8)))
    payload[-1] ^= 0xFF  # the CRC no longer matches
    with pytest.raises(CompressionError):
        adapter.extract(wrap_payload(bytes(payload)))
    from hivemind.compression import NoCompression as HivemindNoCompression

    fp32 = HivemindNoCompression().compress(torch.ones(3), CompressionInfo.from_tensor(torch.ones(3)))
    with pytest.raises(CompressionError, match="uint8"):
        unwrap_payload(fp32)
    # A payload compressed with other settings: the workers disagree on the compression config.
    other = get_compressor("statistical", bits=8).encode(torch.randn(4, 8))
    with pytest.raises(CompressionError, match="same compression config"):
        adapter.extract(wrap_payload(other))
