"""Each attention head's largest logit, q.k / sqrt(d) over the pairs its mask lets attend, kept as a
running max over a step's forwards (--qk-clip, --log-max-attention-logit; what Transformer Engine's
`return_max_logit` gives Megatron-Core). An attention module records while training once
`max_logits` is a tensor ([heads of this rank], fp32); megalite.training.qk_clip reads and resets it.

The scores are those of the module's own core (megalite.models.attention.local_core) with every mask
it would apply (causal, padding, sliding window, each packed document), computed again without
autograd: one more q k^T product per layer and a layer's fp32 scores at a time, only where asked."""
from __future__ import annotations

import math

import torch


def record_max_logits(module, q: torch.Tensor, k: torch.Tensor, attention_mask, core) -> None:
    """module.max_logits <- max(it, this forward's per-head max) for q [b, heads, s, d] and k [b, heads
    or groups, s, d]; `core` is local_core (passed in: the attention module imports this one)."""
    if getattr(module, "max_logits", None) is None or not module.training:
        return
    heads, found = q.shape[1], []

    def largest(q, k, v, allowed, dropout_p, causal, sink=None):
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * (1.0 / math.sqrt(q.shape[-1]))
        if allowed is None and causal:
            allowed = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        found.append(scores.amax(dim=(0, 2, 3)))
        return q.new_zeros(*q.shape[:-1], v.shape[-1])

    with torch.no_grad():
        if k.shape[1] != heads:  # key groups: one per query head
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
        core(q, k, k, attention_mask, module.config, 0.0, module.window, attend=largest)
        module.max_logits = torch.maximum(module.max_logits, torch.stack(found).amax(0))
