"""The optimizer sections of the config: inner (with its AdamW), outer, and dp's gradient communication.

What `inner.optimizer` names, and whether its arguments suit it, is the optimizers' to say: muloco/optim/
check.py checks it where a config is loaded for a run (`muloco.load_config`, the CLI, a sweep's plan), so the
schema stays free of torch and of the optimizers' package."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from muloco.config.sections import Section


class AdamWConfig(Section):
    lr: float = Field(
        0.003, gt=0, description="AdamW lr (non-matrix parameters under Muon; all under adamw)."
    )
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"each beta must be in [0, 1), got {list(betas)}")
        return betas


class InnerConfig(Section):
    optimizer: str = Field(
        "muon",
        description="muon: our Muon on hidden matrices + AdamW on the rest (MuLoCo); adamw: AdamW on all "
        "(DiLoCo); sgd: SGD with momentum on all; torch_muon: torch.optim.Muon + AdamW (reference). Any "
        "other optimizer: a torch.optim class (NAdam, Adafactor, ...), a pytorch-optimizer name (lion, "
        "soap, ademamix, ...; the `optimizers` extra) or package.module:Class, built with lr=inner.lr and "
        "inner.kwargs (docs/optimizers.md).",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Constructor arguments of an optimizer that is not built in (e.g. {betas: [0.9, 0.99]}); "
        "checked against its signature. lr is inner.lr; the built-in ones use the fields here instead.",
    )
    route: Literal["auto", "all", "matrices"] = Field(
        "auto",
        description="Which parameters inner.optimizer updates. all: every one; matrices: the hidden "
        "matrices, with embeddings, head, norms and biases on AdamW (inner.adamw.*), as Muon has them. "
        "auto: matrices for muon and torch_muon, all for every other optimizer.",
    )
    lr: float = Field(0.02, gt=0, description="Muon (or SGD, or any other inner optimizer) learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Muon/SGD decoupled weight decay.")
    momentum: float = Field(0.95, ge=0, lt=1, description="Muon/SGD momentum.")
    nesterov: bool = Field(True, description="Nesterov momentum for Muon/SGD.")
    ns_steps: int = Field(5, gt=0, description="Newton-Schulz iterations.")
    ns_coefficients: str | list[tuple[float, float, float]] = Field(
        "keller", description="keller | muloco | polar_express, or a list of (a, b, c) triples."
    )
    ns_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="Newton-Schulz dtype. auto: bf16 on CUDA and on CPUs with native bf16 (2x faster "
        "here), else fp32; fp32 makes runs reproducible across layouts to ~1e-6.",
    )
    adjust_lr: Literal["spectral", "original", "match_rms_adamw"] = Field(
        "spectral", description="Muon per-matrix lr scale (see docs/optimizers.md)."
    )
    distributed_muon: bool = Field(
        True,
        description="With ranks_per_worker > 1: each Muon matrix's momentum and Newton-Schulz run on one "
        "owner rank of the worker, results all-gathered (false: every rank repeats them).",
    )
    muon_params: list[str] = Field(
        default_factory=list, description="Regexes of parameter names forced onto Muon (must be >= 2-D)."
    )
    adamw_params: list[str] = Field(
        default_factory=list, description="Regexes of parameter names forced onto AdamW."
    )
    adamw: AdamWConfig = Field(default_factory=AdamWConfig)

    @field_validator("ns_coefficients")
    @classmethod
    def _known_coefficients(cls, value: str | list) -> str | list:
        names = ("keller", "muloco", "polar_express")
        if isinstance(value, str) and value not in names:
            raise ValueError(f"unknown coefficient set {value!r}; use one of {', '.join(names)} or a list")
        if isinstance(value, list) and not value:
            raise ValueError("the list of (a, b, c) triples is empty")
        return value


class OuterConfig(Section):
    lr: float = Field(0.7, gt=0, description="Outer Nesterov SGD lr (DiLoCo/MuLoCo papers: 0.7).")
    momentum: float = Field(0.6, ge=0, lt=1, description="Outer momentum (MuLoCo: 0.6; DiLoCo: 0.8-0.9).")
    nesterov: bool = Field(True, description="Nesterov outer momentum.")
    offload: Literal["none", "cpu"] = Field("none", description="cpu: keep the fp32 global copy on the CPU.")


class DpConfig(Section):
    """method: dp's gradient communication: torch's DDP communication hooks (docs/wan.md)."""

    comm_hook: Literal["none", "bf16", "powersgd"] = Field(
        "none",
        description="none: gradients all-reduced in fp32 after the backward; bf16 | powersgd: torch's DDP "
        "with its bf16_compress_hook or powerSGD_hook (torch.distributed.algorithms.ddp_comm_hooks), over "
        "backend.kind=torch with one process per worker.",
    )
    bucket_mb: float | None = Field(
        None,
        gt=0,
        le=1024,
        description="Size of DDP's gradient buckets in MiB: each bucket's all-reduce starts once its "
        "gradients are ready, overlapping the rest of the backward, but costs its own round trips. "
        "None: torch's defaults (a 1 MiB first bucket, then 25 MiB). Where the maths runs, not what it "
        "is: not in the fingerprint.",
    )
    powersgd_rank: int = Field(
        4,
        ge=1,
        description="PowerSGD's matrix approximation rank (Vogels et al. 2019 use 1-4; torch's default: 1).",
    )
    powersgd_start_step: int = Field(
        10,
        ge=2,
        description="Steps of plain all-reduce before PowerSGD compresses (torch needs >= 2: DDP settles its "
        "buckets on the first step).",
    )
