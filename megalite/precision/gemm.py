"""The scaled GEMM: out = (a's values * a's factors) @ (b's values * b's factors)^T, accumulated in
fp32 and rounded once to `out_dtype`.

Tensor-wide scales run PyTorch's own `torch._scaled_mm`, the op a GPU's FP8 tensor cores run
(Hopper and later; it runs on CPUs too, which is how the recipes are proven here). Its rules are
the GPU's: `b` column-major, which an operand laid [rows, contraction] gives by transposing; on a
GPU every dimension a multiple of 16 and never E5M2 by E5M2 (other shapes take the emulated path).

Tiled scales (blockwise, mxfp8) run the GPU's tiled GEMMs where it has them (cuBLAS's 1x128/128x128
on Hopper, MX on Blackwell: megalite.precision.native), each kind trusted after its first problem
agrees with the emulation. Elsewhere they are emulated: each operand dequantized to fp32 (its values
times its tiles' factors, exact: an FP8 value times a power of two, or times an fp32 factor rounded
once) and one fp32 GEMM, the same sum as a tiled GEMM's up to the order of its additions.
"""
from __future__ import annotations

import torch

from megalite.precision import native
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
        if a.data.is_cuda:
            return torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv, out_dtype=out_dtype)
        return _scaled_mm_on_cpu(a, b, out_dtype)
    kind = native.tiled_kind(a, b)
    if kind is not None:
        return native.trusted(native.problem_key(kind, a, b, out_dtype), lambda: native.tiled_mm(a, b, kind, out_dtype),
                              lambda: emulated_mm(a, b, out_dtype))
    return emulated_mm(a, b, out_dtype)


def _scaled_mm_on_cpu(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    # On a CPU with AMX-INT8 (Sapphire Rapids and later) torch routes _scaled_mm to oneDNN, whose FP8
    # kernel ran a 256^3 product in 0.5-1.5 s here (2026-12-02); with oneDNN off the op takes its
    # own fp32 path: 500x faster, and the same numbers on every CPU (oneDNN scales after the sum).
    with torch.backends.mkldnn.flags(enabled=False):
        return torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv, out_dtype=out_dtype)


def emulated_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """The same product from the dequantized operands, in fp32."""
    return torch.mm(a.dequantize(), b.dequantize().t()).to(out_dtype)


def grouped_scaled_mm(a: list[Quantized | None], b: list[Quantized | None], counts: list[int],
                      out: torch.Tensor) -> torch.Tensor:
    """Each expert's a[e] [counts[e], K] times b[e] [N, K] transposed, stacked: [sum(counts), N] in
    out's dtype. The GPU's grouped GEMM where it has one (checked against the loop on first use, and
    then returned as a tensor of its own), else one scaled GEMM per expert written into `out` (a[e]
    and b[e] None for an expert without tokens)."""
    def one_per_expert() -> torch.Tensor:
        for q, w, rows in zip(a, b, out.split(counts)):
            if q is not None:
                rows.copy_(scaled_mm(q, w, out.dtype))
        return out

    if native.grouped_kind(a, b, out.dtype) is None:
        return one_per_expert()
    return native.trusted(native.grouped_key(a, b, out.dtype), lambda: native.grouped_mm(a, b, counts, out.dtype),
                          one_per_expert)
