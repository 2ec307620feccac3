"""The training sections of the config: run, model, data, train (what a sync exchanges and how, sync and
compression, is in exchange.py; the optimizers' sections, inner, outer and dp, are in optimizers.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


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
