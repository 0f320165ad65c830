"""Muon's orthogonalization: a Newton-Schulz iteration that takes a matrix to (about) the nearest
semi-orthogonal one, U S' V^T with S' near 1 for G = U S V^T, and the update's scale by shape.

The iteration, on X = G / ||G||_F (transposed first so that X X^T is the smaller Gram matrix):
    A = X X^T;  B = b A + c A A;  X <- a X + B X
with one (a, b, c) per step. The coefficients are the quintic ones Keller Jordan's modded-nanogpt
published (five sets, applied in turn: the steps must be a multiple of five), which Megatron-Core's
Muon uses by default. Under the "medium" fp32 matmul precision the iteration runs in bf16, as
Megatron-Core's does (off a GPU emulated: fp32 GEMMs of bf16 values, each result rounded to bf16);
"high" (TF32 on a GPU) and "highest" keep fp32.

Each step is equivariant under permutations of rows and of columns (P X Q in, P X' Q out), so the
order a layout stores rows in (megalite's [gate; up], a TP rank's heads) does not change the result,
only the order of floating-point sums. With X's rows or columns sharded over a group, X X^T is a sum
over the shards: one all-reduce per step gives every rank the whole Gram matrix
(`--muon-tp-mode distributed`).
"""
from __future__ import annotations

import contextlib

import torch

from megalite.parallel import traffic

QUINTIC = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
PRECISIONS = ("medium", "high", "highest")
EPS = 1e-7


def scale_factor(rows: int, cols: int, mode: str) -> float:
    """The update's scale for a rows x cols matrix: spectral sqrt(max(rows, cols)) (Kimi's Moonlight,
    whose lr carries over from AdamW's), shape_scaling sqrt(max(1, rows / cols)) (Keller Jordan's),
    unit_rms_norm sqrt(rows / cols) (Scion's)."""
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, rows / cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    raise ValueError(f"muon scale mode {mode!r}: one of {', '.join(SCALE_MODES)}")


@contextlib.contextmanager
def matmul_precision(precision: str):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _fma(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float, alpha: float) -> torch.Tensor:
    """beta c + alpha a @ b, one fused call (batched over a stack of experts' matrices)."""
    return (torch.addmm if a.dim() == 2 else torch.baddbmm)(c, a, b, beta=beta, alpha=alpha)


def newton_schulz(x: torch.Tensor, steps: int, precision: str = "medium", transpose: bool | None = None,
                  group=None, emulate_bf16: bool | None = None) -> torch.Tensor:
    """The orthogonalized x (fp32, [..., m, n]; a leading dim stacks matrices done each alone).
    `group`: x is this rank's shard of a matrix whose rows (transpose True) or columns (False) are
    sharded over the group, and the result is this rank's shard of the whole matrix's.
    `emulate_bf16` (default: off a GPU): "medium"'s bf16 GEMMs as fp32 GEMMs of bf16 values with each
    result rounded to bf16, what a bf16 GEMM with fp32 accumulation gives (to the order of its sums),
    at fp32's speed on a CPU, whose bf16 GEMMs are tens of times slower."""
    if steps % len(QUINTIC):
        raise ValueError(f"Newton-Schulz steps {steps}: a multiple of {len(QUINTIC)} (the quintic coefficient sets)")
    if transpose is None:
        transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    square = x.square().sum(dim=(-2, -1), keepdim=True)
    if group is not None:
        traffic.counted_all_reduce("tp", square, group)
    x = x / square.sqrt().clamp_min(EPS)
    emulate = precision == "medium" and (x.device.type != "cuda" if emulate_bf16 is None else emulate_bf16)
    rounded = (lambda t: t.to(torch.bfloat16).float()) if emulate else (lambda t: t)  # noqa: E731
    with matmul_precision("highest" if emulate else precision):
        if precision == "medium":  # PyTorch has no fp32-in, bf16-compute GEMM: the iteration in bf16
            x = rounded(x) if emulate else x.to(torch.bfloat16)
        for a, b, c in QUINTIC * (steps // len(QUINTIC)):
            gram = x @ x.mT
            if group is not None:  # summed in fp32 over the shards
                full = gram.float()
                traffic.counted_all_reduce("tp", full, group)
                gram = full.to(x.dtype)
            gram = rounded(gram)
            x = rounded(_fma(x, rounded(_fma(gram, gram, gram, b, c)), x, a, 1.0))
    x = x.float()
    return x.mT if transpose else x
