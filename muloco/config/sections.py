"""The training sections of the config: run, model, data, train, sync, compression (the optimizers' sections,
inner, outer and dp, are in optimizers.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from muloco.config.bits import QUANT_BITS, TOPK_VALUE_BITS, check_chunk, one_of


class Section(BaseModel):
    """Base for every section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    name: str = Field(
        "run",
        description="Run name; the run directory is `<output_dir>/<name>/`. Command-line overrides that "
        "change the maths add their values to a config file's name (`quickstart_w8`), unless one sets it.",
    )
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
        "micro",
        description="Size preset of the built-in GPT; `d_model`, `n_layers`, `n_heads` override its values "
        "(these, mlp_ratio, norm and qkv are unused with model.factory or model.hf).",
    )
    d_model: int | None = Field(None, gt=0, description="Width. Default: from the preset.")
    n_layers: int | None = Field(None, gt=0, description="Number of transformer blocks. Default: preset.")
    n_heads: int | None = Field(
        None, gt=0, description="Attention heads; must divide d_model. Default: preset."
    )
    seq_len: int = Field(256, gt=0, description="Context length in tokens.")
    mlp_ratio: int = Field(4, gt=0, description="MLP hidden width = mlp_ratio x d_model.")
    norm: Literal["rmsnorm", "layernorm"] = Field(
        "layernorm",
        description="Normalization layer (no bias either way). layernorm: the built-in GPT is then exactly "
        "Hugging Face GPT-2 and exports (`muloco export`, docs/models.md); rmsnorm: the default before "
        "that, no cost either way in the pico regime (docs/results.md).",
    )
    qkv: Literal["fused", "split"] = Field(
        "fused",
        description="Attention's query/key/value weights: one (3C, C) matrix, or three (C, C) ones as in "
        "Llama (the MuLoCo paper's models); Muon orthogonalizes each matrix as a whole.",
    )
    factory: str | None = Field(
        None,
        description="Your own model instead of the built-in GPT: `package.module:function` returning an "
        "`nn.Module` whose forward maps token ids (B, T) to logits (B, T, vocab) (docs/models.md). The "
        "module is imported from the current directory or PYTHONPATH.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="factory: keyword arguments of the function; `vocab_size` and `seq_len` are filled in "
        "from the data and model.seq_len when the function takes them and they are not set here.",
    )
    hf: str | dict[str, Any] | None = Field(
        None,
        description="A Hugging Face causal LM built from a config, random init, no download (`pip install -e "
        '".[hf]"`): a local config.json (or its directory), or a mapping `{model_type: llama, hidden_size: '
        "256, ...}` of overrides (optionally with `config: PATH`). vocab_size and the context length default "
        "to the data's and model.seq_len. `{pretrained: DIR}`: the model a save_pretrained directory holds, "
        "with its weights (local files only; docs/models.md).",
    )
    init_from: str | None = Field(
        None,
        description="Start from another muloco run's trained weights instead of a random init: its run "
        "directory (the newest checkpoint's global parameters) or one checkpoint (a step_*.pt file or a "
        "sharded step_* directory). The model must be the same (docs/models.md).",
    )
    compile: bool = Field(
        False,
        description="torch.compile every replica's model (and the dp baseline's): one graph shared by all "
        "replicas and rounds (docs/models.md).",
    )

    @model_validator(mode="after")
    def _fill_from_preset(self) -> ModelConfig:
        if self.factory is not None and self.hf is not None:
            raise ValueError("model.factory and model.hf name two models; keep one of them")
        if self.kwargs and self.factory is None:
            raise ValueError(
                "model.kwargs applies to model.factory; set model.factory or remove model.kwargs"
            )
        if self.init_from is not None and isinstance(self.hf, dict) and self.hf.get("pretrained") is not None:
            raise ValueError(
                "model.init_from and model.hf.pretrained both name the first weights; keep one of them"
            )
        if self.factory is not None and (":" not in self.factory or self.factory.count(":") != 1):
            raise ValueError(f"model.factory: {self.factory!r} must look like 'package.module:function'")
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
    dtype: Literal["uint16", "uint32"] | None = Field(
        None, description="tokens: the dtype of the .bin files; default: from meta.json, else uint16."
    )
    vocab_size: int | None = Field(
        None,
        gt=0,
        description="tokens: the vocabulary size; default: from the directory's meta.json (written by "
        "`muloco data prepare`), else required.",
    )
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
    lr_schedule: Literal["cosine", "constant", "wsd"] = Field(
        "cosine",
        description="Inner lr schedule after warmup (multiplies every group's lr). wsd: warmup-stable-decay, "
        "constant then a linear decay over the last train.decay_fraction of the steps.",
    )
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="cosine, wsd: final lr as a fraction of the peak."
    )
    decay_fraction: float = Field(
        0.2,
        gt=0,
        le=1,
        description="wsd: the share of the steps after warmup that decay (Hägele et al. 2024: 0.2).",
    )
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
    speed: float | list[float] = Field(
        1.0,
        description="Emulated relative speed of the workers (docs/heterogeneous.md), one value or a list "
        "of K (worker r's at index r), each in (0, 1]: a worker at v takes 1/v of its measured step time (a "
        "process with one worker sleeps the difference after each inner step; a simulation hosting several "
        "advances a virtual clock instead, summary.json's virtual_time_s). Emulation, for studying "
        "unequal hosts on equal hardware; method: diloco.",
    )

    @field_validator("speed")
    @classmethod
    def _check_speed(cls, value: float | list[float]) -> float | list[float]:
        speeds = value if isinstance(value, list) else [value]
        if not speeds or any(not 0 < v <= 1 for v in speeds):
            raise ValueError(f"train.speed ({value}) must be in (0, 1] (a list: every entry); 1 = full speed")
        return value


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
        description="tau: a fragment's sync started at step t is applied at t + tau while the inner "
        "steps go on; at most H / P (one fragment: a whole window, tau = H: the sync started after round r "
        "is applied after round r + 1's inner steps, the naive delayed update of Kale et al. 2025).",
    )
    eager: bool = Field(
        False,
        description="Eager updates (Kale et al. 2025, arXiv 2502.12996, Algorithm 3), with sync.overlap > 0: "
        "each worker takes an outer step at once at every sync, with its own fresh pseudogradient in place "
        "of its stale one in the mean of the previous sync, and starts its next window from its own outer "
        "parameters; the run's global parameters take each mean when it arrives (docs/streaming.md). "
        "false: the naive delayed update.",
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
    transport: Literal["auto", "all_gather", "reduce_scatter"] = Field(
        "auto",
        description="How compressed pseudogradients travel: all_gather (every worker sends its whole "
        "message to every other: (K-1) x message per worker) or reduce_scatter (part j to its owner, "
        "which averages and re-quantizes it, then an all-gather of the K means: 2 (K-1)/K x message); auto "
        "picks all_gather when the sync overlaps compute (sync.overlap > 0: reduce_scatter's second "
        "collective waits for the sync's apply step), else the faster on backend.local.bandwidth_mbps's "
        "link, else the one sending fewer bytes (all_gather at K <= 2 and on hivemind). fp32 syncs are a "
        "ring all-reduce either way.",
    )
    aggregate: Literal["mean", "sender_mean", "trimmed_mean", "median", "centered_clip"] = Field(
        "mean",
        description="How a sync combines the contributions, on every backend: mean; sender_mean "
        "(per coordinate, the mean over the contributions that sent it: SparseLoCo's, for top-k); "
        "trimmed_mean (per coordinate, drop the sync.trim largest and smallest); median (per "
        "coordinate); centered_clip (clip each contribution's distance to a robust center). The robust "
        "ones tolerate bad members (docs/security.md); all but mean need every contribution whole: an "
        "fp32 sync then all-gathers instead of all-reducing, and reduce_scatter is refused.",
    )
    pacing: Literal["fixed", "by_speed"] = Field(
        "fixed",
        description="Inner steps per round. fixed: H for every worker (the round waits for the slowest); "
        "by_speed: worker w takes H_w = max(1, floor(v_w / v_max x H)) so that all finish a round together "
        "(DyLU, Liu et al. 2024, arXiv 2401.09135), v_w its speed (sync.pacing_speeds). One fragment, no "
        "overlap.",
    )
    pacing_speeds: Literal["measured", "declared"] = Field(
        "measured",
        description="sync.pacing: by_speed: the speeds that size the rounds. measured: each worker's mean "
        "inner-step time in the previous round, exchanged over the processes (the first round: "
        "train.speed's); declared: train.speed's throughout (hivemind and torchft: declared only, their "
        "workers share no collective outside a sync).",
    )
    pacing_tolerance: float = Field(
        0.05,
        ge=0.0,
        lt=0.5,
        description="sync.pacing_speeds: measured: a worker whose measured speed is within this fraction of "
        "the fastest's paces as the fastest (equal hosts' step times differ by a few percent from round to "
        "round, and the floor would take a step a round from every worker but the fastest); 0: as measured.",
    )
    weight_by_tokens: bool = Field(
        False,
        description="sync.pacing: by_speed: weight each worker's pseudogradient in the mean by the tokens it "
        "trained this round (K x H_w / sum H) instead of equally; needs sync.aggregate: mean.",
    )
    mode: Literal["sync", "async"] = Field(
        "sync",
        description="sync: every round ends in a sync of all the workers (a barrier); async: each worker's "
        "pseudogradient is applied to the global parameters when it arrives, by delayed Nesterov (Liu et "
        "al. 2024, arXiv 2401.09135), and the worker goes on from the new ones at once. async runs in a "
        "simulation (backend.kind: local) with one fragment, no overlap and the plain mean "
        "(docs/heterogeneous.md).",
    )
    momentum_every: int | None = Field(
        None,
        ge=1,
        description="sync.mode: async: N, the arrivals between two updates of the outer momentum (delayed "
        "Nesterov); default K, so that K arrivals make one Nesterov step on their mean.",
    )
    trim: int = Field(
        1,
        ge=1,
        description="trimmed_mean: contributions dropped at each end per coordinate (it tolerates this many "
        "bad members; at most (n - 1) / 2 of n are dropped). In a swarm, a group left with fewer than "
        "2 x trim + 1 usable contributions combines nothing (as no group); fewer workers (or a hivemind "
        "target_group_size) than 2 x trim + 1 is refused.",
    )

    @model_validator(mode="after")
    def _check_streaming(self) -> SyncConfig:
        if self.aggregate != "mean" and self.transport == "reduce_scatter":
            raise ValueError(
                f"sync.aggregate={self.aggregate} needs every contribution whole, which reduce_scatter does "
                "not give its part owners; use sync.transport: all_gather (or auto)"
            )
        P, H = self.fragments, self.every
        if P > H:
            raise ValueError(
                f"sync.fragments ({P}) exceeds sync.every ({H}): each fragment needs its own step; "
                f"use sync.fragments <= {H}"
            )
        if self.overlap > H // P:
            # A fragment's sync is applied at the latest when the next fragment's starts (with one fragment:
            # when its own next one starts, a whole window later): at most two syncs in flight, in order.
            raise ValueError(
                f"sync.overlap ({self.overlap}) must be at most sync.every / sync.fragments ({H}/{P}) so a "
                f"sync is applied by the time the next fragment's starts; use sync.overlap <= {H // P}"
            )
        if self.eager and (self.overlap == 0 or self.alpha > 0):
            raise ValueError(
                "sync.eager steps each worker at once with the stale mean of a sync in flight, in place of "
                "the merge: set sync.overlap > 0 and sync.alpha=0 (or sync.eager=false)"
            )
        if self.pacing == "by_speed" and self.streaming:
            raise ValueError(
                "sync.pacing=by_speed sizes each worker's whole round: use one fragment without overlap "
                "(sync.fragments=1, sync.overlap=0, sync.alpha=0) or sync.pacing=fixed"
            )
        if self.weight_by_tokens and (self.pacing != "by_speed" or self.aggregate != "mean"):
            raise ValueError(
                "sync.weight_by_tokens weights the plain mean by each worker's steps under pacing by speed: "
                "set sync.pacing=by_speed and sync.aggregate=mean (or sync.weight_by_tokens=false)"
            )
        if self.mode == "async":
            self._check_async()
        for field in ("embedding_fragment", "head_fragment"):
            value = getattr(self, field)
            if not -P <= value < P:
                raise ValueError(f"sync.{field} ({value}) must be in [-{P}, {P - 1}] for {P} fragments")
        return self

    def _check_async(self) -> None:
        if self.streaming or self.eager:
            raise ValueError(
                "sync.mode=async applies each worker's whole window when it arrives: use one fragment "
                "without overlap (sync.fragments=1, sync.overlap=0, sync.alpha=0, sync.eager=false)"
            )
        one_at_a_time = self.aggregate in ("mean", "sender_mean") and not self.weight_by_tokens
        if not one_at_a_time or self.transport == "reduce_scatter":
            raise ValueError(
                "sync.mode=async applies one worker's pseudogradient at a time, there is no mean to "
                "aggregate: set sync.aggregate=mean, sync.weight_by_tokens=false and sync.transport=auto"
            )

    @property
    def streaming(self) -> bool:
        return self.fragments > 1 or self.overlap > 0 or self.alpha > 0


# reduce_scatter's second stage by default: the owners' means at twice the bits, within [4, 8]. In the pico
# sweep (docs/results.md, "Transports"; mean of 16 same-seed pairs against the all-gather) same-bit means
# cost +0.46% at 2 bits and +0.23% at 4, 4-bit means for 2-bit messages +0.12%, 8-bit for 4-bit +0.08%,
# 8-bit for 8-bit -0.07%. 1 bit was not measured; it gets 4 as 2 bits does.
DEFAULT_MEAN_BITS = {1: 4, 2: 4, 4: 8, 8: 8}


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
        0.01, ge=2**-20, le=1, description="topk: fraction of entries kept per tensor (or per chunk)."
    )
    topk_value_bits: int = Field(
        32,
        description="topk: bits of the kept values: 32 (fp32), 16 (bf16), 8 (linear), 4 or 2 (statistical "
        "over the tensor's kept values).",
    )
    topk_chunk: int | None = Field(
        None,
        description="topk: entries per chunk, a square (4096: tiles of up to 64 x 64 in matrices, runs of up "
        "to 64 in vectors, as SparseLoCo); each chunk keeps max(1, round(chunk x topk_fraction)) entries, "
        "indexed at log2(chunk) bits. Unset: top-k of the whole tensor.",
    )
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
    mean_bits: int | None = Field(
        None,
        description="sync.transport: reduce_scatter: bits of the part owners' re-quantized means (linear "
        "and statistical); default: twice bits within [4, 8] (1, 2 -> 4; 4, 8 -> 8): same-bit means cost "
        "+0.46% (2 bits) and +0.23% (4 bits) of final loss against the all-gather, these +0.12% and "
        '+0.08% (docs/results.md, "Transports").',
    )
    mean_error_feedback: bool = Field(
        True,
        description="sync.transport: reduce_scatter: each part owner keeps an error-feedback buffer for its "
        "second quantization (ef_decay, ef_alpha), whatever error_feedback says: the sum of the applied "
        "means then drifts from the exact one no more than the all-gather's (docs/transport.md).",
    )

    @field_validator("bits", "mean_bits")
    @classmethod
    def _supported_bits(cls, bits: int | None, info: ValidationInfo) -> int | None:
        if bits is None and info.field_name == "mean_bits":
            return None  # the default second stage (second_stage_bits)
        if bits not in QUANT_BITS:
            raise ValueError(f"{info.field_name} must be {one_of(QUANT_BITS)}, got {bits}")
        return bits

    @property
    def second_stage_bits(self) -> int:
        """The bits of reduce_scatter's owners' means: mean_bits, by default DEFAULT_MEAN_BITS[bits]."""
        return self.mean_bits if self.mean_bits is not None else DEFAULT_MEAN_BITS[self.bits]

    @field_validator("topk_chunk")
    @classmethod
    def _square_chunk(cls, chunk: int | None) -> int | None:
        check_chunk(chunk)
        return chunk

    @field_validator("topk_value_bits")
    @classmethod
    def _supported_value_bits(cls, bits: int) -> int:
        if bits not in TOPK_VALUE_BITS:
            raise ValueError(f"topk_value_bits must be {one_of(TOPK_VALUE_BITS)}, got {bits}")
        return bits
