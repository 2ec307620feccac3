"""Batched quantization (compress/many.py): the same bytes and values as one tensor at a time."""

from __future__ import annotations

import pytest
import torch

from muloco.compress import CompressionError, ErrorFeedback, get_compressor
from muloco.compress.many import BATCH_MAX, quantize_many
from muloco.compress.quantize import quantize
from muloco.sync.codec import decode_each, encode_payloads, pack

# Vectors, matrices of several row lengths, odd sizes (a partial block, a partial byte), a 3-D tensor, a
# scalar, an empty tensor and one above BATCH_MAX (quantized alone), in one list.
SHAPES = [(64, 256), (256, 64), (64,), (7,), (3, 5, 7), (1000,), (300, 33), (0,), (), (2, 20000), (513,)]
CASES = [
    ("statistical", {}, "statistical"),
    ("linear", {"linear_mode": "absmax"}, "absmax"),
    ("linear", {"linear_mode": "minmax"}, "minmax"),
]


def tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(shape, generator=g) * (i + 1) for i, shape in enumerate(SHAPES)]
    xs[5][::7] = 0.0  # repeated values: empty bins and zero steps in places
    xs.append(torch.zeros(40, 8))  # all-zero rows
    return xs


def test_one_tensor_is_above_the_batch_bound():
    assert any(x.numel() > BATCH_MAX for x in tensors())


@pytest.mark.parametrize("kind", ["statistical", "absmax", "minmax"])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("granularity", ["row", "block", "tensor"])
def test_quantize_many_equals_quantize_on_each_tensor(kind, bits, granularity):
    xs = tensors()
    qs, _ = quantize_many(xs, bits, kind, granularity, block_size=100)
    for x, q in zip(xs, qs, strict=True):
        ref = quantize(x, bits, kind, granularity, 100)
        assert torch.equal(ref.codes, q.codes), x.shape
        assert torch.equal(ref.steps.view(torch.int16), q.steps.view(torch.int16)), x.shape
        assert (ref.offsets is None) == (q.offsets is None)
        if ref.offsets is not None:
            assert torch.equal(ref.offsets, q.offsets), x.shape
        assert torch.equal(ref.lut, q.lut), x.shape


@pytest.mark.parametrize(("scheme", "options", "_"), CASES)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("granularity", ["row", "block"])
def test_encoded_values_and_batched_decode_equal_decode(scheme, options, _, bits, granularity):
    comp = get_compressor(scheme, bits=bits, granularity=granularity, block_size=100, **options)
    xs = tensors(1)
    payloads, values = comp.encode_with_decoded(xs)
    assert payloads == [comp.encode(x) for x in xs]  # a batch sends what one tensor at a time sends
    for p, v, d in zip(payloads, values, comp.decode_many(payloads), strict=True):
        ref = comp.decode(p)
        assert torch.equal(ref, v) and torch.equal(ref, d)


def test_error_feedback_in_a_batch_keeps_what_each_send_keeps():
    comp = get_compressor("statistical", bits=2, granularity="row")
    xs = tensors(2)
    one, many = ErrorFeedback(), ErrorFeedback()
    singles = [one.encode(str(i), x, comp) for i, x in enumerate(xs)]
    buffers = [many.accumulate(str(i), x) for i, x in enumerate(xs)]
    assert many.send_many(buffers, comp) == singles
    for name in one.buffers:
        assert torch.equal(one.buffers[name], many.buffers[name])


def test_a_malformed_payload_in_a_batch_raises():
    comp = get_compressor("statistical", bits=4, granularity="row")
    payloads = comp.encode_many(tensors())
    bad = bytearray(payloads[2])
    bad[-1] ^= 0xFF  # the CRC
    with pytest.raises(CompressionError, match="CRC32"):
        comp.decode_many([*payloads[:2], bytes(bad), *payloads[3:]])


def test_decode_each_names_the_message_that_does_not_decode():
    comp = get_compressor("linear", bits=4, granularity="row")
    xs = tensors()
    shapes, names = [x.shape for x in xs], [str(i) for i in range(len(xs))]
    message = pack(encode_payloads(xs, [comp] * len(xs), [False] * len(xs), None))
    broken = message[:-5]  # truncated
    out = decode_each([message, broken, message], [comp] * len(xs), names, shapes)
    assert isinstance(out[1], CompressionError)
    for decoded in (out[0], out[2]):
        assert all(torch.equal(d, comp.decode(comp.encode(x))) for d, x in zip(decoded, xs, strict=True))
