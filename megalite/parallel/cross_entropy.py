"""Cross-entropy over logits whose vocabulary dimension is split across TP ranks.

No rank ever holds the full logits: the max, the sum of exponentials and the target's logit
are reduced over TP (two all-reduces), and the backward is softmax - one_hot on each shard.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel import state, traffic


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        tp, group = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_group()
        logits_max = logits.amax(dim=-1).float()  # amax: max() would also find the indices
        if tp > 1:
            traffic.counted_all_reduce("tp", logits_max, group, op=dist.ReduceOp.MAX)
        # One fp32 working copy, shifted as it is made (one pass; 16-bit logits are promoted).
        shifted = logits - logits_max.unsqueeze(-1)

        part = logits.shape[-1]
        start = state.get_tensor_model_parallel_rank() * part
        outside = (target < start) | (target >= start + part)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

        exp = shifted.exp_()  # shifted is ours: reuse its memory for the softmax
        sum_exp = exp.sum(dim=-1)
        if tp > 1:  # one all-reduce for both sums
            both = torch.stack([target_logit, sum_exp])
            traffic.counted_all_reduce("tp", both, group)
            target_logit, sum_exp = both[0], both[1]
        loss = sum_exp.log() - target_logit

        exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(exp, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # d loss / d logits = softmax - one_hot(target), on this shard
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (outside.float() - 1.0).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token loss (fp32, shaped like `target`) from vocab-sharded `logits` [..., vocab/tp].

    Logits of vocabulary padding should be -inf so that padding never takes probability.
    """
    return _VocabParallelCrossEntropy.apply(logits, target)
