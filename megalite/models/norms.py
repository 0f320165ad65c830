"""Normalization layers, chosen by `config.normalization` in `NORMS`.

Their parameters are replicated inside the sequence-parallel region: marked `sequence_parallel`,
their gradients are partial per TP rank and get summed over TP. `backend` "torch" runs PyTorch's
own formula; "auto" and "fused" run megalite.ops (the fused kernel where it runs, PyTorch elsewhere).

An input wider than the weights (the fp32 stream of --fp32-residual-connection beside bf16 or fp16
weights) is normalized in its own dtype with the weights widened, and the result given in the
weights' dtype, for the linear layers after it (a mixed-precision norm, as Megatron-LM's).
"""
from __future__ import annotations

import torch
from torch import nn

from megalite import ops
from megalite.models.config import TransformerConfig
from megalite.parallel import weight_grad


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (weight and bias) on megalite's kernel unless `backend` is "torch". Zero-centred:
    the weight starts at 0 and scales by 1 + weight."""

    def __init__(self, size: int, eps: float, sequence_parallel: bool, dtype, device, backend: str = "auto",
                 zero_centered: bool = False):
        super().__init__(size, eps=eps, dtype=dtype, device=device)
        self.backend, self.zero_centered = backend, zero_centered
        if zero_centered:
            nn.init.zeros_(self.weight)
        for p in self.parameters():
            p.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = weight_grad.defer_delivery(self.weight), weight_grad.defer_delivery(self.bias)
        weight = weight + 1 if self.zero_centered else weight
        if _wider(x, weight):
            return self._normed(x, weight.to(x.dtype), bias.to(x.dtype)).to(weight.dtype)
        return self._normed(x, weight, bias)

    def _normed(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        if self.backend == "torch":
            return nn.functional.layer_norm(x, self.normalized_shape, weight, bias, self.eps)
        return ops.layer_norm(x, weight, bias, self.eps)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension, fp32 statistics (megalite.ops)."""

    def __init__(self, size: int, eps: float, sequence_parallel: bool, dtype, device, backend: str = "auto",
                 zero_centered: bool = False):
        super().__init__()
        start = torch.zeros if zero_centered else torch.ones  # zero-centred: scales by 1 + weight
        self.weight = nn.Parameter(start(size, dtype=dtype, device=device))
        self.eps, self.backend, self.zero_centered = eps, backend, zero_centered
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = weight_grad.defer_delivery(self.weight)
        weight = weight + 1 if self.zero_centered else weight
        if _wider(x, weight):
            return self._normed(x, weight.to(x.dtype)).to(weight.dtype)
        return self._normed(x, weight)

    def _normed(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.backend == "torch":
            return ops.reference.rms_norm(x, weight, self.eps)
        return ops.rms_norm(x, weight, self.eps)


def _wider(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x is wider than the weights: then normed with them widened, given in their dtype."""
    return x.dtype.is_floating_point and x.dtype.itemsize > weight.dtype.itemsize


NORMS: dict[str, type[nn.Module]] = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}


def norm_layer(config: TransformerConfig, device=None) -> nn.Module:
    """The config's normalization over the hidden size, on its backend."""
    return NORMS[config.normalization](config.hidden_size, config.layernorm_epsilon, config.sequence_parallel,
                                       config.params_dtype, device, config.norm_backend,
                                       config.layernorm_zero_centered_gamma)
