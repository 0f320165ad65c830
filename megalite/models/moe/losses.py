"""Load-balancing and z-losses of the router, with the same strength at every layout.

Each term is defined on the whole model and batch as one device computes it, and each rank adds
the gradient of its share, so that the shares summed over ranks (gradients are summed over TP for
the router's sequence-parallel weight, and over DP x CP) give the one-device gradient:
- aux_loss (Switch Transformer / GShard): per micro-batch, coeff * E / (k T^2) * sum_e n_e P_e with
  n_e the tokens routed to e and P_e the sum of e's scores over the micro-batch's T tokens, then the
  mean over the global batch's micro-batches. The counts n_e are the micro-batch's, summed over the
  ranks that share its tokens (TP x CP); P_e is linear, so each rank's share is its own tokens'.
- seq_aux_loss (DeepSeek-V3): the same per sequence, averaged over the global batch's sequences.
- global_aux_loss: the counts of the micro-batches all DP ranks run at once (summed over TP x CP x DP),
  averaged over the step's micro-batch slots; its value depends on DP x micro-batch size by definition.
- z-loss (ST-MoE): coeff * mean over the global batch's tokens of logsumexp(logits)^2.

`set_batch` tells the layers the global batch (sequences), the micro-batch size and the loss scale
before a step; without it a micro-batch is the whole batch (a layer used on its own).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.models.moe.capacity import count_per_expert
from megalite.parallel import state, traffic


@dataclass
class _Batch:
    global_sequences: int | None = None
    micro_sequences: int | None = None
    loss_scale: float = 1.0


_BATCH = _Batch()


def set_batch(global_sequences: int | None, micro_sequences: int | None, loss_scale: float = 1.0) -> None:
    _BATCH.global_sequences, _BATCH.micro_sequences, _BATCH.loss_scale = global_sequences, micro_sequences, loss_scale


def _micro_share(micro_sequences: int) -> float:
    """A micro-batch's weight in the mean over the global batch's micro-batches."""
    return 1.0 if _BATCH.global_sequences is None else micro_sequences / _BATCH.global_sequences


def _sum_over(t: torch.Tensor, group, kind: str = "metrics") -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        traffic.counted_all_reduce(kind, t, group)
    return t


class _AttachLoss(torch.autograd.Function):
    """Identity on `out`; backward also sends d(loss) = the loss scale into `loss`'s graph."""

    @staticmethod
    def forward(ctx, out, loss):
        ctx.loss_scale = _BATCH.loss_scale  # this step's (read here: a compiled backward is traced ahead)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.loss_scale, dtype=torch.float32, device=grad.device)


def attach(out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """`out`, with `loss` (this rank's share of a loss term, weighted) added to the training loss."""
    return _AttachLoss.apply(out, loss) if loss.requires_grad else out


def load_balancing_loss(kind: str, scores: torch.Tensor, indices: torch.Tensor, num_experts: int,
                        topk: int, sequences: int, coeff: float) -> torch.Tensor:
    """This rank's weighted share of the load-balancing loss. scores [T_local, E] and indices
    [T_local, k] hold tokens in [sequence, batch] order (`sequences` = the micro-batch size)."""
    group = state.get_tensor_and_context_parallel_group()
    share = (1 if group is None else dist.get_world_size(group))
    local_tokens = scores.shape[0]
    if kind == "seq_aux_loss":
        # per sequence b: n_be and P_be over its tokens (the sequence is split over TP x CP)
        per_seq = scores.view(-1, sequences, num_experts)
        counts = torch.zeros(sequences, num_experts, dtype=torch.float32, device=scores.device)
        seq_of = torch.arange(local_tokens, device=scores.device).remainder(sequences)
        counts.index_put_((seq_of.repeat_interleave(topk), indices.reshape(-1)),
                          torch.ones(indices.numel(), device=scores.device), accumulate=True)
        _sum_over(counts, group)
        length = per_seq.shape[0] * share  # one sequence's tokens
        loss = (counts * per_seq.sum(0)).sum() * (num_experts / (topk * length * length))
        seq_weight = 1.0 / (_BATCH.global_sequences or sequences)
        return coeff * seq_weight * loss
    counts = count_per_expert(indices, num_experts).float()
    tokens = local_tokens * share
    if kind == "global_aux_loss":
        dp_group = state.get_data_parallel_group()
        dp = 1 if dp_group is None else dist.get_world_size(dp_group)
        _sum_over(counts, group)
        _sum_over(counts, dp_group)
        tokens *= dp
        weight = _micro_share(sequences * dp)
    else:
        _sum_over(counts, group)
        weight = _micro_share(sequences)
    loss = (counts * scores.sum(0)).sum() * (num_experts / (topk * tokens * tokens))
    return coeff * weight * loss


def z_loss(logits: torch.Tensor, sequences: int, coeff: float) -> torch.Tensor:
    """This rank's weighted share of coeff * mean over the global batch's tokens of logsumexp^2."""
    group = state.get_tensor_and_context_parallel_group()
    share = 1 if group is None else dist.get_world_size(group)
    micro_tokens = logits.shape[0] * share
    per_token = 1.0 / micro_tokens * _micro_share(sequences)
    return coeff * per_token * torch.logsumexp(logits, dim=-1).square().sum()
