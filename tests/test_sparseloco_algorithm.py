"""SparseLoCo as its paper and its authors' code write it, implemented here, against the engine run as the
configuration that names it (configs/sparseloco.yaml's outer rule and codec; issue 61).

The reference is written from SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706), Algorithm 1, and the
initial commit of its code (tplr/sparseloco.py), without muloco's codec, aggregate or outer step:

- each worker takes H inner steps (AdamW, torch's) from the global parameters; delta_w = theta - theta_w;
- error feedback in the role of outer momentum: e_w <- beta e_w + delta_w; C_w = the top k of every chunk
  of e_w (a matrix in tiles of each dimension's largest divisor <= 64, a vector in such runs; k =
  max(1, round(chunk_len x density))); e_w <- e_w - C_w;
- the aggregate: each coordinate's mean over the workers whose C_w holds it;
- the outer step: plain SGD, theta <- theta - lr x aggregate (no momentum).

Values travel at 32 bits here, so the comparison is exact; the 2-bit values of the paper are the codec's
own business (tests/compress/test_topk_chunked.py).
"""

import copy

import pytest
import torch
from test_paper_algorithm import schedule

from muloco.config import load_config
from muloco.data import ReplicaStream
from muloco.models import build_model
from muloco.run.trainer import Trainer

DENSITY, BETA, SIDE = 1 / 32, 0.95, 64

SPARSELOCO = [
    "inner.optimizer=adamw",
    "inner.adamw.lr=0.003",
    "outer.lr=1.0",
    "outer.momentum=0.0",
    "outer.nesterov=false",
    "compression.scheme=topk",
    "compression.topk_chunk=4096",
    f"compression.topk_fraction={DENSITY}",
    "compression.topk_value_bits=32",
    "compression.error_feedback=true",
    f"compression.ef_decay={BETA}",
    "compression.skip=[]",  # every tensor sparse, as the reference
    "sync.aggregate=sender_mean",
]


def divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def chunk_topk(e: torch.Tensor) -> torch.Tensor:
    """The top k (by magnitude) of every tile of `e`, the rest 0, tile by tile."""
    m = e.reshape(e.shape[0], -1) if e.dim() >= 2 else e.reshape(1, -1)
    tr = divisor_at_most(m.shape[0], SIDE) if e.dim() >= 2 else 1
    tc = divisor_at_most(m.shape[1], SIDE)
    out = torch.zeros_like(m)
    for i in range(0, m.shape[0], tr):
        for j in range(0, m.shape[1], tc):
            tile = m[i : i + tr, j : j + tc]
            k = max(1, round(tile.numel() * DENSITY))
            keep = tile.abs().flatten().topk(k).indices
            flat = torch.zeros(tile.numel())
            flat[keep] = tile.flatten()[keep]
            out[i : i + tr, j : j + tc] = flat.view(tile.shape)
    return out.view(e.shape)


class AdamWReplica:
    def __init__(self, model, cfg, stream):
        self.model, self.stream, self.step_count = model, stream, 0
        a = cfg.inner.adamw
        self.opt = torch.optim.AdamW(
            model.parameters(), lr=a.lr, betas=tuple(a.betas), eps=a.eps, weight_decay=a.weight_decay
        )
        self.lr = a.lr

    def inner_step(self, cfg):
        t = cfg.train
        factor = schedule(self.step_count, cfg.total_steps, t.warmup_steps, t.min_lr_ratio)
        x, y = self.stream.next_batch(cfg.worker_batch_tokens // cfg.model.seq_len)
        self.model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        for group in self.opt.param_groups:
            group["lr"] = self.lr * factor
        self.opt.step()
        self.model.zero_grad(set_to_none=True)
        self.step_count += 1


def paper_sparseloco(cfg, train_tokens):
    torch.manual_seed(cfg.run.seed)
    init = build_model(cfg.model, 256)
    theta = [p.detach().clone() for p in init.parameters()]
    K, H = cfg.workers, cfg.sync.every
    replicas = [
        AdamWReplica(
            copy.deepcopy(init), cfg, ReplicaStream(train_tokens, cfg.model.seq_len, k, K, cfg.run.seed)
        )
        for k in range(K)
    ]
    errors = [[torch.zeros_like(t) for t in theta] for _ in range(K)]
    for _ in range(cfg.total_steps // H):
        for replica in replicas:
            for _ in range(H):
                replica.inner_step(cfg)
        with torch.no_grad():
            sent = []
            for replica, error in zip(replicas, errors, strict=True):
                parts = []
                for t, p, e in zip(theta, replica.model.parameters(), error, strict=True):
                    e.mul_(BETA).add_(t - p)
                    c = chunk_topk(e)
                    e.sub_(c)
                    parts.append(c)
                sent.append(parts)
            for i, t in enumerate(theta):
                total = sum(parts[i] for parts in sent)
                senders = sum((parts[i] != 0).float() for parts in sent)
                t.sub_(cfg.outer.lr * total / senders.clamp(min=1))
            for replica in replicas:
                for p, t in zip(replica.model.parameters(), theta, strict=True):
                    p.copy_(t)
    return theta


@pytest.mark.parametrize("workers", [2, 3])
def test_engine_matches_sparseloco(tiny, workers):
    cfg = load_config(
        None,
        [
            *tiny,
            *SPARSELOCO,
            f"workers={workers}",
            f"train.batch_tokens={192 * workers}",
            "sync.every=3",
            f"train.total_tokens={192 * workers * 12}",  # 12 inner steps: 4 outer steps
            "train.warmup_steps=4",
            "train.eval_every=1000",
        ],
    )
    trainer = Trainer(cfg)
    start = [p.detach().clone() for p in trainer.engine.outer.params]
    summary = trainer.run()
    assert summary["outer_steps"] == 4 and summary["transport"] == "all_gather"
    reference = paper_sparseloco(cfg, trainer.data.train)
    for name, ours, theirs, before in zip(
        trainer.engine.outer.names, trainer.engine.outer.params, reference, start, strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        assert not torch.equal(ours, before), f"{name} never moved: the comparison would prove nothing"
