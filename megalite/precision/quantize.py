"""Quantizing to FP8, exactly as the recipes say (megalite.precision.recipes).

A tensor x (or each tile of it) with absolute maximum `amax` is stored as q = fp8(x * s), where
- s = max / amax for current scaling (tensorwise, blockwise), `max` the format's largest finite value
  (448 for E4M3, 57344 for E5M2), and s = 1 where amax is 0 (nothing to scale);
- s is given for delayed scaling (from earlier steps' amaxes, megalite.precision.scaling);
- s = 2^floor(log2(max / amax)) for blockwise and mxfp8: the largest power of two that keeps the tile
  in range (Transformer Engine's defaults for both; for mxfp8 1/s is the E8M0 scale, the smallest
  power of two X with amax / X <= max, so nothing saturates, unlike OCP MX's floor(log2 amax) - emax).
The product x * s is taken in fp32 and saturated to +-max before the cast rounds it to nearest
even. The GEMM multiplies its result back by 1/s of each operand (`scale_inv`).

An inf or NaN never hides: under current scaling an inf amax makes s 0 and inf * 0 is NaN; delayed
scaling's given s is made NaN when this tensor's amax is not finite. So the GEMM's output is NaN,
the step's gradients are not finite, and the optimizer skips the step (counted as fp16's skips).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megalite.precision.recipes import FP8_MAX


@dataclass
class Quantized:
    """An FP8 operand laid out [rows, contraction] and the factors that undo its scaling: one per
    tensor (0-d) or one per `tile` ([ceil(rows / tile rows), ceil(columns / tile columns)])."""
    data: torch.Tensor
    scale_inv: torch.Tensor
    tile: tuple[int, int] | None = None

    def t(self) -> "Quantized":
        """The transpose, [contraction, rows], for a tensor-wide scale or square tiles (the same
        numbers, no new rounding)."""
        if self.tile is not None and self.tile[0] != self.tile[1]:
            raise ValueError(f"a {self.tile[0]}x{self.tile[1]}-tiled operand cannot be transposed without "
                             "quantizing it again")
        scale = self.scale_inv if self.tile is None else self.scale_inv.t().contiguous()
        return Quantized(self.data.t().contiguous(), scale, self.tile)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """data * scale_inv, each element times its tile's factor, in fp32 (then `dtype`)."""
        values = self.data.float()
        if self.tile is None:
            return (values * self.scale_inv).to(dtype)
        rows, cols = values.shape
        per_element = self.scale_inv.repeat_interleave(self.tile[0], 0).repeat_interleave(self.tile[1], 1)
        return (values * per_element[:rows, :cols]).to(dtype)


def amax_of(x: torch.Tensor) -> torch.Tensor:
    """|x|'s maximum as an fp32 scalar on x's device (0 for an empty tensor); no host sync."""
    if x.numel() == 0:
        return x.new_zeros((), dtype=torch.float32)
    return x.detach().abs().amax().float()


def current_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """max / amax, 1 where amax is 0, fp32's largest where amax is so small that the quotient
    overflows; 0 for an inf amax and NaN for a NaN one (so bad input shows)."""
    scale = torch.where(amax == 0, torch.ones_like(amax), FP8_MAX[dtype] / amax)
    return torch.where(torch.isinf(scale), torch.full_like(scale, torch.finfo(torch.float32).max), scale)


def power_of_two_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2^floor(log2(max / amax)) (in fp32), within E8M0's range 2^-127 .. 2^127; 1 where amax is
    0; 0 for an inf amax, NaN for a NaN one."""
    scale = torch.exp2(torch.floor(torch.log2(FP8_MAX[dtype] / amax)).clamp(-127, 127))
    scale = torch.where(torch.isinf(amax), torch.zeros_like(scale), scale)
    return torch.where(amax == 0, torch.ones_like(amax), scale)


def _cast(scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturate to the format's range, round to nearest even (NaN stays NaN)."""
    limit = FP8_MAX[dtype]
    return scaled.clamp(-limit, limit).to(dtype)


def quantize(x: torch.Tensor, dtype: torch.dtype, tile: tuple[int, int] | None = None, power_of_two: bool = False,
             scale: torch.Tensor | None = None, amax: torch.Tensor | None = None) -> Quantized:
    """x (2-D, [rows, contraction]) in FP8 `dtype`.

    Tensor-wide (`tile` None): with `scale` the given s (delayed scaling: `amax`, this tensor's,
    only makes s NaN when it is not finite), else current scaling from `amax` (the reduced one
    when the tensor is sharded) or x's own. Tiled: each tile's own current (or power-of-two) scale."""
    if x.dim() != 2:
        raise ValueError(f"quantize takes a 2-D operand, got shape {tuple(x.shape)}")
    values = x.detach().float()
    if tile is None:
        if scale is None:
            s = current_scale(amax_of(x) if amax is None else amax, dtype)
        else:
            s = scale if amax is None else scale * (amax * 0 + 1)  # amax inf or NaN -> s NaN
        return Quantized(_cast(values * s, dtype), (1.0 / s).float(), None)
    rows, cols = values.shape
    tr, tc = tile
    padded = F.pad(values, (0, -cols % tc, 0, -rows % tr))  # zeros: they change no tile's amax
    grid = padded.view(padded.shape[0] // tr, tr, padded.shape[1] // tc, tc)
    tile_amax = grid.abs().amax(dim=(1, 3))
    s = power_of_two_scale(tile_amax, dtype) if power_of_two else current_scale(tile_amax, dtype)
    data = _cast(grid * s[:, None, :, None], dtype).view(padded.shape)[:rows, :cols].contiguous()
    return Quantized(data, 1.0 / s, tile)
