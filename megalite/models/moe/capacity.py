"""Expert capacity: with `--moe-expert-capacity-factor f`, each expert takes at most
C = ceil(f x k x T / E) of a rank's T tokens' assignments (Megatron-LM's per-rank capacity); the
rest are dropped (their weight lost, the token keeps its other experts' and the residual). Which
ones: the lowest router weights (`--moe-token-drop-policy probs`) or the last tokens of the
sequence (`position`). `--moe-pad-expert-input-to-capacity` then gives every expert exactly C rows
(zero rows with zero weight), so the exchanges' sizes are static and need no host copy."""
from __future__ import annotations

import math

import torch


def count_per_expert(indices: torch.Tensor, bins: int) -> torch.Tensor:
    """How many of `indices` (values in [0, bins)) fall in each bin: torch.bincount's counts, with a
    size fixed in advance (bincount on CUDA reads the input's range on the host: a sync)."""
    flat = indices.reshape(-1)
    return torch.zeros(bins, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def expert_capacity(tokens: int, topk: int, num_experts: int, factor: float) -> int:
    return math.ceil(factor * topk * tokens / num_experts)


def drop_over_capacity(weights: torch.Tensor, indices: torch.Tensor, num_experts: int, capacity: int,
                       policy: str) -> torch.Tensor:
    """`indices` with the assignments over each expert's capacity set to `num_experts` (none)."""
    flat = indices.reshape(-1)
    if policy == "probs":  # the highest weights first (ties: the earlier assignment)
        by_score = torch.argsort(weights.detach().reshape(-1), descending=True, stable=True)
    else:  # token order
        by_score = torch.arange(flat.numel(), device=flat.device)
    order = by_score[torch.argsort(flat[by_score], stable=True)]  # by expert, then by priority
    counts = count_per_expert(flat, num_experts)
    starts = counts.cumsum(0) - counts
    rank_in_expert = torch.empty_like(flat)
    rank_in_expert[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    return torch.where(rank_in_expert < capacity, flat, num_experts).view_as(indices)


def padded_slots(sorted_experts: torch.Tensor, counts: torch.Tensor, num_experts: int, capacity: int):
    """For rows sorted by expert (`sorted_experts`, dropped ones = num_experts last) and the rows per
    expert: (slot of each row in the [experts x capacity] padded layout, or num_experts x capacity for
    a dropped row), with tensor ops only (no host copy)."""
    starts = counts.cumsum(0) - counts
    kept = sorted_experts < num_experts
    e = sorted_experts.clamp(max=num_experts - 1)
    position = torch.arange(sorted_experts.numel(), device=sorted_experts.device) - starts[e]
    return torch.where(kept, e * capacity + position, num_experts * capacity)
