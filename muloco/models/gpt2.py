"""The built-in GPT as Hugging Face GPT-2: the config and weights of a `GPT2LMHeadModel` that computes the
same function, for `muloco export`.

GPT-2 (Radford et al. 2019; transformers' GPT2LMHeadModel) has the built-in GPT's shape: learned token and
position embeddings, pre-norm blocks with one fused q/k/v projection, a GELU MLP, a final norm and a head.
The differences are settings or zeros: its norms are LayerNorms with a bias (ours: `model.norm: layernorm`,
no bias: exported as zero biases), its linear layers have biases (zeros), its `Conv1D` stores weights as
(in, out) (ours transposed), and its head is tied unless `tie_word_embeddings: false` (ours is untied).
RMSNorm has no GPT-2 counterpart: such a run is refused by `export_problem`, not approximated.
"""

from __future__ import annotations

from typing import Any

import torch


def export_problem(model_cfg) -> str | None:
    """Why a built-in GPT of these settings has no exact GPT-2 counterpart, or None."""
    if model_cfg.norm != "layernorm":
        return (
            f"model.norm={model_cfg.norm}: GPT-2, the Hugging Face architecture of the built-in GPT, has "
            "LayerNorm; train with model.norm=layernorm to export"
        )
    return None


def gpt2_config_values(model_cfg, vocab_size: int, eot: int | None) -> dict[str, Any]:
    """GPT2Config values of the built-in GPT of `model_cfg` (presets resolved) over `vocab_size` tokens."""
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": vocab_size,
        "n_positions": model_cfg.seq_len,
        "n_embd": model_cfg.d_model,
        "n_layer": model_cfg.n_layers,
        "n_head": model_cfg.n_heads,
        "n_inner": model_cfg.mlp_ratio * model_cfg.d_model,
        "activation_function": "gelu",  # exact (erf) GELU, as F.gelu's default; GPT-2's own is gelu_new
        "layer_norm_epsilon": 1e-5,  # nn.LayerNorm's default, which gpt.py uses
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,  # 1/sqrt(head size), as scaled_dot_product_attention
        "tie_word_embeddings": False,
        "bos_token_id": eot,
        "eos_token_id": eot,
    }


def gpt2_state_dict(params: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's state dict from the built-in GPT's parameters (names as in gpt.py)."""

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=params["tok_emb.weight"].dtype)

    out = {
        "transformer.wte.weight": params["tok_emb.weight"],
        "transformer.wpe.weight": params["pos_emb.weight"],
        "transformer.ln_f.weight": params["final_norm.weight"],
        "transformer.ln_f.bias": zeros(params["final_norm.weight"].numel()),
        "lm_head.weight": params["head.weight"],
    }
    for i in range(n_layers):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        if ours + "attn.qkv.weight" in params:
            qkv = params[ours + "attn.qkv.weight"]  # (3C, C): rows q, k, v as GPT-2's split of c_attn
        else:  # model.qkv: split
            qkv = torch.cat([params[ours + f"attn.{n}.weight"] for n in ("q", "k", "v")])
        linear = {  # GPT-2's Conv1D holds (in, out): ours transposed
            "attn.c_attn": qkv,
            "attn.c_proj": params[ours + "attn.proj.weight"],
            "mlp.c_fc": params[ours + "mlp.fc.weight"],
            "mlp.c_proj": params[ours + "mlp.proj.weight"],
        }
        for name, weight in linear.items():
            out[f"{theirs}{name}.weight"] = weight.t()
            out[f"{theirs}{name}.bias"] = zeros(weight.shape[0])
        for name, norm in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
            out[f"{theirs}{name}.weight"] = params[f"{ours}{norm}.weight"]
            out[f"{theirs}{name}.bias"] = zeros(params[f"{ours}{norm}.weight"].numel())
    return {name: tensor.detach().contiguous() for name, tensor in out.items()}
