"""The GPU's own tiled and grouped FP8 GEMMs, trusted only after they agree with the emulation.

torch's `torch.nn.functional.scaled_mm` runs the tiled recipes on the tensor cores: blockwise
(1x128 activations and gradients, 128x128 weights, fp32 factors; cuBLAS on Hopper, E4M3 operands)
and mxfp8 (1x32 blocks, E8M0 factors in cuBLAS's swizzled 128x4 layout; Blackwell). Each wants its
factors in a memory layout of its own (below); a factor read from the wrong place is a wrong number,
not an error. So the first product of each kind of problem (recipe, operand formats, contraction and
output widths, device) runs both ways on the real operands and compares; a disagreement, or an error
from torch, prints one warning and sends that kind to the emulation for the rest of the run. The
check costs one emulated GEMM and one host sync per kind, once: none in the steady state.

The layouts, as torch's checks state them (aten/src/ATen/native/cuda/ScaledBlas.cpp), for a = [M, K]
and b = [K, N] (b column-major, our [N, K] operand transposed):
- 1x128 factors of an operand with R rows: shape [R, ceil(K/128)], strides (1, R) (column-major);
- 128x128 factors of b: shape [roundup(ceil(K/128), 4), ceil(N/128)], strides (1, that roundup);
- mxfp8: [roundup(R, 128), roundup(ceil(K/32), 4)] padded, each 128x4 tile stored with its row r
  (0..127) and column c (0..3) at (r % 32) * 16 + (r // 32) * 4 + c, tiles row-major (cuBLAS's
  block-scaling-factor layout).

The experts' grouped GEMM (`torch.nn.functional.scaled_grouped_mm`, Hopper and Blackwell, bf16
output): a = every expert's rows [T, K] row-major, b = [E, K, N] (each expert's [N, K] transposed),
offsets the int32 ends of each expert's rows; row-wise factors: [T] for a, [E, N] for b, so each
expert's tensor-wide factor repeated over its rows (a) and its outputs (b).
"""
from __future__ import annotations

import itertools
import math
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

from megalite.precision.quantize import Quantized
from megalite.precision.recipes import BLOCK, E4M3, MX_BLOCK

CHECK_TOLERANCE = 1e-4  # relative Frobenius distance: the two differ only in the order of their fp32 sums

_verdicts: dict[tuple, bool] = {}  # kind of problem -> the native GEMM agreed with the emulation


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def blockwise_factors(q: Quantized, role: str) -> torch.Tensor:
    """q's fp32 factors laid out as torch's blockwise GEMM reads them; `role` "a" (left operand, [M, K])
    or "b" (right operand, q is [N, K], b = q transposed)."""
    rows, k = q.data.shape
    if q.tile == (1, BLOCK):
        return q.scale_inv.float().t().contiguous().t()  # [rows, K/128], strides (1, rows)
    if q.tile == (BLOCK, BLOCK) and role == "b":
        blocks_k = math.ceil(k / BLOCK)
        padded = q.scale_inv.new_ones(q.scale_inv.shape[0], _round_up(blocks_k, 4), dtype=torch.float32)
        padded[:, :blocks_k] = q.scale_inv
        return padded.t()  # [roundup(K/128, 4), N/128], strides (1, roundup)
    raise ValueError(f"no blockwise layout for a {q.tile}-tiled operand as {role!r}")


def mx_factors(q: Quantized) -> torch.Tensor:
    """q's E8M0 factors ([rows, K/32], powers of two) in cuBLAS's swizzled 128x4 tiles, flat."""
    rows, cols = q.scale_inv.shape
    padded = q.scale_inv.new_ones(_round_up(rows, 128), _round_up(cols, 4), dtype=torch.float32)
    padded[:rows, :cols] = q.scale_inv
    tiles = padded.view(padded.shape[0] // 128, 4, 32, padded.shape[1] // 4, 4)  # [row tile, r//32, r%32, col tile, c]
    return tiles.permute(0, 3, 2, 1, 4).contiguous().flatten().to(torch.float8_e8m0fnu)


def tiled_kind(a: Quantized, b: Quantized) -> str | None:
    """Which of the GPU's tiled GEMMs can take a x b^T: "blockwise" (Hopper, E4M3), "mxfp8"
    (Blackwell), or None (the emulation: a CPU, another GPU, or shapes the kernels refuse)."""
    capability = _capability(a.data.device)
    if capability is None or a.tile is None or b.tile is None:
        return None
    (m, k), n = a.data.shape, b.data.shape[0]
    if k % 16 or n % 16 or m % 16:
        return None
    major = capability[0]
    if a.tile == b.tile == (1, MX_BLOCK):
        return "mxfp8" if major >= 10 else None
    if a.tile == (1, BLOCK) and b.tile in ((1, BLOCK), (BLOCK, BLOCK)):
        return "blockwise" if major == 9 and a.data.dtype == b.data.dtype == E4M3 else None
    return None


def _capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def _recipe(q: Quantized):
    return {(1, BLOCK): F.ScalingType.BlockWise1x128, (BLOCK, BLOCK): F.ScalingType.BlockWise128x128,
            (1, MX_BLOCK): F.ScalingType.BlockWise1x32}[q.tile]


def tiled_mm(a: Quantized, b: Quantized, kind: str, out_dtype: torch.dtype) -> torch.Tensor:
    """torch's tiled scaled GEMM of a [M, K] by b [N, K] transposed."""
    if kind == "mxfp8":
        factors = (mx_factors(a), mx_factors(b))
        swizzle = F.SwizzleType.SWIZZLE_32_4_4
    else:
        factors = (blockwise_factors(a, "a"), blockwise_factors(b, "b"))
        swizzle = F.SwizzleType.NO_SWIZZLE
    return scaled_mm_op(a.data, b.data.t(), factors[0], _recipe(a), factors[1], _recipe(b), swizzle_a=swizzle,
                        swizzle_b=swizzle, output_dtype=out_dtype)


scaled_mm_op = F.scaled_mm  # the ops themselves, names of their own so tests can replay their rules on a CPU
scaled_grouped_mm_op = F.scaled_grouped_mm


def grouped_kind(a: list[Quantized | None], b: list[Quantized | None], out_dtype: torch.dtype) -> str | None:
    """"grouped" where the GPU's grouped GEMM can take every expert's a[e] x b[e]^T at once
    (tensor-wide factors, bf16 out, Hopper or Blackwell), else None (one GEMM per expert)."""
    present = [q for q in a + b if q is not None]
    if not present or out_dtype != torch.bfloat16 or any(q.tile is not None for q in present):
        return None
    capability = _capability(present[0].data.device)
    if capability is None or capability[0] not in (9, 10):
        return None
    k, n = present[0].data.shape[1], next(q for q in b if q is not None).data.shape[0]
    return "grouped" if k % 16 == 0 and n % 16 == 0 else None


def grouped_mm(a: list[Quantized | None], b: list[Quantized | None], counts: list[int],
               out_dtype: torch.dtype) -> torch.Tensor:
    """The experts' a[e] [counts[e], K] x b[e] [N, K]^T stacked: [sum(counts), N] (b[e] None where
    counts[e] is 0)."""
    some_b = next(q for q in b if q is not None)
    n, k = some_b.data.shape
    device = some_b.data.device
    rows = [(q, c) for q, c in zip(a, counts) if c]
    mat_a = torch.cat([q.data for q, _ in rows])
    scale_a = torch.cat([q.scale_inv.float().reshape(1).expand(c) for q, c in rows])
    idle = torch.zeros_like(some_b.data)  # an expert without tokens: any weight, none of it is read
    mat_b = torch.stack([idle if q is None else q.data for q in b]).transpose(1, 2)
    ones = torch.ones((), device=device)
    scale_b = torch.stack([(ones if q is None else q.scale_inv.float()).reshape(1).expand(n) for q in b])
    # The ends of each expert's rows, copied without waiting for the GPU (a blocking copy would).
    ends = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32)
    ends = ends.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else ends.to(device)
    return scaled_grouped_mm_op(mat_a, mat_b, scale_a, F.ScalingType.RowWise, scale_b.contiguous(),
                                F.ScalingType.RowWise, offs=ends, output_dtype=out_dtype)


def grouped_key(a: list[Quantized | None], b: list[Quantized | None], out_dtype: torch.dtype) -> tuple:
    q = next(x for x in a if x is not None)
    w = next(x for x in b if x is not None)
    return ("grouped", q.data.dtype, w.data.dtype, len(b), q.data.shape[1], w.data.shape[0], out_dtype,
            str(q.data.device))


def trusted(key: tuple, native: Callable[[], torch.Tensor], emulated: Callable[[], torch.Tensor]) -> torch.Tensor:
    """native() once it has agreed with emulated() on the first problem of its `key`; else emulated()."""
    verdict = _verdicts.get(key)
    if verdict is not None:
        return native() if verdict else emulated()
    want = emulated()
    if not bool(torch.isfinite(want).all()):  # an inf or NaN step proves nothing either way: ask the next one
        return want
    try:
        got = native()
        distance = float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))
        # A 16-bit output may round a sum the other way; a factor read from the wrong place is off by far more.
        tolerance = max(CHECK_TOLERANCE, torch.finfo(want.dtype).eps)
        agrees = got.shape == want.shape and (distance <= tolerance or bool((got.float() == want.float()).all()))
        why = f"differs from the emulation by {distance:.2e} (relative)"
    except (RuntimeError, ValueError, NotImplementedError) as e:  # torch refuses: this build or GPU lacks it
        agrees, why = False, f"failed: {str(e).splitlines()[0][:200]}"
    _verdicts[key] = agrees
    if not agrees:
        warnings.warn(f"megalite: the GPU's {key[0]} FP8 GEMM {why} on its first problem ({key[1:]}): that kind "
                      f"runs emulated (dequantize, fp32 GEMM) for the rest of the run", RuntimeWarning, stacklevel=3)
    return want


def problem_key(kind: str, a: Quantized, b: Quantized, out_dtype: torch.dtype) -> tuple:
    """What makes two problems the same kind for the check: not M, which the experts' token counts
    change every step (it would check every step), but whether M fills whole 128-row tiles."""
    (m, k), n = a.data.shape, b.data.shape[0]
    return (kind, a.tile, b.tile, a.data.dtype, b.data.dtype, k, n, m % 128 == 0, out_dtype, str(a.data.device))


def forget_verdicts() -> None:
    """Check every kind again (tests; a process that changes GPUs)."""
    _verdicts.clear()
