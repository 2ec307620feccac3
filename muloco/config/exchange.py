"""The sections of what a sync exchanges and how: sync (its schedule, transport, aggregate, pacing and mode)
and compression (the pseudogradients' codec)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from muloco.config.bits import QUANT_BITS, TOPK_VALUE_BITS, check_chunk, one_of
from muloco.config.sections import Section


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
        "inner-step time in the round before the previous one, exchanged over the processes during the "
        "previous one (the first two rounds: "
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
        "simulation (backend.kind: local) or over torch.distributed (one worker a process, the global "
        "parameters on rank 0), with one fragment, no overlap and the plain mean (docs/heterogeneous.md).",
    )
    momentum_every: int | None = Field(
        None,
        ge=1,
        description="sync.mode: async: N, the arrivals between two updates of the outer momentum (delayed "
        "Nesterov); default K, so that K arrivals make one Nesterov step on their mean.",
    )
    deadline: Literal["off", "adaptive"] = Field(
        "off",
        description="How long the workers ready for a sync wait for a late one. off: the backend's own wait "
        "(hivemind: backend.hivemind.matchmaking_time); adaptive: until median + k x MAD of the recent "
        "round times (k: sync.deadline_mads; at least 20% over the median), then the sync goes on without "
        "it; its window joins the next sync (a sync later) or is counted lost (more). hivemind only: a "
        "torch.distributed group is fixed and torchft's lighthouse holds its own wait "
        "(docs/heterogeneous.md).",
    )
    deadline_mads: float = Field(
        3.0,
        gt=0.0,
        allow_inf_nan=False,
        description="sync.deadline: adaptive: k, the median absolute deviations of the round times above "
        "their median that the deadline allows.",
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
        if self.deadline == "adaptive" and (self.streaming or self.eager or self.mode == "async"):
            raise ValueError(
                "sync.deadline=adaptive bounds the wait at a round's sync of whole windows: use one fragment "
                "without overlap (sync.fragments=1, sync.overlap=0, sync.alpha=0) and sync.mode=sync"
            )
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
