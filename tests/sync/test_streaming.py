"""Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512): fragments, staggered schedule, overlap tau,
mixing alpha, accounting, checkpoints with a sync in flight, and the WAN projection."""

import copy
import json
import signal
from pathlib import Path

import pytest
import torch
from test_helpers import params_of

from muloco.comm import ring_allreduce_bytes
from muloco.config import load_config
from muloco.data import ReplicaStream
from muloco.errors import UserError
from muloco.models import build_model
from muloco.optim import build_inner_optimizer
from muloco.run.lr_schedule import lr_multiplier
from muloco.run.replica import set_lr_multiplier
from muloco.run.trainer import Trainer
from muloco.sync.outer import nesterov_outer_step


def test_trainer_refuses_more_fragments_than_the_model_has_blocks(tiny):
    with pytest.raises(UserError, match="exceeds the model's 2 blocks"):
        Trainer(load_config(None, [*tiny, "sync.every=6", "sync.fragments=3"]))


# -- the engine against a step-by-step reference of the paper's algorithm --------------------------------


def _fragment_of(name: str) -> int:
    """Hand-written partition of the 3-block tiny model into P = 3 strided fragments."""
    if name.startswith("blocks."):
        return int(name.split(".")[1])
    return 0 if "emb" in name else 2


def reference_streaming(cfg, data, fragments):
    """Streaming DiLoCo written out step by step (all replicas per step; Algorithm 1 of arXiv:2501.18512):
    fragment p starts at steps s with s mod H == p H / P: delta = global_p - local_p, averaged over the K
    replicas; at s + tau the outer Nesterov step updates global_p and every replica merges
    local_p <- alpha local_p + (1 - alpha) global_p. At the last step in-flight syncs apply and every
    fragment with unsynced steps syncs once more."""
    K, H, tau, alpha = cfg.workers, cfg.sync.every, cfg.sync.overlap, cfg.sync.alpha
    T = cfg.total_steps
    template, replicas = _reference_replicas(cfg, data)
    names = [n for n, _ in template.named_parameters()]
    owner = [_fragment_of(n) if fragments == 3 else 0 for n in names]
    glob = [p.detach().clone() for p in template.parameters()]
    bufs = [torch.zeros_like(p) for p in glob]
    in_flight, dirty = [], [False] * fragments
    applied_at = []

    def apply(frag, mean, step):
        idx = [i for i in range(len(names)) if owner[i] == frag]
        nesterov_outer_step(
            [glob[i] for i in idx], mean, [bufs[i] for i in idx], cfg.outer.lr, cfg.outer.momentum
        )
        for model, _, _ in replicas:
            local = list(model.parameters())
            with torch.no_grad():
                for i in idx:
                    local[i].copy_(alpha * local[i] + (1 - alpha) * glob[i] if alpha else glob[i])
        dirty[frag] = alpha > 0
        applied_at.append((frag, step))

    for s in range(1, T + 1):
        _inner_step(cfg, replicas, s)
        dirty = [True] * fragments
        last = s == T
        for item in [f for f in in_flight if last or f[0] <= s]:
            in_flight.remove(item)
            apply(item[1], item[2], s)
        due = [p for p in range(fragments) if s % H == p * H // fragments]
        if last:
            due = [p for p in range(fragments) if dirty[p]]
        for p in due:
            idx = [i for i in range(len(names)) if owner[i] == p]
            total = [torch.zeros_like(glob[i]) for i in idx]
            for model, _, _ in replicas:
                local = list(model.parameters())
                for acc, i in zip(total, idx, strict=True):
                    acc.add_(glob[i] - local[i].detach())
            mean = [a / K for a in total]
            dirty[p] = False
            delay = 0 if last else tau
            if delay == 0:
                apply(p, mean, s)
            else:
                in_flight.append((s + delay, p, mean))
    return glob, applied_at


def _reference_replicas(cfg, data):
    """The seeded model and K replicas of it, each with its inner optimizer and its own data stream."""
    torch.manual_seed(cfg.run.seed)
    template = build_model(cfg.model, 256)
    replicas = []
    for r in range(cfg.workers):
        model = copy.deepcopy(template)
        stream = ReplicaStream(data.train, cfg.model.seq_len, r, cfg.workers, cfg.run.seed)
        replicas.append((model, build_inner_optimizer(model, cfg.inner), stream))
    return template, replicas


def _inner_step(cfg, replicas, s):
    """Inner step s on every replica (the run's lr schedule, gradient clipping)."""
    T, t = cfg.total_steps, cfg.train
    for model, opt, stream in replicas:
        set_lr_multiplier(opt, lr_multiplier(s - 1, T, t.warmup_steps, t.lr_schedule, t.min_lr_ratio))
        x, y = stream.next_batch(cfg.worker_batch_tokens // cfg.model.seq_len)
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)


def reference_delayed(cfg, data):
    """A whole window overlapped (tau = H, one fragment): the naive delayed update of Kale, Douillard and
    Donchev 2025 ("Eager updates for overlapped communication and computation in DiLoCo", arXiv
    2502.12996, Algorithm 2), written out: at the end of window k every replica's outer gradient
    Delta_k = theta - theta_k (theta: the global parameters the window started from) is sent, the mean of
    window k - 1's (arrived meanwhile; none after the first window) drives the outer Nesterov step, and
    every replica starts window k + 1 from the new theta. At the run's last step nothing is left in
    flight: the mean of window k - 1, then window k's, are applied."""
    H, T = cfg.sync.every, cfg.total_steps
    template, replicas = _reference_replicas(cfg, data)
    theta = [p.detach().clone() for p in template.parameters()]
    outer = torch.optim.SGD(theta, lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=True)

    def outer_step(mean):  # torch's SGD with Nesterov momentum: the outer step no one here wrote
        for p, g in zip(theta, mean, strict=True):
            p.grad = g
        outer.step()

    arrived, applied_at = None, []
    for s in range(1, T + 1):
        _inner_step(cfg, replicas, s)
        if s % H != 0 and s != T:
            continue
        deltas = [
            [g - p.detach() for g, p in zip(theta, m.parameters(), strict=True)] for m, _, _ in replicas
        ]
        mean = [sum(d) / cfg.workers for d in zip(*deltas, strict=True)]
        if arrived is not None:
            outer_step(arrived)
            applied_at.append(s)
        arrived = mean
        if s == T:
            outer_step(arrived)
            applied_at.append(s)
        for model, _, _ in replicas:
            with torch.no_grad():
                for p, g in zip(model.parameters(), theta, strict=True):
                    p.copy_(g)
    return theta, applied_at


def reference_eager(cfg, data):
    """A whole window overlapped with eager updates: Kale, Douillard and Donchev 2025, Algorithm 3, written
    out. Worker m keeps its own outer parameters theta_m and momentum; at the end of window k it sends
    Delta_m^k = theta_m - theta_m,k and steps theta_m at once with
    g_m = mean^{k-1} + (Delta_m^k - Delta_m^{k-1}) / K, then starts window k + 1 from theta_m. The run's
    consensus takes each mean when it arrives (a window late); at the last step both last means are
    applied to it and every replica ends on it."""
    H, T, K = cfg.sync.every, cfg.total_steps, cfg.workers
    template, replicas = _reference_replicas(cfg, data)
    consensus = [p.detach().clone() for p in template.parameters()]
    mine = [[p.clone() for p in consensus] for _ in range(K)]

    def sgd(params):  # torch's SGD with Nesterov momentum: the outer step no one here wrote
        return torch.optim.SGD(params, lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=True)

    def outer_step(optimizer, params, grad):
        for p, g in zip(params, grad, strict=True):
            p.grad = g.clone()
        optimizer.step()

    on_consensus, on_mine = sgd(consensus), [sgd(m) for m in mine]
    last, stale = [None] * K, None
    for s in range(1, T + 1):
        _inner_step(cfg, replicas, s)
        if s % H != 0 and s != T:
            continue
        deltas = [
            [t - p.detach() for t, p in zip(mine[m], model.parameters(), strict=True)]
            for m, (model, _, _) in enumerate(replicas)
        ]
        mean = [sum(d) / K for d in zip(*deltas, strict=True)]
        if stale is not None:
            outer_step(on_consensus, consensus, stale)
        if s == T:
            outer_step(on_consensus, consensus, mean)
            return consensus
        for m, (model, _, _) in enumerate(replicas):
            previous = last[m] or [torch.zeros_like(d) for d in deltas[m]]
            proxy = [
                (d - p) / K + (0 if stale is None else st)
                for d, p, st in zip(deltas[m], previous, stale or [None] * len(previous), strict=True)
            ]
            outer_step(on_mine[m], mine[m], proxy)
            last[m] = deltas[m]
            with torch.no_grad():
                for p, t in zip(model.parameters(), mine[m], strict=True):
                    p.copy_(t)
        stale = mean
    return consensus


STREAMING = ["workers=2", "train.batch_tokens=512", "inner.optimizer=adamw", "model.n_layers=3"]


@pytest.mark.parametrize("steps", [12, 14])
def test_eager_updates_equal_the_papers_algorithm(tiny, steps):
    overrides = ["sync.every=4", "sync.overlap=4", "sync.eager=true", f"train.total_tokens={512 * steps}"]
    cfg = load_config(None, [*tiny, *STREAMING, *overrides])
    trainer = Trainer(cfg)
    trainer.run()
    expected = reference_eager(cfg, trainer.data)
    for a, b in zip(expected, trainer.engine.outer.params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)
    for replica in trainer.replicas:  # every worker ends on the consensus
        assert all(
            torch.equal(p, g) for p, g in zip(params_of(replica.model), expected_of(trainer), strict=True)
        )


def expected_of(trainer):
    return [p.detach() for p in trainer.engine.outer.params]


def test_eager_updates_of_one_worker_are_plain_diloco_and_the_naive_ones_are_not(tiny):
    """K = 1: the eager proxy is the worker's own fresh pseudogradient, so the run is plain DiLoCo within
    rounding; the naive delayed update applies every mean a window late and ends elsewhere."""
    base = [
        *tiny,
        *STREAMING,
        "workers=1",
        "train.batch_tokens=256",
        "train.total_tokens=3072",
        "sync.every=4",
    ]
    runs = {}
    for name, extra in {
        "plain": [],
        "eager": ["sync.overlap=4", "sync.eager=true"],
        "naive": ["sync.overlap=4"],
    }.items():
        trainer = Trainer(load_config(None, [*base, f"run.name={name}", *extra]))
        trainer.run()
        runs[name] = expected_of(trainer)
    for a, b in zip(runs["plain"], runs["eager"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)
    gap = max((a - b).abs().max().item() for a, b in zip(runs["plain"], runs["naive"], strict=True))
    assert gap > 1e-3


@pytest.mark.parametrize("steps", [12, 14])  # the last window whole, or a tail of 2 steps
def test_a_whole_window_overlapped_equals_the_naive_delayed_update(tiny, steps):
    """tau = H: the sync started after window k is applied after window k + 1's inner steps."""
    overrides = ["sync.every=4", "sync.overlap=4", f"train.total_tokens={512 * steps}"]
    cfg = load_config(None, [*tiny, *STREAMING, *overrides])
    trainer = Trainer(cfg)
    trainer.run()
    expected, applied_at = reference_delayed(cfg, trainer.data)
    for a, b in zip(expected, trainer.engine.outer.params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # torch's SGD rounds its Nesterov step apart
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "sync"] == applied_at
    assert [r["started_step"] for r in records if r["kind"] == "sync"][:2] == [4, 8]


@pytest.mark.parametrize(
    "sync, fragments",
    [
        (["sync.every=3"], 1),  # plain DiLoCo, through the same reference
        (["sync.every=4", "sync.overlap=1"], 1),
        (["sync.every=6", "sync.fragments=3"], 3),
        (["sync.every=6", "sync.fragments=3", "sync.overlap=1", "sync.alpha=0.5"], 3),
    ],
)
def test_engine_equals_the_reference_algorithm(tiny, sync, fragments):
    cfg = load_config(None, [*tiny, *STREAMING, "train.total_tokens=7168", *sync])  # 14 steps: a tail
    trainer = Trainer(cfg)
    trainer.run()
    expected, applied_at = reference_streaming(cfg, trainer.data, fragments)
    for a, b in zip(expected, trainer.engine.outer.params, strict=True):
        if cfg.sync.alpha == 0:
            assert torch.equal(a, b)
        else:  # lerp_ and alpha a + (1 - alpha) b round differently in the last bit
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    syncs = [r for r in records if r["kind"] == "sync"]
    assert [(r.get("fragment", 0), r["step"]) for r in syncs] == applied_at
    assert trainer.progress.fragment_syncs == len(applied_at)


def test_plain_diloco_is_unchanged_by_streaming_defaults(tiny):
    """P = 1, tau = 0, alpha = 0 spelled out equals the config without a sync section, bit for bit."""
    base = [*tiny, *STREAMING]
    plain = Trainer(load_config(None, [*base, "run.name=plain"]))
    plain.run()
    spelled = Trainer(
        load_config(None, [*base, "run.name=spelled", "sync.fragments=1", "sync.overlap=0", "sync.alpha=0"])
    )
    spelled.run()
    for a, b in zip(plain.engine.outer.params, spelled.engine.outer.params, strict=True):
        assert torch.equal(a, b)


def test_a_delayed_sync_is_applied_tau_steps_after_it_started(tiny):
    cfg = load_config(
        None,
        [*tiny, *STREAMING, "train.total_tokens=7168", "sync.every=6", "sync.fragments=3", "sync.overlap=1"],
    )
    trainer = Trainer(cfg)
    trainer.run()
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    syncs = [r for r in records if r["kind"] == "sync"]
    regular = [r for r in syncs if r["step"] < trainer.total_steps]
    assert regular and all(r["step"] == r["started_step"] + 1 for r in regular)
    assert [r["fragment"] for r in regular[:3]] == [1, 2, 0]  # offsets 2, 4, 6 for H = 6, P = 3


def test_fragments_cut_the_peak_bytes_per_sync(tiny):
    base = [*tiny, *STREAMING, "sync.every=6"]
    plain = Trainer(load_config(None, [*base, "run.name=plain"])).run()
    streaming = Trainer(load_config(None, [*base, "run.name=streaming", "sync.fragments=3"])).run()
    ratio = streaming["peak_bytes_per_sync"] / plain["peak_bytes_per_sync"]
    assert 0.2 < ratio < 0.5  # ~1/3; fragments differ in size (embeddings + first block, head + last)
    # Total bytes: one fp32 ring all-reduce per fragment sync (the final flush adds the fragments that
    # started mid-round: 1, 2 at steps 2, 4, then 0, 1, 2 at step 6).
    run_dir = load_config(None, [*base, "run.name=streaming"]).run.output_dir
    records = [
        json.loads(x) for x in (Path(run_dir) / "streaming" / "metrics.jsonl").read_text().splitlines()
    ]
    payloads = [r["payload_bytes"] for r in records if r["kind"] == "sync"]
    assert [r["fragment"] for r in records if r["kind"] == "sync"] == [1, 2, 0, 1, 2]
    expected = sum(ring_allreduce_bytes(p, 2) for p in payloads)
    assert streaming["bytes_sent_per_worker"] == pytest.approx(expected)
    assert sum(payloads[2:]) == plain["payload_bytes_per_sync"]  # the fragments add up to the model


@pytest.mark.parametrize(
    "sync, tau",
    [
        (["sync.every=6", "sync.fragments=3", "sync.overlap=1", "sync.alpha=0.5"], 1),
        (["sync.every=4", "sync.overlap=4"], 4),  # a whole window: a sync is in flight at every checkpoint
        (["sync.every=4", "sync.overlap=4", "sync.eager=true"], 4),  # and each worker's own outer state
    ],
)
def test_checkpoint_with_a_sync_in_flight_resumes_exactly(tiny, tmp_path, sync, tau):
    """A stop right after a sync started (in flight for tau steps): the checkpoint drains the transfer and
    stores the mean; the resumed run applies it at the same step and ends bit for bit identical."""
    overrides = [*tiny, *STREAMING, *sync]
    full = Trainer(load_config(None, [*overrides, "run.name=full"]))
    full.run()

    interrupted = Trainer(load_config(None, [*overrides, "run.name=cut"]))
    original_round = interrupted.run_round

    def round_then_stop():
        original_round()
        if interrupted.engine.in_flight and interrupted.progress.steps >= 4:
            interrupted.stop.signal = signal.SIGTERM

    interrupted.run_round = round_then_stop
    summary = interrupted.run()
    assert summary["status"] == "interrupted" and interrupted.progress.steps < interrupted.total_steps
    resumed = Trainer(load_config(None, [*overrides, "run.name=cut"]))
    assert resumed.engine.in_flight and resumed.engine.in_flight[0].apply_step == resumed.progress.steps + tau
    assert resumed.run()["status"] == "completed"
    for a, b in zip(full.engine.outer.params, resumed.engine.outer.params, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(params_of(full.replicas[1].model), params_of(resumed.replicas[1].model), strict=True):
        assert torch.equal(a, b)


def test_compressed_streaming_runs_and_accounts_per_fragment(tiny):
    cfg = load_config(
        None,
        [
            *tiny,
            *STREAMING,
            "sync.every=6",
            "sync.fragments=3",
            "compression.scheme=statistical",
            "compression.bits=4",
            "compression.error_feedback=true",
        ],
    )
    summary = Trainer(cfg).run()
    assert summary["status"] == "completed" and summary["fragment_syncs"] >= 3
    assert 4 < summary["effective_bits_per_param"] < 12  # skipped norms travel in fp32 in a tiny model
    assert summary["peak_bytes_per_sync"] < summary["payload_bytes_per_sync"]


def test_wan_projection_hides_transfers_behind_the_overlap(tiny):
    base = [
        *tiny,
        *STREAMING,
        "sync.every=6",
        "sync.fragments=3",
        "backend.local.bandwidth_mbps=1",
        "backend.local.latency_ms=5",
    ]
    no_overlap = Trainer(load_config(None, [*base, "run.name=a"])).run()
    overlap = Trainer(load_config(None, [*base, "run.name=b", "sync.overlap=1"])).run()
    # Transfers: an all-reduce of each fragment's fp32 pseudogradient, 2 (K-1)/K x bytes at 1 Mbit/s (of
    # which 1448/1514 is payload: TCP over Ethernet), ~0.6 s a sync, which hides its 2K round trips of
    # 10 ms (muloco.net.wan: the longer of the two); the same in both runs.
    expected_network = 8 * no_overlap["bytes_sent_per_worker"] / (1e6 * 1448 / 1514)
    assert expected_network / no_overlap["fragment_syncs"] > 2 * no_overlap["workers"] * 0.01
    for s in (no_overlap, overlap):
        assert s["projected_network_s"] == pytest.approx(expected_network, rel=1e-3)
        assert s["projected_wall_s_no_overlap"] == pytest.approx(
            s["projected_compute_s"] + s["projected_network_s"], abs=2e-3
        )
    assert no_overlap["projected_wall_s"] == pytest.approx(
        no_overlap["projected_wall_s_no_overlap"], abs=2e-3
    )
    # With tau = 1 each transfer hides behind one inner step (at the measured step time), never below 0.
    assert (
        overlap["projected_compute_s"] < overlap["projected_wall_s"] < overlap["projected_wall_s_no_overlap"]
    )


def test_evaluation_uses_the_global_parameters(tiny):
    cfg = load_config(None, [*tiny, *STREAMING, "sync.every=6", "sync.fragments=3", "sync.alpha=0.5"])
    trainer = Trainer(cfg)
    trainer.run()
    before = params_of(trainer.replicas[0].model)
    trainer.log.metrics = type("Sink", (), {"log": lambda self, record: None})()
    evaluated = trainer.evaluate()
    assert all(torch.equal(a, b) for a, b in zip(before, params_of(trainer.replicas[0].model), strict=True))
    with torch.no_grad():
        model = copy.deepcopy(trainer.replicas[0].model)
        for p, g in zip(model.parameters(), trainer.engine.outer.params, strict=True):
            p.copy_(g)
        model.eval()
        losses = [model(x, y).item() for x, y in trainer.val_set]
    assert evaluated == pytest.approx(sum(losses) / len(losses), rel=1e-6)


def test_a_heal_under_eager_updates_restarts_each_workers_outer_state_from_the_consensus(tiny):
    """What a torchft heal hands over under eager updates: the consensus parameters and momentum (its
    export_state); the healed worker's own theta_m and u_m restart from them, with no delta of its own in
    any mean and its replicas on theta_m (tests/comm/test_torchft.py runs the heal over processes)."""
    overrides = ["sync.every=4", "sync.overlap=4", "sync.eager=true", f"train.total_tokens={512 * 10}"]
    trainer = Trainer(load_config(None, [*tiny, *STREAMING, *overrides]))
    trainer.run()
    engine = trainer.engine
    eager = engine.eager
    donor, meta = engine.export_state()
    donor = [t.clone().add_(0.25) for t in donor]  # another member's state: not this worker's
    eager.last_delta[0][0].fill_(1.0)
    engine.adopt_state(donor, meta, trainer.replicas)
    n = len(engine.outer.params)
    for position, replica in enumerate(trainer.replicas):
        assert all(torch.equal(a, b) for a, b in zip(eager.params[position], donor[:n], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(eager.momentum[position], donor[n:], strict=True))
        assert all(not d.any() for d in eager.last_delta[position])
        assert all(
            torch.equal(p, b) for p, b in zip(params_of(replica.model), eager.base(position), strict=True)
        )
    assert eager.last_mean == [None] * n and not eager.fresh
