import pytest
import torch

from muloco.config import MODEL_PRESETS, ModelConfig
from muloco.models import GPT, GPTConfig, ParamRole, build_model, infer_param_roles, param_roles


@pytest.mark.parametrize(
    "preset, low, high",
    [("pico", 1.5e5, 3e5), ("nano", 0.7e6, 1.3e6), ("micro", 2.5e6, 4e6), ("small", 8e6, 13e6)],
)
def test_presets_have_their_advertised_sizes(preset, low, high):
    model = build_model(ModelConfig(preset=preset), vocab_size=256)
    assert low < sum(p.numel() for p in model.parameters()) < high


def test_forward_shapes_and_initial_loss_near_uniform():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=2, n_heads=4))
    x = torch.randint(0, 256, (3, 32))
    assert model(x).shape == (3, 32, 256)
    loss = model(x, x)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.3  # ln 256 = 5.55


def test_attention_is_causal():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_layers=2, n_heads=2)).eval()
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256  # change only the future
    assert torch.allclose(model(x)[0, :10], model(y)[0, :10], atol=1e-6)


def test_roles_hook_matches_inference_and_keeps_embeddings_head_norms_off_matrices():
    model = build_model(ModelConfig(preset="nano"), 256)
    roles = param_roles(model)
    assert roles == infer_param_roles(model)
    assert roles["tok_emb.weight"] is ParamRole.EMBEDDING and roles["head.weight"] is ParamRole.HEAD
    assert roles["final_norm.weight"] is ParamRole.NORM
    matrices = [n for n, r in roles.items() if r is ParamRole.MATRIX]
    assert len(matrices) == 4 * MODEL_PRESETS["nano"][1]


def test_layernorm_option_builds():
    model = build_model(ModelConfig(preset="nano", norm="layernorm"), 256)
    assert isinstance(model.final_norm, torch.nn.LayerNorm)


def test_split_qkv_computes_what_the_fused_matrix_does():
    torch.manual_seed(0)
    fused = GPT(GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_layers=2, n_heads=2))
    split = GPT(GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_layers=2, n_heads=2, qkv="split"))
    state = {}
    for name, p in fused.state_dict().items():
        if name.endswith("attn.qkv.weight"):  # (3C, C) rows: q, then k, then v
            for part, rows in zip("qkv", p.chunk(3), strict=True):
                state[name.replace("qkv", part)] = rows
        else:
            state[name] = p
    split.load_state_dict(state)
    x = torch.randint(0, 256, (2, 16))
    assert torch.allclose(fused(x), split(x), atol=1e-5)
    matrices = [n for n, r in param_roles(split).items() if r is ParamRole.MATRIX]
    assert len(matrices) == 6 * 2  # q, k, v, proj, fc, proj per block: each its own Muon matrix
