"""Autograd functions around the fused kernels (used only when megalite.ops picked the kernel path)."""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


class FusedSoftmax(torch.autograd.Function):
    """y = softmax(scale * x) with a [b or 1, 1, sq or 1, sk] mask (True = hidden), causal, or neither.
    The backwards are first-order only (a double backward raises rather than treating them as constants)."""

    @staticmethod
    def forward(ctx, ext, x, mask, scale: float, causal: bool):
        y = ext.softmax_forward(x, mask, scale, causal)
        ctx.ext, ctx.scale, ctx.causal = ext, scale, causal
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return None, ctx.ext.softmax_backward(dy.contiguous(), y, ctx.scale, ctx.causal), None, None, None


class FusedNorm(torch.autograd.Function):
    """LayerNorm (rms=False) or RMSNorm (rms=True) over the last dimension; x contiguous."""

    @staticmethod
    def forward(ctx, ext, x, weight, bias, eps: float, rms: bool):
        y, mean, rstd = ext.norm_forward(x, weight, bias, eps, rms)
        ctx.ext, ctx.rms, ctx.has_bias = ext, rms, bias is not None
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw_part, db_part = ctx.ext.norm_backward(dy.contiguous(), x, weight, mean, rstd, ctx.rms)
        # The kernel leaves one fp32 partial sum per block; adding them here keeps the result exact
        # to fp32 and the same on every run.
        dw = dw_part.sum(0).to(weight.dtype) if ctx.needs_input_grad[2] else None
        db = db_part.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return None, dx, dw, db, None, None
