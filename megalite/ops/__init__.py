"""Fused kernels with PyTorch fallbacks: the same function on every path, autograd-aware.

    scaled_masked_softmax(x, mask, scale)   x [b, heads, sq, sk]; mask bool [b or 1, 1, sq or 1, sk],
                                            True = hidden (None: no mask)
    scaled_causal_softmax(x, scale)         key k hidden from query q when k > q
    layer_norm(x, weight, bias, eps)        over the last dimension, fp32 statistics
    rms_norm(x, weight, eps)
    kernels_available()                     KernelStatus: which path runs, and why

The CUDA kernels (kernels/*.cu) are built on first use, once per machine (megalite.ops.build).
They run for CUDA tensors in float32, float16 or bfloat16 with a last dimension of at most
16384 (norms: weight in the input's dtype); anything else, no GPU, no compiler or
MEGALITE_KERNELS=0 takes the PyTorch path. A softmax row whose keys are all hidden is zeros.
"""
from __future__ import annotations

import torch

from megalite.ops import build, reference
from megalite.ops.build import KernelStatus
from megalite.ops.functions import fused_norm, fused_softmax

__all__ = ["KernelStatus", "kernels_available", "layer_norm", "rms_norm", "scaled_causal_softmax",
           "scaled_masked_softmax"]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_COLS = 16384


def kernels_available() -> KernelStatus:
    """Whether the fused CUDA kernels run here, building them on first call, and why (str() it)."""
    return build.load()[1]


def _extension_for(*tensors: torch.Tensor):
    """The loaded extension when every tensor can take the kernel path, else None."""
    x = tensors[0]
    if not x.is_cuda or x.dtype not in _KERNEL_DTYPES or x.numel() == 0 or x.shape[-1] > MAX_COLS:
        return None
    if any(t is not None and (t.dtype != x.dtype or t.device != x.device) for t in tensors[1:]):
        return None
    return build.load()[0]


def _check_scores(x: torch.Tensor, what: str) -> None:
    if x.dim() != 4:
        raise ValueError(f"{what}: expected scores [batch, heads, sq, sk], got shape {tuple(x.shape)}")


def _broadcast_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mask as [b or 1, 1, sq or 1, sk] bool: broadcast over heads (and queries, for padding masks)
    without copying; a mask broadcast over keys is expanded."""
    b, _, sq, sk = x.shape
    if mask.dtype != torch.bool:
        raise ValueError(f"scaled_masked_softmax: mask must be bool (True = hidden), got {mask.dtype}")
    if (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] not in (1, b) or mask.shape[2] not in (1, sq)
            or mask.shape[3] not in (1, sk)):
        raise ValueError(f"scaled_masked_softmax: mask of shape {tuple(mask.shape)} does not broadcast as "
                         f"[batch or 1, 1, sq or 1, sk] over scores of shape {tuple(x.shape)}")
    return mask.expand(*mask.shape[:3], sk)


def scaled_masked_softmax(x: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """softmax(scale * x + mask) over the last dimension; masked keys (True) get probability 0."""
    _check_scores(x, "scaled_masked_softmax")
    if mask is not None:
        mask = _broadcast_mask(x, mask)
    ext = _extension_for(x)
    if ext is not None and (mask is None or mask.device == x.device):
        return fused_softmax(x.contiguous(), None if mask is None else mask.contiguous(), float(scale), False)
    return reference.scaled_masked_softmax(x, mask, scale)


def scaled_causal_softmax(x: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale * x) with key k hidden from query q when k > q (no mask is materialised)."""
    _check_scores(x, "scaled_causal_softmax")
    ext = _extension_for(x)
    if ext is not None:
        return fused_softmax(x.contiguous(), None, float(scale), True)
    return reference.scaled_causal_softmax(x, scale)


def _check_norm(x, weight, bias, what):
    h = x.shape[-1] if x.dim() else None
    if weight.dim() != 1 or weight.shape[0] != h or (bias is not None and bias.shape != weight.shape):
        raise ValueError(f"{what}: weight {tuple(weight.shape)}"
                         + ("" if bias is None else f" and bias {tuple(bias.shape)}")
                         + f" do not match the last dimension of the input {tuple(x.shape)}")


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension with fp32 statistics; bias may be None."""
    _check_norm(x, weight, bias, "layer_norm")
    ext = _extension_for(x, weight, bias)
    if ext is not None:
        return fused_norm(x.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous(),
                          float(eps), False)
    return reference.layer_norm(x, weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: x / sqrt(mean(x^2) + eps) * weight, fp32 statistics."""
    _check_norm(x, weight, None, "rms_norm")
    ext = _extension_for(x, weight)
    if ext is not None:
        return fused_norm(x.contiguous(), weight.contiguous(), None, float(eps), True)
    return reference.rms_norm(x, weight, eps)
