"""LayerNorm whose gradients do not depend on torch's CPU thread count.

torch's CPU layer_norm backward (aten/src/ATen/native/cpu/layer_norm_kernel.cpp) adds the weight gradient
sum_rows(dy * xhat) (and the bias's, sum_rows(dy)) into one buffer per thread and then adds the buffers:
which rows each thread gets, and so the last bits of the sum, follow torch.get_num_threads(). One process
simulating 2 workers at torch's 2 threads then trains apart from 2 processes at 1 thread each (the
quickstart at 200k tokens: val loss 2.446834 vs 2.446106), and a resume at another `train.threads` is not
bitwise. RMSNorm never had this: torch's is a composite of elementwise ops whose weight gradient is a
`sum` over the rows, which torch's reductions split across threads only along the columns they keep.

`LayerNorm` keeps nn.LayerNorm's forward (the same kernel, so the same outputs bit for bit: evals and the
GPT-2 export are unchanged), its input gradient (torch's, computed row by row, so independent of the
threads) and its parameters and state_dict keys; only the weight and bias gradients are computed as that
`sum` over the rows. What it costs (experiments/benchmarks/bench_layernorm.py, docs/records/benchmarks.md):
the norm's forward+backward takes 1.5-1.7x torch's (its backward reads the input again for the weight
gradient), a whole pico or quickstart training step 1.00-1.01x at 1 thread, within the noise.
On other devices (CUDA: no thread count) and without grad it is F.layer_norm itself. Under torch.compile
inductor generates its own reductions: the thread independence is then inductor's, not this module's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _LayerNormFunction(torch.autograd.Function):
    """y = (x - mean) * rstd * weight + bias over the trailing `shape` dims; gradients as the module says.
    Written in functorch's form (forward without ctx, setup_context, a generated vmap rule) so that
    simulation.batched's vmap over the replicas runs it too."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, shape: list[int], weight, bias, eps: float):
        return torch.ops.aten.native_layer_norm(x, shape, weight, bias, eps)  # y; mean, rstd: (..., 1)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, shape, weight, bias, _ = inputs
        _, mean, rstd = output
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.mark_non_differentiable(mean, rstd)
        ctx.shape, ctx.bias_dtype = shape, None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx, dy, _mean_grad, _rstd_grad):
        x, weight, mean, rstd = ctx.saved_tensors
        needs_x, _, needs_weight, needs_bias, _ = ctx.needs_input_grad
        dx = dweight = dbias = None
        if needs_x:  # torch's own: each row's dx is computed whole by one thread
            dx, _, _ = torch.ops.aten.native_layer_norm_backward(
                dy, x, ctx.shape, mean, rstd, weight, None, [True, False, False]
            )
        rows = tuple(range(x.ndim - len(ctx.shape)))  # (B, T) for (B, T, C)
        # Sums over rows: torch splits a reduction across threads only along the columns it keeps (when
        # it keeps 2 or more: TensorIteratorReduce.cpp), so each column is summed whole by one thread.
        if needs_weight:  # sum_rows(dy * xhat), xhat = (x - mean) * rstd, in one buffer (3x faster)
            dweight = torch.sub(x, mean).mul_(rstd).mul_(dy).sum(rows).to(weight.dtype)
        if needs_bias:
            dbias = dy.sum(rows).to(ctx.bias_dtype)
        return dx, None, dweight, dbias, None


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same arguments, parameters and outputs) whose CPU gradients are the same bits at any
    torch.get_num_threads(); see the module docstring for why and what it costs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = list(self.normalized_shape)
        if x.device.type != "cpu" or not torch.is_grad_enabled():
            return F.layer_norm(x, shape, self.weight, self.bias, self.eps)
        return _LayerNormFunction.apply(x, shape, self.weight, self.bias, self.eps)[0]
