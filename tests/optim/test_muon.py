"""Muon against torch.optim.Muon, its lr scales, conv flattening, state and state_dict round-trip."""

import copy
import io
import math

import pytest
import torch
from torch.optim._muon import _adjust_lr as torch_adjust_lr

from muloco.optim import Muon, adjusted_lr, newton_schulz

SHAPES = {"tall": (96, 32), "wide": (32, 96), "square": (48, 48)}


def seeded(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon_over_10_steps(shape, adjust, nesterov):
    p0 = seeded(*shape)
    ours, ref = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov)
    opt = Muon([ours], **kw, ns_coefficients="keller", adjust_lr=adjust, ns_dtype=torch.float32)
    torch_opt = torch.optim.Muon([ref], **kw, adjust_lr_fn=adjust)
    for step in range(10):
        g = seeded(*shape, seed=step + 1)
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        torch_opt.step()
    # torch.optim.Muon always runs Newton-Schulz in bf16 (_zeropower_via_newtonschulz: grad.bfloat16(),
    # then normalizes in bf16), ours here in fp32. bf16 keeps 8 significant bits (unit roundoff 2^-8 ~ 0.4%)
    # and 15 rounded matmul outputs per call measure at ~0.5% of the update, so the total displacement
    # over 10 steps agrees to 2%, while one wrong coefficient, lr scale or momentum rule is off by >10%.
    ours_delta, ref_delta = (ours - p0).detach(), (ref - p0).detach()
    assert (ours_delta - ref_delta).norm() / ref_delta.norm() < 0.02


@pytest.mark.parametrize("shape", [(1536, 512), (512, 2048), (48, 48), (96, 32), (32, 96)])
def test_adjusted_lr_formulas_and_torch_equivalents(shape):
    rows, cols = shape
    assert adjusted_lr(0.02, shape, "spectral") == pytest.approx(0.02 * math.sqrt(rows / cols))
    assert adjusted_lr(0.02, shape, "original") == pytest.approx(0.02 * math.sqrt(max(1, rows / cols)))
    assert adjusted_lr(0.02, shape, "match_rms_adamw") == pytest.approx(0.02 * 0.2 * math.sqrt(max(shape)))
    for mode in ("original", "match_rms_adamw"):
        assert adjusted_lr(0.02, shape, mode) == pytest.approx(torch_adjust_lr(0.02, mode, torch.Size(shape)))
    with pytest.raises(ValueError, match="adjust_lr"):
        adjusted_lr(0.02, shape, "rms")


def test_zero_gradient_gives_zero_update_and_tiny_stays_finite():
    zero = torch.nn.Parameter(seeded(16, 48))
    tiny = torch.nn.Parameter(seeded(32, 48, seed=1))
    before = zero.detach().clone()
    opt = Muon([zero, tiny], lr=0.02)  # default ns dtype (bf16 on this kind of CPU)
    zero.grad = torch.zeros_like(zero)
    tiny.grad = torch.full_like(tiny, 1e-30)
    opt.step()
    assert torch.equal(zero.detach(), before)
    assert torch.isfinite(tiny).all() and torch.isfinite(opt.state[tiny]["momentum_buffer"]).all()


@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_weight_is_flattened_to_out_by_rest(channels_last):
    p0 = seeded(8, 4, 3, 3)  # (out, in, kh, kw) -> (8, 36)
    g = seeded(8, 4, 3, 3, seed=1)
    p = torch.nn.Parameter(p0.clone())
    if channels_last:
        p.data = p.data.to(memory_format=torch.channels_last)
        g = g.to(memory_format=torch.channels_last)
    opt = Muon([p], lr=0.05, adjust_lr="spectral", ns_dtype=torch.float32)
    p.grad = g
    opt.step()
    # First step: buffer = (1 - m) g and the Nesterov update is g (1 - m^2); NS removes the scale.
    ortho = newton_schulz(g.reshape(8, 36), "keller", 5, dtype=torch.float32)  # (8, 36)
    expected = p0 - 0.05 * math.sqrt(8 / 36) * ortho.reshape(8, 4, 3, 3)
    torch.testing.assert_close(p.detach(), expected, atol=1e-6, rtol=0)
    assert adjusted_lr(0.05, p.shape, "spectral") == pytest.approx(0.05 * math.sqrt(8 / 36))


def test_same_shape_batching_equals_one_matrix_at_a_time():
    shapes = [(24, 72), (24, 72), (72, 24), (24, 72), (40, 40)]
    batched = [torch.nn.Parameter(seeded(*s, seed=i)) for i, s in enumerate(shapes)]
    single = [torch.nn.Parameter(p.detach().clone()) for p in batched]
    opt = Muon(batched, lr=0.02, ns_coefficients="polar_express", ns_dtype=torch.float32)
    singles = [Muon([p], lr=0.02, ns_coefficients="polar_express", ns_dtype=torch.float32) for p in single]
    for step in range(3):
        for i, (a, b) in enumerate(zip(batched, single, strict=True)):
            a.grad = seeded(*a.shape, seed=100 * step + i)
            b.grad = a.grad.clone()
        opt.step()
        for o in singles:
            o.step()
    for a, b in zip(batched, single, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), atol=1e-6, rtol=0)


def test_state_is_one_momentum_buffer_per_parameter():
    params = [torch.nn.Parameter(seeded(*s)) for s in [(16, 48), (48, 16), (8, 4, 3, 3)]]
    opt = Muon(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert len(opt.state) == len(params)
    for p in params:
        assert set(opt.state[p]) == {"momentum_buffer"}
        assert opt.state[p]["momentum_buffer"].shape == p.shape


def run_steps(opt, params, steps):
    for step in steps:
        for i, p in enumerate(params):
            p.grad = seeded(*p.shape, seed=1000 * step + i)
        opt.step()


@pytest.mark.parametrize("coefficients", ["muloco", [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)]])
def test_state_dict_round_trip_continues_identically(coefficients):
    shapes = [(16, 48), (16, 48), (48, 16), (8, 4, 3, 3)]
    kw = dict(lr=0.02, weight_decay=0.01, ns_coefficients=coefficients, adjust_lr="spectral")
    params = [torch.nn.Parameter(seeded(*s, seed=i)) for i, s in enumerate(shapes)]
    opt = Muon(params, **kw)
    run_steps(opt, params, range(3))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    snapshot = [p.detach().clone() for p in params]
    run_steps(opt, params, range(3, 6))

    resumed = [torch.nn.Parameter(s.clone()) for s in snapshot]
    fresh = Muon(resumed, **kw)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer))
    run_steps(fresh, resumed, range(3, 6))
    for a, b in zip(params, resumed, strict=True):
        assert torch.equal(a.detach(), b.detach())
    assert copy.deepcopy(fresh.state_dict())["param_groups"] == opt.state_dict()["param_groups"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr": -1.0}, "lr"),
        ({"momentum": 1.0}, "momentum"),
        ({"ns_steps": 0}, "ns_steps"),
        ({"adjust_lr": "rms"}, "adjust_lr"),
        ({"ns_coefficients": "jordan"}, "ns_coefficients"),
        ({"ns_method": "fast"}, "ns_method"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], **kwargs)


def test_vectors_are_rejected():
    with pytest.raises(ValueError, match="2-D"):
        Muon([torch.nn.Parameter(torch.zeros(4))])


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])  # (out, in): wide and tall
def test_a_transposed_group_steps_the_weight_in_its_out_in_orientation(shape):
    """A weight stored (in, out) with `transposed` steps exactly as the (out, in) weight, transposed."""
    torch.manual_seed(0)
    upright = torch.nn.Parameter(torch.randn(shape))  # (out, in), as nn.Linear
    stored = torch.nn.Parameter(upright.detach().mT.clone())  # (in, out), as GPT-2's Conv1D
    a = Muon([upright], lr=0.05, weight_decay=0.1, ns_dtype=torch.float32)
    b = Muon([{"params": [stored], "transposed": True}], lr=0.05, weight_decay=0.1, ns_dtype=torch.float32)
    for _ in range(5):
        grad = torch.randn(shape)
        upright.grad, stored.grad = grad.clone(), grad.mT.clone()
        a.step()
        b.step()
        torch.testing.assert_close(stored.detach().mT, upright.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(b.state[stored]["momentum_buffer"].mT, a.state[upright]["momentum_buffer"])


def test_the_transposed_lr_scale_is_the_out_in_one():
    # spectral: lr sqrt(out / in); stepping the stored (in, out) shape would give the inverse.
    stored = torch.nn.Parameter(torch.zeros(16, 64))  # in=16, out=64
    opt = Muon([{"params": [stored], "transposed": True}], lr=1.0, ns_dtype=torch.float32)
    stored.grad = torch.randn(16, 64)
    opt.step()
    # An orthogonalized (64, 16) update has singular values ~1 (Keller's NS: 0.7-1.2): its spectral norm,
    # times sqrt(64 / 16) = 2, is the step's.
    step_norm = torch.linalg.matrix_norm(stored.detach(), ord=2).item()
    assert 2 * 0.6 < step_norm < 2 * 1.3, step_norm
