"""PyTorch versions of the fused kernels: the path on CPUs, on machines without a CUDA compiler,
with MEGALITE_KERNELS=0 and for shapes or dtypes a kernel does not take. Same semantics as the
kernels: statistics in fp32 (float64 stays float64), outputs in the input's dtype, a softmax row
with every key hidden is 0."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """[1, 1, sq, sk] bool, True where key k is hidden from query q (k > q)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)[None, None]


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def scaled_masked_softmax(x: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    scores = x.to(_stats_dtype(x)) * scale
    if mask is None:
        return torch.softmax(scores, dim=-1).to(x.dtype)
    # The lowest finite value rather than -inf: a row with every key hidden then stays finite
    # (uniform) through softmax and its backward, and is replaced by zeros below.
    scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    all_hidden = mask.all(dim=-1, keepdim=True)
    return torch.where(all_hidden, torch.zeros((), dtype=probs.dtype, device=probs.device), probs).to(x.dtype)


def scaled_causal_softmax(x: torch.Tensor, scale: float) -> torch.Tensor:
    return scaled_masked_softmax(x, causal_mask(x.shape[-2], x.shape[-1], x.device), scale)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    if weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype):
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    dt = _stats_dtype(x)
    return F.layer_norm(x.to(dt), x.shape[-1:], weight.to(dt), None if bias is None else bias.to(dt), eps).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(_stats_dtype(x))
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * rstd * weight.to(xf.dtype)).to(x.dtype)
