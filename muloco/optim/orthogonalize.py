"""Newton-Schulz orthogonalization: the maths of Muon, as pure functions.

`newton_schulz(G)` maps a matrix G = U S V^T to approximately U S' V^T with S' near the identity, using
only matrix products. Each step applies the odd quintic p(x) = a x + b x^3 + c x^5 to every singular value:

    A = X X^T;   X <- a X + (b A + c A^2) X                                   # standard step

A coefficient set is a schedule of (a, b, c) triples. None of the named sets converges to exactly U V^T
in 5 steps; they trade accuracy for speed, which does not hurt Muon (Keller Jordan, "Muon", 2024: the
output is "something like US'V^T where S'_ii ~ Uniform(0.5, 1.5)"). Bands for singular values of the
normalized input in [0.01, 1] after 5 steps (scalar composition of the triples, tests/optim/):
keller [0.68, 1.13], muloco [0.98, 1.03], polar_express [0.86, 1.14].

Cost and precision, measured on the CPU where this was written (docs/optimizers.md):
- bf16 matmuls run ~2.2x faster than fp32 on a CPU with AVX512-BF16 (430 vs 190 GFLOP/s), so the
  iteration runs in bf16 there and on CUDA; elsewhere in fp32 (`default_ns_dtype`).
- Work happens on the short side: for a (rows, cols) matrix with rows > cols we use A = X^T X and
  right-multiplication instead of transposing, so the Gram matrix is min(rows, cols)^2.
- For rectangular matrices (long side >= 2x the short side) the Gram variant (`method="gram"`) iterates
  on the small Gram matrix R = X X^T and touches the big matrix only once per block of 2 steps; it
  computes the same polynomial in exact arithmetic with 17-22% fewer FLOPs for 3:1 and 4:1 shapes.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch
from torch import Tensor

Triple = tuple[float, float, float]
Method = Literal["auto", "standard", "gram"]

EPS = 1e-7  # added to the Frobenius norm before dividing (KellerJordan/Muon, torch.optim.Muon)

# Gram-variant block: steps between restarts (recompute X = Q X and R = X X^T from the big matrix).
# Measured in bf16 on inputs with flat to rank-1 spectra (experiments/benchmarks/bench_gram_block.py):
# blocks of 2 stay within ~2 percentage points of the standard iteration's error; blocks of 3 or more
# diverge on 1/i, 1/i^2 and rank-1 spectra (Q's dynamic range a1*a2*a3 outgrows bf16).
GRAM_BLOCK = 2


@dataclass(frozen=True)
class Coefficients:
    """A named schedule of (a, b, c) triples; step i uses triples[i], or the last one past the end.

    `norm_scale` divides the input by ||G||_F * norm_scale (Polar Express's safety margin: 1.02).
    """

    name: str
    triples: tuple[Triple, ...]
    norm_scale: float = 1.0

    def schedule(self, steps: int) -> list[Triple]:
        """The `steps` triples to apply; the last triple repeats when `steps` exceeds the list."""
        if steps < 1:
            raise ValueError(f"ns_steps must be >= 1, got {steps}")
        last = len(self.triples) - 1
        return [self.triples[min(i, last)] for i in range(steps)]


# Keller Jordan's quintic, the same triple every step (KellerJordan/Muon muon.py; torch.optim.Muon's
# default). Its slope at 0 is large, so small singular values grow fast; it oscillates around ~0.7-1.1
# and does not converge (repeating it more does not help: its fixed point 1.26 is unstable).
KELLER = Coefficients("keller", ((3.4445, -4.7750, 2.0315),))

# Per-iteration triples by You Jiacheng (x.com/YouJiacheng/status/1905861218138804534), used by Dion
# (microsoft/dion) and modded-nanogpt, and named "muloco" here after the MuLoCo paper's inner Muon.
# Repeating the last triple converges to 0.989.
MULOCO = Coefficients(
    "muloco",
    (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
)

# The Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932): optimal per-step quintics,
# this 5-step set computed for num_iters=5, safety_factor=2e-2, cushion=2 as in modded-nanogpt's
# train_gpt.py, with the input divided by 1.02 * ||G||_F. Repeating the last triple converges to 1.035.
POLAR_EXPRESS = Coefficients(
    "polar_express",
    (
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
    ),
    norm_scale=1.02,
)

COEFFICIENT_SETS: dict[str, Coefficients] = {c.name: c for c in (KELLER, MULOCO, POLAR_EXPRESS)}

CoefficientsLike = str | Coefficients | Sequence[Sequence[float]]


def resolve_coefficients(spec: CoefficientsLike) -> Coefficients:
    """A `Coefficients` from a set name (keller, muloco, polar_express), itself, or a list of triples."""
    if isinstance(spec, Coefficients):
        return spec
    if isinstance(spec, str):
        if spec not in COEFFICIENT_SETS:
            raise ValueError(
                f"ns_coefficients: unknown set {spec!r}; use one of {', '.join(COEFFICIENT_SETS)} "
                "or a list of (a, b, c) triples"
            )
        return COEFFICIENT_SETS[spec]
    triples = tuple(tuple(float(v) for v in t) for t in spec)
    if not triples or any(len(t) != 3 or not all(math.isfinite(v) for v in t) for t in triples):
        raise ValueError(
            f"ns_coefficients: expected a non-empty list of finite (a, b, c) triples, got {spec!r}"
        )
    return Coefficients("custom", triples)  # type: ignore[arg-type]


@lru_cache(maxsize=1)
def _cpu_has_native_bf16() -> bool:
    # Native bf16 dot products (AVX512-BF16 or AMX-BF16) make oneDNN's bf16 GEMM ~2x faster than fp32;
    # without them bf16 is emulated and slower. A flag check, not a timing, keeps the choice (and so the
    # numerics) the same from run to run.
    if not sys.platform.startswith("linux"):
        return False
    # ONEDNN_MAX_CPU_ISA caps oneDNN's kernels (e.g. AVX2 to reproduce another CPU): below
    # AVX512_CORE_BF16 its bf16 GEMM is emulated, as on a CPU without the flags.
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if cap and cap not in ("ALL", "DEFAULT") and "BF16" not in cap and "AMX" not in cap:
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_ns_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on CUDA and on CPUs with native bf16 matmul; fp32 elsewhere (docs/optimizers.md)."""
    kind = torch.device(device).type
    if kind == "cuda" or (kind == "cpu" and _cpu_has_native_bf16()):
        return torch.bfloat16
    return torch.float32


def uses_gram(rows: int, cols: int, method: Method = "auto") -> bool:
    """Whether `method` runs the Gram variant on a (rows, cols) matrix.

    auto: when the long side is >= 2x the short side. FLOP model for a block of 2 steps on an (n, m)
    matrix, in n^3-matmul units with r = m/n: standard 4r + 2, Gram 2r + 5, so Gram wins for r > 1.5
    (over 5 steps, blocks of 2, 2, 1: 6r + 11 vs 10r + 5, i.e. -8% at r = 2, -17% at 3, -22% at 4).
    """
    if method == "auto":
        return max(rows, cols) >= 2 * min(rows, cols)
    if method not in ("standard", "gram"):
        raise ValueError(f"ns method must be auto, standard or gram, got {method!r}")
    return method == "gram"


def normalize(G: Tensor, norm_scale: float = 1.0, eps: float = EPS) -> Tensor:
    """G / (||G||_F * norm_scale + eps) per matrix over the last two dims, in G's dtype (do this before
    any cast to bf16: a tiny or huge G would lose its digits). A zero G stays zero."""
    norm = torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True)  # (..., 1, 1)
    return G / (norm * norm_scale + eps)


def newton_schulz(
    G: Tensor,
    coefficients: CoefficientsLike = "keller",
    steps: int = 5,
    *,
    dtype: torch.dtype | None = None,
    method: Method = "auto",
    eps: float = EPS,
) -> Tensor:
    """Approximately orthogonalize G (..., rows, cols); returns the same shape in `dtype`.

    dtype: the iteration's precision; None = `default_ns_dtype(G.device)`. The input is normalized
    in G's own dtype first, so the cast cannot over- or underflow.
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a batch of matrices, got shape {tuple(G.shape)}")
    coeffs = resolve_coefficients(coefficients)
    X = normalize(G, coeffs.norm_scale, eps).to(dtype or default_ns_dtype(G.device))
    return ns_iterate(X, coeffs.schedule(steps), method)


def ns_iterate(X: Tensor, schedule: Sequence[Triple], method: Method = "auto") -> Tensor:
    """Run the triples of `schedule` on an already normalized X (..., rows, cols) in X's dtype."""
    rows, cols = X.shape[-2:]
    tall = rows > cols  # then work on X^T X (cols x cols): the transpose trick without a transpose
    if uses_gram(rows, cols, method):
        return _gram_iterate(X, schedule, tall)
    return _standard_iterate(X, schedule, tall)


def _gram(X: Tensor, tall: bool) -> Tensor:
    return X.mT @ X if tall else X @ X.mT  # (..., n, n), n = min(rows, cols)


def _mul_small(X: Tensor, M: Tensor, tall: bool, beta: float = 0.0) -> Tensor:
    """beta X + M X, or beta X + X M for a tall X: M (..., n, n) acts on the short side."""
    if X.ndim == 2:
        return torch.addmm(X, X, M, beta=beta) if tall else torch.addmm(X, M, X, beta=beta)
    return torch.baddbmm(X, X, M, beta=beta) if tall else torch.baddbmm(X, M, X, beta=beta)


def _poly(A: Tensor, b: float, c: float) -> Tensor:
    """b A + c A^2 for a symmetric (..., n, n) A."""
    if A.ndim == 2:
        return torch.addmm(A, A, A, beta=b, alpha=c)
    return torch.baddbmm(A, A, A, beta=b, alpha=c)


def _standard_iterate(X: Tensor, schedule: Sequence[Triple], tall: bool) -> Tensor:
    batched = X.ndim > 3
    if batched:  # flatten extra leading dims so (b)addmm sees 2-D or 3-D operands
        lead = X.shape[:-2]
        X = X.reshape(-1, *X.shape[-2:])
    for a, b, c in schedule:
        A = _gram(X, tall)  # (..., n, n)
        X = _mul_small(X, _poly(A, b, c), tall, beta=a)  # a X + (b A + c A^2) X
    return X.reshape(*lead, *X.shape[-2:]) if batched else X


def _gram_iterate(X: Tensor, schedule: Sequence[Triple], tall: bool) -> Tensor:
    """Gram Newton-Schulz: within a block, every iterate is X_k = Q_k X with Q_k a polynomial of
    R = X X^T, so we update the small (n, n) matrices Q and R and apply Q to X once per block:

        Z = a I + b R + c R^2;   Q <- Q Z;   R <- Z R Z        (Z, R commute; Z R Z stays symmetric)

    The block restarts (X <- Q X, R <- X X^T) every GRAM_BLOCK steps to stop rounding drift in R and Q.
    Same idea as Dao-AILab's gram-newton-schulz; written from the maths, not copied.
    """
    batched = X.ndim > 3
    if batched:
        lead = X.shape[:-2]
        X = X.reshape(-1, *X.shape[-2:])
    for start in range(0, len(schedule), GRAM_BLOCK):
        block = schedule[start : start + GRAM_BLOCK]
        R = _gram(X, tall)  # (..., n, n)
        Q: Tensor | None = None
        for i, (a, b, c) in enumerate(block):
            Z = _poly(R, b, c)
            Z.diagonal(dim1=-2, dim2=-1).add_(a)  # Z = a I + b R + c R^2
            Q = Z if Q is None else Q @ Z
            if i < len(block) - 1:  # the block's last R is never used
                R = Z @ R @ Z
        assert Q is not None, f"{block=}"
        X = X @ Q if tall else Q @ X  # Q is symmetric up to rounding
    return X.reshape(*lead, *X.shape[-2:]) if batched else X
