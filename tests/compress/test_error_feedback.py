"""Error feedback: what was sent tracks what was meant; the state survives a weights_only checkpoint."""

import io

import pytest
import torch

from muloco.compress import ErrorFeedback, decode, get_compressor


@pytest.mark.parametrize(
    "scheme, kw",
    [("statistical", {"bits": 2}), ("linear", {"bits": 1}), ("topk", {"topk_fraction": 0.05})],
)
def test_decay_one_residual_is_exactly_the_buffer(scheme, kw):
    """decay = alpha = 1: sum(delta) - sum(decoded) = e_T, every round."""
    comp = get_compressor(scheme, **kw)
    ef = ErrorFeedback(decay=1.0, alpha=1.0)
    g = torch.Generator().manual_seed(0)
    sent = meant = torch.zeros(8, 64, dtype=torch.float64)
    for _ in range(40):
        delta = torch.randn(8, 64, generator=g)
        sent = sent + decode(ef.encode("w", delta, comp)).double()
        meant = meant + delta.double()
        assert torch.allclose(meant - sent, ef.buffers["w"].double(), atol=1e-4)


def test_cumulative_sum_tracks_within_a_bound():
    """2-bit statistical with decay = 1: the residual stays bounded, while without feedback the error of the
    cumulative sum grows like sqrt(T)."""
    comp = get_compressor("statistical", 2)
    ef = ErrorFeedback(decay=1.0, alpha=1.0)
    g = torch.Generator().manual_seed(1)
    sent_ef = sent_plain = meant = torch.zeros(16, 128, dtype=torch.float64)
    worst = 0.0
    for _ in range(100):
        delta = torch.randn(16, 128, generator=g)
        meant = meant + delta.double()
        sent_ef = sent_ef + decode(ef.encode("w", delta, comp)).double()
        sent_plain = sent_plain + comp.decode(comp.encode(delta)).double()
        worst = max(worst, (meant - sent_ef).norm().item() / delta.norm().item())
    assert worst < 3.0  # bounded: independent of T
    assert (meant - sent_plain).norm().item() / delta.norm().item() > 2 * worst


def test_decay_and_alpha_follow_the_formula():
    comp = get_compressor("linear", 1)
    ef = ErrorFeedback(decay=0.9, alpha=0.5)
    d1, d2 = torch.randn(3, 7), torch.randn(3, 7)
    p1 = ef.encode("w", d1, comp)
    e1 = d1 - 0.5 * decode(p1)
    assert torch.allclose(ef.buffers["w"], e1)
    p2 = ef.encode("w", d2, comp)
    acc = 0.9 * e1 + d2
    assert torch.equal(decode(p2), comp.decode(comp.encode(acc)))
    assert torch.allclose(ef.buffers["w"], acc - 0.5 * decode(p2), atol=1e-6)


def test_buffers_are_per_name_and_shapes_are_checked():
    comp = get_compressor("statistical", 4)
    ef = ErrorFeedback()
    ef.encode("a", torch.randn(4, 4), comp)
    ef.encode("b", torch.randn(5), comp)
    assert set(ef.buffers) == {"a", "b"} and ef.buffers["b"].shape == (5,)
    with pytest.raises(ValueError, match="'a'"):
        ef.encode("a", torch.randn(3, 3), comp)


def test_state_dict_roundtrips_through_weights_only_load():
    comp = get_compressor("statistical", 2)
    ef = ErrorFeedback()
    for name in ("layer.0.w", "layer.1.w"):
        ef.encode(name, torch.randn(6, 10), comp)
    buf = io.BytesIO()
    torch.save(ef.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    ef2 = ErrorFeedback()
    ef2.load_state_dict(state)
    assert ef2.buffers.keys() == ef.buffers.keys()
    assert all(torch.equal(ef2.buffers[k], ef.buffers[k]) for k in ef.buffers)
    delta = torch.randn(6, 10)
    assert ef.encode("layer.0.w", delta, comp) == ef2.encode("layer.0.w", delta, comp)
    with pytest.raises(ValueError, match="buffers"):
        ef2.load_state_dict({"buffers": {"x": [1.0]}})


@pytest.mark.parametrize("kw, name", [({"decay": 1.5}, "ef_decay"), ({"alpha": -0.1}, "ef_alpha")])
def test_bad_hyperparameters(kw, name):
    with pytest.raises(ValueError, match=name):
        ErrorFeedback(**kw)
