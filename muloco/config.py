"""The config schema: the single source of truth for every option (DESIGN.md, "Config keys").

Loading goes YAML file -> `extends:` chain merged -> dotted `KEY=VALUE` overrides -> pydantic validation.
Every failure becomes a `ConfigError` whose one-line message names the field (dotted path) and the fix.
docs/configuration.md is generated from these classes by scripts/gen_config_docs.py.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from muloco.compress.bits import QUANT_BITS, TOPK_VALUE_BITS, one_of
from muloco.errors import ConfigError


class Section(BaseModel):
    """Base for every section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    name: str = Field("run", description="Run name; the run directory is `<output_dir>/<name>/`.")
    output_dir: str = Field("runs", description="Parent directory of run directories.")
    seed: int = Field(0, description="Seed for model init, data order and every replica's RNG.")


# Size presets: (d_model, n_layers, n_heads). Parameter counts are for the byte-level vocab (256).
MODEL_PRESETS: dict[str, tuple[int, int, int]] = {
    "pico": (64, 3, 4),  # ~0.19M: hundreds of outer steps in minutes on a CPU (docs/results.md)
    "nano": (128, 4, 4),  # ~0.86M parameters
    "micro": (256, 4, 4),  # ~3.3M
    "small": (384, 6, 6),  # ~10.8M
    "medium": (512, 6, 8),  # ~19.2M (the Muon benchmark's shape: 24 matrices, 18.9M matrix parameters)
    "base": (768, 12, 12),  # ~85M
}


class ModelConfig(Section):
    preset: Literal["pico", "nano", "micro", "small", "medium", "base"] = Field(
        "micro", description="Size preset; `d_model`, `n_layers`, `n_heads` override its values."
    )
    d_model: int | None = Field(None, gt=0, description="Width. Default: from the preset.")
    n_layers: int | None = Field(None, gt=0, description="Number of transformer blocks. Default: preset.")
    n_heads: int | None = Field(
        None, gt=0, description="Attention heads; must divide d_model. Default: preset."
    )
    seq_len: int = Field(256, gt=0, description="Context length in tokens.")
    mlp_ratio: int = Field(4, gt=0, description="MLP hidden width = mlp_ratio x d_model.")
    norm: Literal["rmsnorm", "layernorm"] = Field("rmsnorm", description="Normalization layer.")
    qkv: Literal["fused", "split"] = Field(
        "fused",
        description="Attention's query/key/value weights: one (3C, C) matrix, or three (C, C) ones as in "
        "Llama (the MuLoCo paper's models); Muon orthogonalizes each matrix as a whole.",
    )

    @model_validator(mode="after")
    def _fill_from_preset(self) -> ModelConfig:
        d_model, n_layers, n_heads = MODEL_PRESETS[self.preset]
        # object.__setattr__ avoids re-running validation on each assignment.
        if self.d_model is None:
            object.__setattr__(self, "d_model", d_model)
        if self.n_layers is None:
            object.__setattr__(self, "n_layers", n_layers)
        if self.n_heads is None:
            object.__setattr__(self, "n_heads", n_heads)
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads}); "
                "change one of them"
            )
        return self


class DataConfig(Section):
    source: Literal["builtin", "tokens", "text"] = Field(
        "builtin",
        description="builtin: the Python stdlib source of this interpreter, byte-level (made offline); "
        "tokens: nanoGPT-style `train.bin`/`val.bin` token memmaps; text: UTF-8 files, byte-level.",
    )
    path: str | list[str] | None = Field(
        None,
        description="tokens: a directory holding train.bin and val.bin; text: a file, directory or glob "
        "(or a list of them).",
    )
    dtype: Literal["uint16", "uint32"] = Field("uint16", description="tokens: the dtype of the .bin files.")
    vocab_size: int | None = Field(None, gt=0, description="tokens: the vocabulary size (required).")
    val_fraction: float = Field(
        0.05, gt=0, lt=1, description="builtin/text: the fraction of files (by hash of the path) held out."
    )
    cache_dir: str | None = Field(
        None, description="Where the builtin corpus is cached. Default: $MULOCO_CACHE or ~/.cache/muloco."
    )


class TrainConfig(Section):
    total_tokens: int = Field(2_000_000, gt=0, description="Training budget in tokens, summed over workers.")
    batch_tokens: int = Field(
        16384, gt=0, description="Global tokens per inner step, split evenly over the K workers."
    )
    micro_batch_tokens: int | None = Field(
        None,
        gt=0,
        description="Tokens per forward/backward pass (gradient accumulation); default: a worker's batch.",
    )
    warmup_steps: int = Field(20, ge=0, description="Linear lr warmup, in inner steps.")
    lr_schedule: Literal["cosine", "constant"] = Field(
        "cosine", description="Inner lr schedule after warmup (multiplies every group's lr)."
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine: final lr as a fraction of the peak.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the gradient norm per replica; 0 disables.")
    eval_every: int = Field(
        60,
        ge=0,
        description="Eval every N inner steps (DiLoCo: at the next sync); 0 = only at start and end.",
    )
    eval_tokens: int = Field(65536, gt=0, description="Tokens of the fixed validation set used per eval.")
    log_every: int = Field(10, gt=0, description="Train-loss log line every N inner steps (dp) or each sync.")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto: bf16 autocast on CUDA, fp32 on CPU."
    )
    max_bad_syncs: int = Field(
        3,
        ge=1,
        description="Stop the run (exit 1, last checkpoint kept) after this many syncs in a row that left a "
        "replica out for a non-finite loss or pseudogradient (dp: skipped non-finite steps).",
    )
    threads: int | None = Field(None, gt=0, description="torch CPU threads; default: torch's choice.")


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
    optimizer: Literal["muon", "adamw", "sgd", "torch_muon"] = Field(
        "muon",
        description="muon: our Muon on hidden matrices + AdamW on the rest (MuLoCo); adamw: AdamW on all "
        "(DiLoCo); sgd: SGD with momentum on all; torch_muon: torch.optim.Muon + AdamW (reference).",
    )
    lr: float = Field(0.02, gt=0, description="Muon (or SGD) learning rate.")
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


class SyncConfig(Section):
    every: int = Field(30, gt=0, description="H: inner steps between two syncs of the same fragment.")
    fragments: int = Field(
        1,
        ge=1,
        description="Streaming DiLoCo P: the parameters sync in P fragments (groups of transformer blocks) "
        "at staggered steps, fragment p when step mod H == floor(p H / P); 1 = plain DiLoCo.",
    )
    overlap: int = Field(
        0,
        ge=0,
        description="Streaming tau: a fragment's sync started at step t is applied at t + tau while the "
        "inner steps go on (tau x P < H).",
    )
    alpha: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Streaming merge: local <- alpha local + (1 - alpha) global_new; 0 = replace.",
    )
    fragment_pattern: Literal["strided", "sequential"] = Field(
        "strided",
        description="strided: block i joins fragment i mod P (the paper's choice); sequential: "
        "consecutive blocks.",
    )
    embedding_fragment: int = Field(
        0, description="Fragment of the parameters before the first block (embeddings); -1 = the last."
    )
    head_fragment: int = Field(
        -1, description="Fragment of the parameters after the last block (final norm, head); 0 = the first."
    )

    @model_validator(mode="after")
    def _check_streaming(self) -> SyncConfig:
        P, H = self.fragments, self.every
        if P > H:
            raise ValueError(
                f"sync.fragments ({P}) exceeds sync.every ({H}): each fragment needs its own step; "
                f"use sync.fragments <= {H}"
            )
        if self.overlap * P >= H:
            raise ValueError(
                f"sync.overlap ({self.overlap}) must be below sync.every / sync.fragments ({H}/{P}) so a "
                f"sync is applied before the next fragment's starts; use sync.overlap <= {(H - 1) // P}"
            )
        for field in ("embedding_fragment", "head_fragment"):
            value = getattr(self, field)
            if not -P <= value < P:
                raise ValueError(f"sync.{field} ({value}) must be in [-{P}, {P - 1}] for {P} fragments")
        return self

    @property
    def streaming(self) -> bool:
        return self.fragments > 1 or self.overlap > 0 or self.alpha > 0


class CompressionConfig(Section):
    scheme: Literal["none", "bf16", "linear", "statistical", "topk"] = Field(
        "none",
        description="How pseudogradients travel: none (fp32), bf16, linear / statistical quantization "
        "(bits, granularity), topk (a fraction of entries).",
    )
    bits: int = Field(8, description="Quantization bits of linear and statistical: 1, 2, 4 or 8.")
    granularity: Literal["tensor", "row", "block"] = Field(
        "row", description="One set of quantization statistics per tensor, per row, or per block."
    )
    block_size: int = Field(256, gt=0, description="granularity: block: elements per block.")
    linear_mode: Literal["absmax", "minmax"] = Field(
        "absmax", description="linear: symmetric around 0 (absmax) or spanning [min, max] (minmax)."
    )
    stat_range: float | None = Field(
        None,
        gt=0,
        le=1e4,
        description="statistical: range of +-r standard deviations; default: chosen per bits.",
    )
    topk_fraction: float = Field(
        0.01, ge=2**-20, le=1, description="topk: fraction of entries kept per tensor."
    )
    topk_value_bits: int = Field(32, description="topk: bits of the kept values: 32 (fp32), 16 (bf16) or 8.")
    error_feedback: bool = Field(False, description="Error feedback: resend what quantization dropped.")
    ef_decay: float = Field(0.9, ge=0, le=1, description="Error-feedback decay: e = decay * e + delta.")
    ef_alpha: float = Field(1.0, ge=0, le=1, description="Error-feedback step: e = e - alpha * deQ(Q(e)).")
    skip: list[str] = Field(
        default_factory=lambda: ["norm", "bias", "scalar"],
        description="Parameters sent uncompressed: role names (embedding, head, norm, bias, scalar) or "
        "regexes of parameter names. Default: the 1-D ones (embeddings would cost ~2 bits/param on small "
        "models if sent as fp32).",
    )
    skip_dtype: Literal["fp32", "bf16"] = Field("fp32", description="How skipped parameters travel.")

    @field_validator("bits")
    @classmethod
    def _supported_bits(cls, bits: int) -> int:
        if bits not in QUANT_BITS:
            raise ValueError(f"bits must be {one_of(QUANT_BITS)}, got {bits}")
        return bits

    @field_validator("topk_value_bits")
    @classmethod
    def _supported_value_bits(cls, bits: int) -> int:
        if bits not in TOPK_VALUE_BITS:
            raise ValueError(f"topk_value_bits must be {one_of(TOPK_VALUE_BITS)}, got {bits}")
        return bits


class LocalBackendConfig(Section):
    bandwidth_mbps: float | None = Field(
        None,
        gt=0,
        description="WAN planner: project the run's wall-clock as if each worker had this upload "
        "bandwidth (Mbit/s); reported in summary.json as projected_*. null = no projection.",
    )
    latency_ms: float = Field(
        0.0, ge=0, description="WAN planner: one-way latency per ring hop (ms), with bandwidth_mbps."
    )


class TorchBackendConfig(Section):
    timeout_s: float = Field(
        300.0, gt=0, description="How long a collective waits for a missing rank before the run stops."
    )
    dist_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="auto: nccl on CUDA, else gloo."
    )


class HivemindBackendConfig(Section):
    """The hivemind swarm's options: the one schema, passed as is to `muloco.comm.hivemind.HivemindSwarm`."""

    run_id: str = Field(
        "muloco", description="Prefix of every DHT key: swarms with different run_ids never mix."
    )
    peer_index: int | None = Field(
        None,
        ge=0,
        description="This peer's replica index r < workers (its data shard); null: the RANK the launcher "
        "sets, else 0. Give every peer of a swarm its own.",
    )
    initial_peers: list[str] = Field(
        default_factory=list, description="Multiaddrs of peers to join; empty: start a new swarm."
    )
    host_maddrs: list[str] = Field(
        default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"],
        description="Where to listen; for other machines e.g. /ip4/0.0.0.0/tcp/31337.",
    )
    announce_maddrs: list[str] = Field(
        default_factory=list, description="Public addresses to announce (behind NAT / port forwarding)."
    )
    use_relay: bool = Field(True, description="Accept relayed connections (libp2p circuit relay).")
    use_auto_relay: bool = Field(
        False, description="Behind NAT: be reached through relays found among the peers."
    )
    identity_path: str | None = Field(None, description="Private key file for a persistent peer id.")
    matchmaking_time: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Seconds to gather a group; null: derived from the sync size and bandwidth.",
    )
    averaging_timeout: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Seconds for the payload exchange; null: derived likewise.",
    )
    min_group_size: int = Field(2, ge=2, description="Fewer peers than this: no group.")
    target_group_size: int | None = Field(
        None, ge=2, description="A group starts as soon as it has this many peers; null: no limit."
    )
    on_no_group: Literal["apply_own", "skip"] = Field(
        "apply_own", description="No group in time: apply this peer's own pseudogradient, or skip the step."
    )
    bandwidth_mbps: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="This peer's expected upload (Mbit/s), to derive the timeouts.",
    )
    max_norm_ratio: float = Field(
        10.0,
        gt=1,
        description="Exclude a contribution whose norm exceeds this x the group's median (.inf: never).",
    )
    outer_step_ttl: float = Field(
        600.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds a peer's published outer step counts (it republishes every outer step).",
    )
    join_timeout_s: float = Field(
        60.0,
        gt=0,
        description="How long a joining peer waits for the swarm's state (and for wait_for_peers).",
    )
    wait_for_peers: int = Field(
        1,
        ge=1,
        description="At start, wait until this many peers (this one included) are in the swarm, so they "
        "begin in step; `muloco launch --backend hivemind --nproc N` sets N.",
    )

    @field_validator("run_id")
    @classmethod
    def _run_id_is_a_key_prefix(cls, run_id: str) -> str:
        if not run_id or not all(c.isascii() and (c.isalnum() or c in "_-") for c in run_id):
            raise ValueError(f"must be letters, digits, '_' or '-' (it prefixes DHT keys), got {run_id!r}")
        return run_id

    @field_validator("host_maddrs")
    @classmethod
    def _somewhere_to_listen(cls, maddrs: list[str]) -> list[str]:
        if not maddrs:
            raise ValueError("must not be empty; listen somewhere, e.g. ['/ip4/0.0.0.0/tcp/0']")
        return maddrs

    @field_validator(
        "matchmaking_time",
        "averaging_timeout",
        "bandwidth_mbps",
        "max_norm_ratio",
        "outer_step_ttl",
        mode="before",
    )
    @classmethod
    def _not_a_bool(cls, value: object) -> object:
        if isinstance(value, bool):  # pydantic would read true as 1.0
            raise ValueError(f"must be a number, got {value!r}")
        return value

    @model_validator(mode="after")
    def _target_fits_min(self) -> HivemindBackendConfig:
        if self.target_group_size is not None and self.target_group_size < self.min_group_size:
            raise ValueError(
                f"backend.hivemind.target_group_size ({self.target_group_size}) must be null or >= "
                f"min_group_size ({self.min_group_size}); raise it or lower min_group_size"
            )
        return self


class BackendConfig(Section):
    kind: Literal["local", "torch", "hivemind"] = Field(
        "local",
        description="local: all replicas in this process; torch: torch.distributed, one process per rank "
        "(`muloco launch --nproc N` or torchrun; under torchrun `local` switches to `torch` by itself); "
        "hivemind: one peer of a decentralized swarm (docs/backends.md).",
    )
    local: LocalBackendConfig = Field(default_factory=LocalBackendConfig)
    torch: TorchBackendConfig = Field(default_factory=TorchBackendConfig)
    hivemind: HivemindBackendConfig = Field(default_factory=HivemindBackendConfig)


class SimulationConfig(Section):
    offload: bool = Field(
        False, description="Keep inactive replicas' parameters and optimizer state on the CPU (CUDA runs)."
    )


class DiagnosticsConfig(Section):
    alignment: bool = Field(
        False,
        description="Log how the workers' pseudogradients align with each other and with one replica "
        "trained on the union of their batches (muloco/alignment.py); doubles the compute; simulation only.",
    )


class LoggingConfig(Section):
    wandb: bool = Field(False, description="Log to Weights & Biases (offline when no API key is set).")
    wandb_project: str = Field("muloco", description="wandb project.")
    wandb_group: str | None = Field(None, description="wandb group (sweeps set it).")
    progress: Literal["auto", "bar", "lines", "off"] = Field(
        "auto", description="auto: a progress bar on a terminal, plain log lines otherwise."
    )

    @field_validator("progress", mode="before")
    @classmethod
    def _yaml_off_is_false(cls, value: object) -> object:
        # YAML 1.1 reads a bare `off` / `on` as a bool.
        return {False: "off", True: "auto"}.get(value, value) if isinstance(value, bool) else value


class CheckpointConfig(Section):
    every: int = Field(
        0, ge=0, description="Every N outer steps (dp: N steps); 0 = at the end and on interrupt only."
    )
    keep: int = Field(2, gt=0, description="How many checkpoints to keep.")
    resume: str = Field(
        "auto", description="auto: newest valid checkpoint of this run dir, if any; never; or a path."
    )


class Config(Section):
    """A whole run. Sections as in DESIGN.md."""

    run: RunConfig = Field(default_factory=RunConfig)
    method: Literal["diloco", "dp"] = Field(
        "diloco", description="diloco (MuLoCo = diloco + muon) | dp (data-parallel baseline)."
    )
    workers: int = Field(1, gt=0, description="K: total replicas in the run.")
    ranks_per_worker: int = Field(
        1,
        gt=0,
        description="R: processes per DiLoCo worker (docs/topology.md). They split each inner step's "
        "micro-batches and all-reduce gradients every step; only the worker's first rank syncs "
        "pseudogradients with the other workers. Launch K/k x R processes.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when present, else CPU.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    inner: InnerConfig = Field(default_factory=InnerConfig)
    outer: OuterConfig = Field(default_factory=OuterConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    backend: BackendConfig = Field(default_factory=BackendConfig)
    simulation: SimulationConfig = Field(default_factory=SimulationConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    diagnostics: DiagnosticsConfig = Field(default_factory=DiagnosticsConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    @model_validator(mode="after")
    def _check_combinations(self) -> Config:
        seq_len, workers = self.model.seq_len, self.workers
        unit = workers * seq_len
        if self.train.batch_tokens % unit != 0:
            nearest = max(unit, round(self.train.batch_tokens / unit) * unit)
            raise ValueError(
                f"train.batch_tokens ({self.train.batch_tokens}) must be a multiple of workers x "
                f"model.seq_len ({workers} x {seq_len} = {unit}); use e.g. {nearest}"
            )
        micro = self.train.micro_batch_tokens
        per_worker = self.train.batch_tokens // workers
        if micro is not None and (micro % seq_len != 0 or per_worker % micro != 0):
            raise ValueError(
                f"train.micro_batch_tokens ({micro}) must be a multiple of model.seq_len ({seq_len}) that "
                f"divides a worker's batch ({per_worker} tokens)"
            )
        if self.train.total_tokens < self.train.batch_tokens:
            raise ValueError(
                f"train.total_tokens ({self.train.total_tokens}) is smaller than one step "
                f"(train.batch_tokens = {self.train.batch_tokens}); raise it"
            )
        if self.ranks_per_worker > 1:
            if self.method == "dp":
                raise ValueError(
                    "ranks_per_worker applies to method: diloco (with method: dp every process is a data-"
                    "parallel rank already); set ranks_per_worker=1"
                )
            micro = self.train.micro_batch_tokens or self.worker_batch_tokens
            if (self.worker_batch_tokens // micro) % self.ranks_per_worker != 0:
                raise ValueError(
                    f"ranks_per_worker ({self.ranks_per_worker}) must divide a worker's micro-batches per "
                    f"step ({self.worker_batch_tokens // micro}); set train.micro_batch_tokens to fit"
                )
        if self.backend.kind == "hivemind" and (self.method == "dp" or self.ranks_per_worker > 1):
            raise ValueError(
                "backend.kind=hivemind runs method: diloco with one process per worker (ranks_per_worker=1); "
                "use backend.kind=torch for method: dp or workers of several ranks"
            )
        if self.method == "dp" and self.sync.streaming:
            raise ValueError(
                "sync.fragments/overlap/alpha (Streaming DiLoCo) apply to method: diloco; with method: dp "
                "keep sync.fragments=1, sync.overlap=0, sync.alpha=0"
            )
        if self.method == "dp" and self.compression.scheme != "none":
            raise ValueError(
                "compression applies to pseudogradients (method: diloco); with method: dp set "
                "compression.scheme=none"
            )
        if self.diagnostics.alignment and (
            self.method == "dp" or self.backend.kind != "local" or self.sync.streaming
        ):
            raise ValueError(
                "diagnostics.alignment needs method: diloco on backend.kind=local without streaming "
                "(sync.fragments=1, sync.overlap=0, sync.alpha=0); set diagnostics.alignment=false"
            )
        if self.data.source == "tokens" and (self.data.path is None or self.data.vocab_size is None):
            raise ValueError(
                "data.source: tokens needs data.path (a directory with train.bin) and data.vocab_size"
            )
        if self.data.source == "text" and self.data.path is None:
            raise ValueError("data.source: text needs data.path (files, a directory or a glob)")
        return self

    # -- derived quantities --------------------------------------------------------------------------
    @property
    def worker_batch_tokens(self) -> int:
        return self.train.batch_tokens // self.workers

    @property
    def total_steps(self) -> int:
        """Inner steps in the run (every worker takes each step)."""
        return self.train.total_tokens // self.train.batch_tokens

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def fingerprint(
        self,
        exclude: tuple[str, ...] = (
            "run",
            "logging",
            "checkpoint",
            "backend",
            "simulation",
            "device",
            "diagnostics",
        ),
    ) -> str:
        """Hash of the settings that change the maths, to tell checkpoints and ranks apart. Where the
        replicas run (backend, simulation, device, train.threads) and what is logged when are left out:
        a run may resume on another layout or with other logging."""
        data = {k: v for k, v in self.to_dict().items() if k not in exclude}
        for key in ("threads", "log_every", "eval_every", "eval_tokens", "max_bad_syncs"):
            data["train"].pop(key, None)
        # Keys added after checkpoints existed count only when set, so older checkpoints still resume.
        if data["model"].get("qkv") == "fused":
            del data["model"]["qkv"]
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


# --- loading ----------------------------------------------------------------------------------------


def read_yaml(path: Path, what: str = "config file") -> dict[str, Any]:
    """A YAML file holding a mapping; any problem is a one-line ConfigError naming the file."""
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}; check the path")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"YAML syntax error in {what} {path}{where}: {problem}; fix the file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} is not UTF-8 text") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must hold a mapping of keys, got {type(data).__name__}")
    return data


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Return base updated by update, recursing into nested mappings (lists are replaced)."""
    merged = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def load_raw(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML config and resolve its `extends:` chain (relative to the file) into one mapping."""
    path = Path(path).expanduser().resolve()
    if path in _chain:
        cycle = " -> ".join(str(p.name) for p in (*_chain, path))
        raise ConfigError(f"extends: cycle in config files ({cycle}); remove one of the extends keys")
    data = read_yaml(path)
    parents = data.pop("extends", None)
    if parents is None:
        return data
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError(f"extends in {path} must be a file path or a list of paths")
    merged: dict[str, Any] = {}
    for parent in parents:
        parent_path = (path.parent / parent).expanduser()
        if not parent_path.is_file():
            raise ConfigError(f"extends in {path}: file not found: {parent_path}; check the path")
        merged = deep_merge(merged, load_raw(parent_path, (*_chain, path)))
    return deep_merge(merged, data)


def _section_fields(dotted: list[str]) -> dict[str, Any] | None:
    """The fields of the section at a dotted path, or None if that path is not a section."""
    model: type[BaseModel] = Config
    for part in dotted:
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model.model_fields


def _did_you_mean(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    return f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(options)}"


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value), the value parsed as YAML (numbers, bools, lists, null)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like KEY=VALUE, e.g. train.total_tokens=100000")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r} has an empty key part; use dotted names like inner.lr=0.01")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # not YAML: keep it as a plain string
    if isinstance(value, str):
        try:  # YAML 1.1 reads "1e-3" as a string; users mean a number
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            pass
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    data = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        for depth, part in enumerate(parts):
            fields = _section_fields(parts[:depth])
            if fields is None:
                raise ConfigError(
                    f"override {text!r}: '{'.'.join(parts[:depth])}' is a value, not a section; "
                    f"drop '.{'.'.join(parts[depth:])}'"
                )
            if part not in fields:
                where = ".".join(parts[:depth]) or "the top level"
                raise ConfigError(
                    f"override {text!r}: unknown key '{part}' in {where}; {_did_you_mean(part, list(fields))}"
                )
        annotation = fields[parts[-1]].annotation
        if _is_text_field(annotation) and not (value is None and type(None) in typing.get_args(annotation)):
            value = text.split("=", 1)[1].strip()  # run.name=off stays "off", not YAML's False
        node = data
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[parts[-1]] = value
    return data


def _is_text_field(annotation: Any) -> bool:
    """True for str, str | None and Literal[...] of strings: fields whose override is taken verbatim."""
    if annotation is str:
        return True
    if typing.get_origin(annotation) in (list, tuple, dict):
        return False  # list[str] etc.: parsed as YAML ([a, b])
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is Literal:
        return all(isinstance(a, str) for a in args)
    return bool(args) and all(a is str for a in args)


def _format_validation_error(exc: ValidationError, source: str) -> str:
    """The first error, as one line naming the dotted field and the fix."""
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"] if not isinstance(p, int)]
    field = ".".join(loc)
    if err["type"] == "extra_forbidden":
        options = list((_section_fields(loc[:-1]) or {}).keys())
        where = ".".join(loc[:-1]) or "the top level"
        return f"{source}: unknown key '{field}' in {where}; {_did_you_mean(loc[-1], options)}"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
        return f"{source}: {msg}" if not field or msg.startswith(field) else f"{source}: {field}: {msg}"
    got = err.get("input")
    got_text = "" if isinstance(got, dict) else f" (got {got!r})"
    fix = "fix the value"
    if err["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        fix = "use a value in range"
    elif err["type"] == "literal_error":
        fix = "use one of the listed values"
    elif "type" in err["type"] or "parsing" in err["type"]:
        fix = "use the right type"
    return f"{source}: {field}: {msg}{got_text}; {fix}"


def validate(data: dict[str, Any], source: str = "config") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from None


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load and validate a config: YAML (with `extends:`), then dotted `KEY=VALUE` overrides."""
    data = load_raw(path) if path is not None else {}
    data = apply_overrides(data, list(overrides))
    return validate(data, source=str(path) if path is not None else "config")
