"""The rows of the WAN headline (bench_wan.py): what each method is, as overrides of the pico regime.

Every row trains the pico regime (configs/pico.yaml: K = 4, H = 15, 2,048 tokens per step) at its own
tuned inner lr (docs/results.md's pico tables; the DDP hooks' from configs/sweeps/wan_tune_hooks.yaml) with
a warmup-stable-decay schedule whose decay fills the last 20% of the row's own horizon (Hägele et al. 2024,
arXiv:2405.18392), so that a row trained longer than DDP is not held to a schedule chosen for DDP's horizon.
"""

from __future__ import annotations

from dataclasses import dataclass

FOUR_BIT = (
    "compression.scheme=statistical",
    "compression.bits=4",
    "compression.granularity=row",
    "compression.error_feedback=true",
)
TWO_BIT_RS = (*FOUR_BIT[:1], "compression.bits=2", *FOUR_BIT[2:], "sync.transport=reduce_scatter")


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    overrides: tuple[str, ...]
    backend: str = "torch"  # torch | hivemind | torchft
    per_step: bool = False  # a collective every inner step (DDP and its hooks): timed over a window
    twin: str | None = None  # the torch row with the same math: its loopback curve picks this row's horizon
    kill_at: float | None = None  # torchft: SIGKILL one worker at this fraction of the run, restart it

    def override(self, name: str) -> str | None:
        """The value this row sets for config field `name` (e.g. "compression.bits"), or None."""
        return next((o.split("=", 1)[1] for o in self.overrides if o.split("=", 1)[0] == name), None)

    @property
    def curve_row(self) -> str:
        return self.twin or self.key

    @property
    def warmup_steps(self) -> int:
        """Steps a window over a link leaves out of its median: the first ones warm up, and PowerSGD runs
        plain all-reduces until dp.powersgd_start_step (10, torch's default start_powerSGD_iter)."""
        return 15 if self.override("dp.comm_hook") == "powersgd" else 5


# The lrs tuned under this schedule, one seed (configs/sweeps/wan_tune.yaml; results in
# experiments/wan/results/wan_tune/, tests/net/test_wan_tuned_lrs.py holds these rows to them): DP (Muon) and
# MuLoCo K = 4 at 0.01, MuLoCo's also used with 4-bit and 2-bit.
DP = ("method=dp", "inner.lr=0.01")
MULOCO = ("inner.lr=0.01",)
# The hooks under this schedule (configs/sweeps/wan_tune_hooks.yaml; results in
# experiments/wan/results/wan_tune_hooks/): DDP + bf16 at 0.02 (ahead of 0.01 by 0.3% on both of 2 seeds;
# the headlines of 2026-12-03 to 12-05 ran it at 0.01, the first tune's pick on one seed), DDP + PowerSGD
# r4 at 0.02.
BF16 = ("method=dp", "inner.lr=0.02", "dp.comm_hook=bf16")
POWERSGD = ("method=dp", "inner.lr=0.02", "dp.comm_hook=powersgd", "dp.powersgd_rank=4")
# tau = 4 steps (the most H = 15, P = 3 allows): a fragment's all-gather over 20 ms links takes K - 1 = 3 ring
# hops of a round trip each plus its transfer, ~100 ms, which 2 pico steps (~60 ms) do not cover.
STREAMING = ("sync.fragments=3", "sync.overlap=4")
# A whole window overlapped (issue 59; Kale, Douillard and Donchev 2025, arXiv 2502.12996): the sync started
# after round r is applied after round r + 1's H = 15 inner steps, naively (the mean one round late) or with
# eager updates (each round's own outer gradient at once, the others' one round stale). Each at its own outer
# lr and momentum, as the paper tunes them per variant (configs/sweeps/wan_tune_overlap*.yaml; results in
# experiments/wan/results/wan_tune_overlap*/): pico's 0.7 and 0.6, tuned without a delay, overshoot (naive
# 2.16, eager 1.80 against 1.35 without overlap).
WINDOW = ("sync.overlap=15", "outer.lr=0.5", "outer.momentum=0.15")
EAGER = ("sync.overlap=15", "sync.eager=true", "outer.lr=0.35", "outer.momentum=0.6")
# Sparse MuLoCo (issue 61): 3.125% of every 64 x 64 tile at 2-bit values, error feedback decayed by 0.9, each
# coordinate averaged over the workers that sent it, under SparseLoCo's outer rule (SGD without momentum,
# norms sparsified too), which beat MuLoCo's Nesterov rule under this schedule (configs/sweeps/
# wan_tune_sparse.yaml; results in experiments/wan/results/wan_tune_sparse/: 1.4468 at outer lr 0.5 against
# 1.4812 for Nesterov at its best, 0.25) and in the pico frontier (configs/sweeps/sparse_frontier.yaml). Its
# message is 11,853 bytes a sync (MuLoCo 4-bit's: 110,424).
SPARSE = (
    "compression.scheme=topk",
    "compression.topk_chunk=4096",
    "compression.topk_fraction=0.03125",
    "compression.topk_value_bits=2",
    "compression.error_feedback=true",
    "compression.ef_decay=0.9",
    "compression.skip=[]",
    "sync.aggregate=sender_mean",
    "outer.lr=0.5",
    "outer.momentum=0.0",
    "outer.nesterov=false",
)
HIVEMIND = (*MULOCO, *FOUR_BIT, "backend.hivemind.target_group_size=4")  # a group starts once all 4 are in
KILLED = "MuLoCo 4-bit, torchft, a worker killed at 40% and restarted"
ROWS = {
    r.key: r
    for r in [
        Row("ddp", "DDP fp32", DP, per_step=True),
        Row("ddp_powersgd", "DDP + PowerSGD r4", POWERSGD, per_step=True),
        Row("ddp_bf16", "DDP + bf16", BF16, per_step=True),
        # DiLoCo (AdamW) K = 4: 1.5499 at 0.003 (0.0015: 1.6086, 0.006: 1.7096; wan_tune.yaml).
        Row("diloco_fp32", "DiLoCo fp32 (AdamW)", ("inner.optimizer=adamw", "inner.adamw.lr=0.003")),
        Row("muloco_fp32", "MuLoCo fp32", MULOCO),
        Row("muloco_4bit", "MuLoCo 4-bit", (*MULOCO, *FOUR_BIT)),
        Row("muloco_2bit_rs", "MuLoCo 2-bit reduce-scatter", (*MULOCO, *TWO_BIT_RS)),
        Row("muloco_4bit_window", "MuLoCo 4-bit, whole window overlapped", (*MULOCO, *FOUR_BIT, *WINDOW)),
        Row("muloco_4bit_eager", "MuLoCo 4-bit, whole window, eager", (*MULOCO, *FOUR_BIT, *EAGER)),
        Row("streaming_4bit", "streaming MuLoCo 4-bit P=3 tau=4", (*MULOCO, *FOUR_BIT, *STREAMING)),
        Row("muloco_sparse", "MuLoCo sparse 3.125% 2-bit (SparseLoCo's rule)", (*MULOCO, *SPARSE)),
        Row("torchft_4bit", "MuLoCo 4-bit, torchft", (*MULOCO, *FOUR_BIT), "torchft", twin="muloco_4bit"),
        Row("torchft_4bit_kill", KILLED, (*MULOCO, *FOUR_BIT), "torchft", twin="muloco_4bit", kill_at=0.4),
        Row("hivemind_4bit", "MuLoCo 4-bit, hivemind", HIVEMIND, "hivemind", twin="muloco_4bit"),
    ]
}
