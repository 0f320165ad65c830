"""Delayed scaling's state (Transformer Engine's DelayedScaling, Megatron-LM's default recipe): each
of a layer's three operands (input, weight, output gradient) is quantized with a scale chosen from
the amaxes of earlier steps, so no reduction sits in the GEMM's path.

During a step each quantization records its tensor's amax into `amax_now` (the maximum over the
step's micro-batches and recomputations; recomputing the same tensor records the same value). At
the step's end (`update`, after one all-reduce of every layer's `amax_now` over the ranks that
share the layers: megalite.models.fp8) the amax enters the history, newest first, and

    scale = (max / amax_ref) / 2^margin,   amax_ref = history[0] (most_recent) or max(history) (max),

kept as it was where amax_ref is 0, inf or NaN (a layer that did not run keeps its history too).
The first step, with an empty history, quantizes with scale 1, as Transformer Engine starts.
"""
from __future__ import annotations

import torch

from megalite.precision.recipes import FP8_MAX, ROLES, Recipe

ROLE_INDEX = {role: i for i, role in enumerate(ROLES)}


class DelayedScaling:
    """One layer's amax histories and scales, [input, weight, grad], on the layer's device."""

    def __init__(self, recipe: Recipe, device=None):
        self.recipe = recipe
        self.amax_now = torch.zeros(len(ROLES), device=device)
        self.history = torch.zeros(len(ROLES), recipe.amax_history_len, device=device)  # newest first
        self.scale = torch.ones(len(ROLES), device=device)
        # each role's largest value over 2^margin: made once (a tensor from a list copies from the host)
        self.top = torch.tensor([FP8_MAX[recipe.dtype(r)] / 2.0 ** recipe.margin for r in ROLES], device=device)

    def record(self, role: str, amax: torch.Tensor) -> torch.Tensor:
        """Note `amax` for this step; returns the scale to quantize `role` with now."""
        i = ROLE_INDEX[role]
        self.amax_now[i] = torch.maximum(self.amax_now[i], amax)
        return self.scale[i]

    def current(self, role: str) -> torch.Tensor:
        """The scale `role` is quantized with now, recording nothing (evaluation)."""
        return self.scale[ROLE_INDEX[role]]

    def update(self, amax: torch.Tensor) -> None:
        """Close the step with `amax` [3] (the reduced `amax_now`): roll the history, choose scales."""
        ran = (amax > 0).unsqueeze(1)
        self.history.copy_(torch.where(ran, torch.cat([amax.unsqueeze(1), self.history[:, :-1]], 1), self.history))
        self.rescale()
        self.amax_now.zero_()

    def rescale(self) -> None:
        """Scales from the history as this recipe chooses them (after an update, or a history loaded
        from a run with other settings); where the history gives none, the scale stays."""
        ref = self.history[:, 0] if self.recipe.amax_compute_algo == "most_recent" else self.history.amax(1)
        new = self.top / ref
        self.scale.copy_(torch.where(torch.isfinite(new) & (ref > 0) & torch.isfinite(ref), new, self.scale))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"history": self.history, "scale": self.scale}


def fit_history(saved: torch.Tensor, length: int) -> torch.Tensor:
    """A saved history [roles, n] (newest first) at another length: the newest amaxes kept, zeros after."""
    if saved.shape[-1] == length:
        return saved
    out = saved.new_zeros(*saved.shape[:-1], length)
    kept = min(saved.shape[-1], length)
    out[..., :kept] = saved[..., :kept]
    return out
