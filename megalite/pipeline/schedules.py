"""Forward-backward schedules over the micro-batches of one training step."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

LossFn = Callable[[torch.nn.Module, dict], torch.Tensor]


def forward_backward_no_pipelining(model: torch.nn.Module, micro_batches: Sequence[dict], loss_fn: LossFn,
                                   num_tokens: torch.Tensor) -> torch.Tensor:
    """Gradient accumulation: forward and backward each micro-batch in turn.

    `loss_fn(model, batch)` returns the summed loss of the batch; each is divided by the token
    count of the whole global batch, so the accumulated gradient is that of the global mean and
    data-parallel reduction is a plain sum. Returns the summed (undivided) loss, detached.
    """
    total = torch.zeros((), dtype=torch.float32, device=num_tokens.device)
    for batch in micro_batches:
        loss_sum = loss_fn(model, batch)
        (loss_sum / num_tokens).backward()
        total += loss_sum.detach()
    return total
