"""`dp.comm_hook`: method dp's gradients through torch's own DistributedDataParallel and its communication
hooks (torch.distributed.algorithms.ddp_comm_hooks), the baseline a user who wants to save bandwidth tries
first: `bf16_compress_hook` (half the bytes) and `powerSGD_hook` (Vogels et al. 2019, "PowerSGD: Practical
Low-Rank Gradient Compression", with torch's error feedback and warm start).

What this module adds around torch's hooks, and nothing else:
- the bytes each hook sends, booked per all-reduce as it issues them (bf16: the bucket in bf16; PowerSGD:
  its uncompressed tensors, P and Q, from torch's own `total_numel_after_compression` and P/Q buffers);
- PowerSGD's state (iteration, error feedback, warm-start P/Q, its numpy RNG) in the run's checkpoints, so a
  resumed run compresses exactly as the uninterrupted one. torch keeps that state per gradient bucket, and
  DDP lays its buckets out anew after its first step (in the order the gradients became ready), so a
  resumed DDP's first step has another layout than the one the state was written for: the state is kept
  per parameter (`PerParameterState`) and laid out again for whichever buckets DDP hands the hook. Every
  PowerSGD operation is per tensor or per element, so the result does not depend on the layout.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterable
from itertools import islice

import numpy as np
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from muloco.config import DpConfig
from muloco.run.replica import forward_backward

BF16_BYTES, FP32_BYTES = 2, 4


class CommHookDDP:
    """One process's model under DDP with `cfg.comm_hook` (none: fp32, as torch's DDP runs by default);
    gradients come out averaged over the ranks."""

    def __init__(self, model: nn.Module, cfg: DpConfig) -> None:
        # broadcast_buffers=False: no broadcast each forward (the built-in GPT has no buffers; a model's own,
        # e.g. rotary tables, do not train). torch 2.13 deprecates the name for one torch 2.9 lacks.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            buckets = {} if cfg.bucket_mb is None else {"bucket_cap_mb": cfg.bucket_mb}
            self.module = DistributedDataParallel(model, broadcast_buffers=False, **buckets)
        self.payloads: list[int] = []  # bytes of each all-reduce issued since take_payloads()
        # When the last bucket's all-reduce was issued (its gradients ready: the backward's compute is done)
        # and when the last one completed: the backward's wait on the network is the gap (take_wait_s).
        self._issued = self._completed = 0.0
        self.powersgd: powerSGD_hook.PowerSGDState | None = None
        if cfg.comm_hook == "none":  # fp32: DDP's own bucketed all-reduce, overlapped with the backward
            self.module.register_comm_hook(None, self._fp32)
        elif cfg.comm_hook == "bf16":
            self.module.register_comm_hook(None, self._bf16)
        else:
            self.powersgd = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=cfg.powersgd_rank,
                start_powerSGD_iter=cfg.powersgd_start_step,
                # torch logs its compression stats every N steps; the run reports bytes itself.
                compression_stats_logging_frequency=2**62,
            )
            self.by_parameter = PerParameterState(self.powersgd, list(model.parameters()))
            self.module.register_comm_hook(self.powersgd, self._powersgd)

    # -- the hooks: torch's, with the bytes they send booked -----------------------------------------
    # Unannotated: DDP compares a hook's annotations with real types, and this module's are strings.
    # DDP refuses bf16_compress_hook by name without CUDA and NCCL; gloo all-reduces bf16 as well, and
    # under this wrapper's name the same hook runs there.
    def _fp32(self, state, bucket):
        self.payloads.append(bucket.buffer().numel() * FP32_BYTES)
        return self._timed(default_hooks.allreduce_hook(state, bucket))

    def _bf16(self, state, bucket):
        self.payloads.append(bucket.buffer().numel() * BF16_BYTES)
        return self._timed(default_hooks.bf16_compress_hook(state, bucket))

    def _powersgd(self, state, bucket):
        if state.iter < state.start_powerSGD_iter:  # torch's plain fp32 all-reduce of the bucket
            self.payloads.append(bucket.buffer().numel() * FP32_BYTES)
            return self._timed(powerSGD_hook.powerSGD_hook(state, bucket))
        self.by_parameter.lay_out(bucket)
        numel_before = state.total_numel_after_compression
        future = powerSGD_hook.powerSGD_hook(state, bucket)
        sent = state.total_numel_after_compression - numel_before  # uncompressed + P + Q elements
        p = state.p_memory_dict[bucket.index()].numel()
        q = state.q_memory_dict[bucket.index()].numel()
        # Three all-reduces, one after the other: the uncompressed tensors, then P, then Q.
        self.payloads += [n * FP32_BYTES for n in (sent - p - q, p, q) if n > 0]
        return self._timed(future)

    def _timed(self, future):
        """A bucket's all-reduce, issued now; its completion time noted (on the thread that completes it)."""
        self._issued = time.perf_counter()

        def completed(done):
            self._completed = max(self._completed, time.perf_counter())
            return done.value()

        return future.then(completed)

    def take_wait_s(self) -> float:
        """The last step's wait on the network: from the last bucket's all-reduce issued (the backward's
        compute done) to the last one completed, which the backward waits for before it returns."""
        wait = max(0.0, self._completed - self._issued) if self._issued else 0.0
        self._issued = self._completed = 0.0
        return wait

    def take_payloads(self) -> list[int]:
        """The bytes of each all-reduce issued since the last call (one step's)."""
        payloads, self.payloads = self.payloads, []
        return payloads

    # -- a step's forward and backward ---------------------------------------------------------------
    def forward_backward(
        self,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        micro_batches: int,
        device: torch.device,
        autocast: Callable[[], contextlib.AbstractContextManager],
    ) -> float:
        """Gradients of the mean loss over this rank's micro-batches, averaged over the ranks by the hook
        during the last backward (the earlier ones accumulate under no_sync). Returns the sum of losses."""
        batches, scale = iter(batches), 1.0 / micro_batches
        with self.module.no_sync():
            total = forward_backward(self.module, islice(batches, micro_batches - 1), scale, device, autocast)
        return total + forward_backward(self.module, batches, scale, device, autocast)

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return self.by_parameter.state_dict() if self.powersgd is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.powersgd is not None:
            self.by_parameter.load_state_dict(state)


class PerParameterState:
    """PowerSGD's per-bucket state (error feedback, warm-start P and Q) kept per parameter across DDP's
    bucket layouts. torch's hook lays out a bucket's error as its gradients in bucket order, and P and Q
    per matrix it compresses, grouped by shape in order of first appearance (powerSGD_hook.py, Steps I
    and III); `pieces` follows it."""

    def __init__(self, state: powerSGD_hook.PowerSGDState, parameters: list[torch.Tensor]) -> None:
        self.state = state
        self.index_of = {id(p): i for i, p in enumerate(parameters)}
        self.shapes = [(p.shape[0], p.numel() // p.shape[0]) for p in parameters]  # tensor.view(n, -1)
        self.layouts: dict[
            int, tuple[int, ...]
        ] = {}  # bucket index -> its parameters, as torch's state has it
        self.pending: dict[str, dict[int, torch.Tensor]] = {}  # per parameter, for buckets not yet laid out

    def lay_out(self, bucket) -> None:
        """Before torch's hook compresses `bucket`: its state in the bucket's current layout."""
        state, index = self.state, bucket.index()
        layout = tuple(self.index_of[id(p)] for p in bucket.parameters())
        if self.layouts.get(index, layout) != layout:  # DDP rebuilt its buckets: take every bucket apart
            self.pending = self._take_apart()
        parts = self.pending
        if index not in state.error_dict and parts and all(i in parts["error"] for i in layout):
            error, p, q = self.pieces(layout)
            state.error_dict[index] = flat = torch.cat([parts["error"][i] for i in error])
            state.p_memory_dict[index] = torch.cat([flat.new_empty(0), *(parts["p"][i] for i in p)])
            state.q_memory_dict[index] = torch.cat([flat.new_empty(0), *(parts["q"][i] for i in q)])
        self.layouts[index] = layout

    def pieces(self, layout: tuple[int, ...]) -> tuple[dict, dict, dict]:
        """Per parameter of a bucket: its (offset, length) in the bucket's error, P and Q."""
        error, offset, groups = {}, 0, {}
        rank, min_rate = self.state.matrix_approximation_rank, self.state.min_compression_rate
        for i in layout:
            n, m = self.shapes[i]
            error[i], offset = (offset, n * m), offset + n * m
            if powerSGD_hook._should_compress(n, m, min(n, m, rank), min_rate)[0]:
                groups.setdefault((n, m), []).append(i)
        p, q, p_offset, q_offset = {}, {}, 0, 0
        for (n, m), members in groups.items():
            r = min(n, m, rank)
            for i in members:
                p[i], p_offset = (p_offset, n * r), p_offset + n * r
                q[i], q_offset = (q_offset, m * r), q_offset + m * r
        return error, p, q

    def _take_apart(self) -> dict[str, dict[int, torch.Tensor]]:
        """torch's per-bucket state, per parameter, and torch's dicts emptied (laid out again on use)."""
        parts = self._per_parameter()
        self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict = {}, {}, {}
        self.layouts = {}
        return parts

    def _per_parameter(self) -> dict[str, dict[int, torch.Tensor]]:
        """The state per parameter: what is still pending, and torch's buckets cut by their layouts."""
        state = self.state
        parts = {key: dict(values) for key, values in self.pending.items()} or {"error": {}, "p": {}, "q": {}}
        for index, layout in self.layouts.items():
            pieces = self.pieces(layout)
            for key, flat, where in zip(
                ("error", "p", "q"),
                (state.error_dict.get(index), state.p_memory_dict.get(index), state.q_memory_dict.get(index)),
                pieces,
                strict=True,
            ):
                for i, (offset, length) in where.items():
                    if flat is not None:
                        parts[key][i] = flat[offset : offset + length].clone()
        return parts

    def state_dict(self) -> dict:
        s = self.state
        parts = self._per_parameter()
        _, keys, pos, has_gauss, cached = s.rng.get_state()
        return {
            "iter": s.iter,
            **parts,
            "numel": [s.total_numel_before_compression, s.total_numel_after_compression],
            "rng": {
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": pos,
                "gauss": (has_gauss, cached),
            },
        }

    def load_state_dict(self, state: dict) -> None:
        s = self.state
        s.iter = state["iter"]
        self.pending = {key: dict(state[key]) for key in ("error", "p", "q")}
        s.error_dict, s.p_memory_dict, s.q_memory_dict, self.layouts = {}, {}, {}, {}
        s.total_numel_before_compression, s.total_numel_after_compression = state["numel"]
        rng = state["rng"]
        keys = rng["keys"].numpy().astype(np.uint32)
        s.rng.set_state(("MT19937", keys, rng["pos"], rng["gauss"][0], rng["gauss"][1]))
