"""The scaled GEMM: out = (a's values * a's factors) @ (b's values * b's factors)^T, accumulated in
fp32 and rounded once to `out_dtype`.

Tensor-wide scales run PyTorch's own `torch._scaled_mm`, the op a GPU's FP8 tensor cores run
(Hopper and later; it runs on CPUs too, which is how the recipes are proven here). Its rules are
the GPU's: `b` column-major, which an operand laid [rows, contraction] gives by transposing; on a
GPU every dimension a multiple of 16 and never E5M2 by E5M2 (other shapes take the emulated path).

Tiled scales (blockwise, mxfp8) are emulated on every device for now: each operand dequantized to
fp32 (its values times its tiles' factors, exact: an FP8 value times a power of two, or times an
fp32 factor rounded once) and one fp32 GEMM. That is the same sum as a tiled GEMM's, up to the
order of its additions. Calling the GPU's tiled kernels (cuBLAS's 1x128/128x128 on Hopper, MX on
Blackwell) waits for a GPU to prove them against this path (scripts/gpu_checks.sh fp8).
"""
from __future__ import annotations

import torch

from megalite.precision.quantize import Quantized
from megalite.precision.recipes import E5M2


def _native(a: Quantized, b: Quantized) -> bool:
    if a.tile is not None or b.tile is not None:
        return False
    if not a.data.is_cuda:
        return a.data.device.type == "cpu"
    m, k = a.data.shape
    n = b.data.shape[0]
    return (k % 16 == 0 and n % 16 == 0 and m % 16 == 0 and not (a.data.dtype == E5M2 and b.data.dtype == E5M2))


def scaled_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] times b [N, K] transposed: [M, N] in `out_dtype`."""
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"scaled_mm: contraction sizes differ ({tuple(a.data.shape)} and {tuple(b.data.shape)})")
    if _native(a, b):
        return torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv, out_dtype=out_dtype)
    return emulated_mm(a, b, out_dtype)


def emulated_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """The same product from the dequantized operands, in fp32."""
    return torch.mm(a.dequantize(), b.dequantize().t()).to(out_dtype)
