"""A compact GPT: pre-norm blocks, LayerNorm or RMSNorm, causal SDPA attention, GELU MLP, untied head.

Shapes follow nanoGPT: B batch, T time, C = d_model, nh heads, hs = C / nh head size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from muloco.models.norms import LayerNorm
from muloco.models.roles import ParamRole


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    norm: str = "layernorm"  # the schema's default: GPT-2's norm, so the model exports (gpt2.py)
    qkv: str = "fused"  # fused: one (3C, C) matrix; split: three (C, C) ones, as Llama's wq, wk, wv


def _norm(kind: str, dim: int) -> nn.Module:
    # norms.LayerNorm: nn.LayerNorm's outputs, with gradients that are the same bits at any thread count.
    return nn.RMSNorm(dim, eps=1e-6) if kind == "rmsnorm" else LayerNorm(dim, bias=False)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        # Muon orthogonalizes each matrix as a whole: fused, Q, K and V share one set of singular
        # directions and one spectral lr scale sqrt(3C / C); split, each is its own (C, C) matrix.
        if cfg.qkv == "split":
            self.q, self.k, self.v = (nn.Linear(cfg.d_model, cfg.d_model, bias=False) for _ in range(3))
        else:
            self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(x).split(C, dim=2)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q, k, v = (
            t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v)
        )  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = _norm(cfg.norm, cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = _norm(cfg.norm, cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.final_norm = _norm(cfg.norm, cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # GPT-2 init: N(0, 0.02); residual output projections scaled by 1/sqrt(2 * n_layers) so the
        # residual stream's variance does not grow with depth (Radford et al. 2019, nanoGPT).
        for name, p in self.named_parameters():
            if p.ndim < 2:
                continue
            std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if name.endswith("proj.weight") else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    def param_roles(self) -> dict[str, ParamRole]:
        roles = {}
        for name, p in self.named_parameters():
            if name.startswith(("tok_emb", "pos_emb")):
                roles[name] = ParamRole.EMBEDDING
            elif name.startswith("head"):
                roles[name] = ParamRole.HEAD
            elif "norm" in name:
                roles[name] = ParamRole.NORM
            else:
                roles[name] = ParamRole.MATRIX if p.ndim >= 2 else ParamRole.SCALAR
        return roles

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab), or the mean cross-entropy loss when targets are given."""
        B, T = idx.shape
        assert T <= self.cfg.seq_len, f"{T=} exceeds {self.cfg.seq_len=}"
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.final_norm(x))  # (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def build_gpt(model_cfg, vocab_size: int) -> GPT:
    """A GPT from the `model:` config section (presets already resolved by the schema)."""
    return GPT(
        GPTConfig(
            vocab_size=vocab_size,
            seq_len=model_cfg.seq_len,
            d_model=model_cfg.d_model,
            n_layers=model_cfg.n_layers,
            n_heads=model_cfg.n_heads,
            mlp_ratio=model_cfg.mlp_ratio,
            norm=model_cfg.norm,
            qkv=model_cfg.qkv,
        )
    )
