"""The CUDA paths a CPU cannot run: bf16 autocast, offload with prefetch on a side stream, Muon's bf16
Newton-Schulz on the GPU, batched replicas, nccl, distributed Muon, compile.

`pytest -m cuda` selects them; without CUDA they are skipped with the reason. experiments/gpu/check.sh
runs them first on a GPU machine.
"""

import json
import subprocess
import sys

import pytest
import torch

from muloco.config import load_config
from muloco.optim import Muon
from muloco.run.trainer import Trainer

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (experiments/gpu/check.sh runs these)"
    ),
]

GPU = [
    "device=cuda",
    "model.preset=nano",
    "model.seq_len=64",
    "train.batch_tokens=2048",
    "train.total_tokens=40960",
    "train.eval_every=0",
    "train.eval_tokens=4096",
    "train.warmup_steps=3",
    "logging.progress=off",
    "sync.every=5",
]
PROCESS_TIMEOUT_S = 240


@pytest.fixture
def gpu(tmp_path):
    return [*GPU, f"run.output_dir={tmp_path / 'runs'}"]


def trainer_for(overrides, fp32_matmuls=False):
    trainer = Trainer(load_config(None, overrides))
    if fp32_matmuls:  # resolve_device turns TF32 on for training; parity checks want true fp32
        torch.backends.cuda.matmul.allow_tf32 = False
    return trainer


def global_params(trainer):
    return [p.detach().float().cpu() for p in trainer.engine.global_params]


def test_bf16_autocast_run_learns(gpu):
    trainer = trainer_for([*gpu, "workers=4", "train.precision=bf16", "run.name=bf16"])
    summary = trainer.run()
    assert summary["status"] == "completed" and str(summary["device"]).startswith("cuda")
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.5


def test_offload_changes_nothing_and_holds_about_one_replica(gpu):
    common = [*gpu, "workers=8", "model.preset=micro", "outer.offload=cpu"]
    plain = trainer_for([*common, "simulation.batched=false", "run.name=plain"])
    plain.run()
    offloaded = trainer_for([*common, "simulation.offload=true", "run.name=offload"])
    assert offloaded.offload is not None and not offloaded.batched
    offloaded.run()
    for a, b in zip(global_params(plain), global_params(offloaded), strict=True):
        assert torch.equal(a, b)  # the same kernels on the same data: only where replicas wait differs

    def peak_mb(overrides):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        trainer_for(overrides).run()
        return torch.cuda.max_memory_allocated() / 2**20

    per_worker = ["train.batch_tokens=256", "train.total_tokens=5120"]  # 4 sequences of 64 per worker
    one = peak_mb([*common, *per_worker, "workers=1", "run.name=one"])
    eight = peak_mb([*common, "train.total_tokens=40960", "simulation.offload=true", "run.name=eight"])
    # By design: the active replica, the next one arriving, and the activations of one.
    assert eight <= 1.5 * one, f"K=8 with offload peaks at {eight:.0f} MB, one replica at {one:.0f} MB"


@pytest.mark.parametrize("shape", [(384, 128), (128, 512), (256, 256)])
def test_muon_on_cuda_matches_torch_muon(shape):
    gen = torch.Generator(device="cuda").manual_seed(0)
    p0 = torch.randn(*shape, device="cuda", generator=gen)
    ours, ref = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    opt = Muon([ours], **kw, adjust_lr="original")  # bf16 Newton-Schulz on CUDA, as torch's
    torch_opt = torch.optim.Muon([ref], **kw, adjust_lr_fn="original")
    for _ in range(10):
        g = torch.randn(*shape, device="cuda", generator=gen)
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        torch_opt.step()
    # Both iterate in bf16 (tests/optim/test_muon.py explains the 2% band over 10 steps).
    ours_delta, ref_delta = (ours - p0).detach(), (ref - p0).detach()
    assert (ours_delta - ref_delta).norm() / ref_delta.norm() < 0.02


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_batched_equals_sequential_on_cuda(gpu, optimizer):
    common = [
        *gpu,
        "workers=4",
        "train.precision=fp32",
        "inner.ns_dtype=fp32",
        f"inner.optimizer={optimizer}",
    ]
    sequential = trainer_for([*common, "simulation.batched=false", "run.name=seq"], fp32_matmuls=True)
    sequential.run()
    batched = trainer_for([*common, "simulation.batched=true", "run.name=bat"], fp32_matmuls=True)
    assert batched.batched
    batched.run()
    for a, b in zip(global_params(sequential), global_params(batched), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def _launch(nproc, overrides, tmp_path, name):
    cmd = [sys.executable, "-m", "muloco", "launch", "--nproc", str(nproc), "configs/quickstart.yaml"]
    cmd += [*overrides, "backend.torch.dist_backend=nccl", f"run.name={name}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / "runs" / name / "summary.json").read_text())


def test_nccl_one_process_equals_the_local_run(gpu, tmp_path):
    local = trainer_for([*gpu, "workers=1", "run.name=local"]).run()
    launched = _launch(1, [*gpu, "workers=1"], tmp_path, "nccl1")
    assert launched["status"] == "completed"
    assert launched["final_val_loss"] == pytest.approx(local["final_val_loss"], rel=1e-5)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_two_processes_equal_the_simulation(gpu, tmp_path):
    simulated = trainer_for([*gpu, "workers=2", "run.name=sim"]).run()
    launched = _launch(2, [*gpu, "workers=2"], tmp_path, "nccl2")
    assert launched["final_val_loss"] == pytest.approx(simulated["final_val_loss"], rel=1e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one per rank of the worker)")
def test_distributed_muon_on_cuda_equals_one_rank(gpu, tmp_path):
    one = trainer_for([*gpu, "workers=1", "run.name=one", "train.micro_batch_tokens=1024"]).run()
    ranks = [*gpu, "workers=1", "ranks_per_worker=2", "train.micro_batch_tokens=1024"]
    two = _launch(2, ranks, tmp_path, "dmuon")
    assert two["final_val_loss"] == pytest.approx(one["final_val_loss"], rel=1e-3)


def test_compiled_replicas_train_like_eager_on_cuda(gpu):
    eager = trainer_for([*gpu, "workers=2", "run.name=eager"]).run()
    compiled = trainer_for([*gpu, "workers=2", "run.name=compiled", "model.compile=true"]).run()
    assert compiled["final_val_loss"] == pytest.approx(eager["final_val_loss"], rel=1e-2)
