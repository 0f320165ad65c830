"""The fused kernels as PyTorch custom operators (used only when megalite.ops picked the kernel path).

As `torch.library` operators with a fake (shape) implementation and an autograd formula, they
stand in a `torch.compile` graph as single nodes: compiling a layer that uses them makes no graph
break, where calling the extension from Python would break the graph at every call. The
backwards are first-order only: a double backward raises rather than treating them as constants.
"""
from __future__ import annotations

from typing import Optional

import torch

from megalite.ops import build


def _ext():
    return build.load()[0]


@torch.library.custom_op("megalite::softmax_forward", mutates_args=())
def softmax_forward(x: torch.Tensor, mask: Optional[torch.Tensor], scale: float, causal: bool) -> torch.Tensor:
    """y = softmax(scale * x) with a [b or 1, 1, sq or 1, sk] mask (True = hidden), causal, or neither."""
    return _ext().softmax_forward(x, mask, scale, causal)


@softmax_forward.register_fake
def _(x, mask, scale, causal):
    return torch.empty_like(x)


@torch.library.custom_op("megalite::softmax_backward", mutates_args=())
def softmax_backward(dy: torch.Tensor, y: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """dx = scale * y * (dy - sum(dy * y)), from the saved output alone."""
    return _ext().softmax_backward(dy, y, scale, causal)


@softmax_backward.register_fake
def _(dy, y, scale, causal):
    return torch.empty_like(dy)


def _softmax_save(ctx, inputs, output):
    _, _, ctx.scale, ctx.causal = inputs
    ctx.save_for_backward(output)


def _softmax_grad(ctx, dy):
    (y,) = ctx.saved_tensors
    return softmax_backward(dy.contiguous(), y, ctx.scale, ctx.causal), None, None, None


softmax_forward.register_autograd(_softmax_grad, setup_context=_softmax_save)


@torch.library.custom_op("megalite::norm_forward", mutates_args=())
def norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                 rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm (rms=False) or RMSNorm (rms=True) over the last dimension of a contiguous x:
    (y, mean, rstd), the statistics fp32, one per row."""
    y, mean, rstd = _ext().norm_forward(x, weight, bias, eps, rms)
    return y, mean, rstd


@norm_forward.register_fake
def _(x, weight, bias, eps, rms):
    rows = x.numel() // x.shape[-1]
    stat = x.new_empty((rows,), dtype=torch.float32)
    return torch.empty_like(x), stat, torch.empty_like(stat)


@torch.library.custom_op("megalite::norm_backward", mutates_args=())
def norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                  rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db): the kernel leaves one fp32 partial sum of dw and db per block; adding them
    here keeps the result exact to fp32 and the same on every run."""
    dx, dw_part, db_part = _ext().norm_backward(dy, x, weight, mean, rstd, rms)
    return dx, dw_part.sum(0).to(weight.dtype), db_part.sum(0).to(weight.dtype)


@norm_backward.register_fake
def _(dy, x, weight, mean, rstd, rms):
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)


def _norm_save(ctx, inputs, output):
    x, weight, bias, _, ctx.rms = inputs
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.save_for_backward(x, weight, output[1], output[2])


def _norm_grad(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = norm_backward(dy.contiguous(), x, weight, mean, rstd, ctx.rms)
    return dx, dw, db if ctx.has_bias else None, None, None


norm_forward.register_autograd(_norm_grad, setup_context=_norm_save)


def fused_softmax(x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool) -> torch.Tensor:
    return softmax_forward(x, mask, scale, causal)


def fused_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, rms: bool) -> torch.Tensor:
    return norm_forward(x, weight, bias, eps, rms)[0]
