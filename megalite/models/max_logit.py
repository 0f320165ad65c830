"""Each attention head's largest logit, q.k / sqrt(d) over the pairs its mask lets attend, kept as a
running max over a step's forwards (--qk-clip, --log-max-attention-logit; what Transformer Engine's
`return_max_logit` gives Megatron-Core). An attention module records while training once
`max_logits` is a tensor ([heads of this rank], fp32); megalite.training.qk_clip reads and resets it.

The scores are those of the module's own core (megalite.models.attention.local_core) with every mask
it would apply (causal, padding, sliding window, each packed document), computed again without
autograd: one more q k^T product per layer, in fp32, a few heads' scores at a time (at most
`_SCORES_AT_ONCE` elements), only where asked."""
from __future__ import annotations

import math

import torch

_SCORES_AT_ONCE = 1 << 25  # fp32 scores a chunk of heads may hold (128 MiB)


def record_max_logits(module, q: torch.Tensor, k: torch.Tensor, attention_mask, core) -> None:
    """module.max_logits <- max(it, this forward's per-head max) for q [b, heads, s, d] and k [b, heads
    or groups, s, d]; `core` is local_core (passed in: the attention module imports this one)."""
    if getattr(module, "max_logits", None) is None or not module.training:
        return
    heads, found = q.shape[1], []

    def largest(q, k, v, allowed, dropout_p, causal, sink=None):
        if allowed is None and causal:
            allowed = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        if allowed is not None and allowed.dim() == 4 and allowed.shape[1] > 1:
            raise ValueError("a per-head attention mask: the largest logits take one mask for every head")
        # In fp32 (an fp16 product overflows above ~65504), a few heads at a time (bounded temporaries)
        per_head = q.shape[0] * q.shape[2] * k.shape[2]
        step = max(1, _SCORES_AT_ONCE // per_head)
        for h in range(0, q.shape[1], step):
            scores = torch.matmul(q[:, h:h + step].float(), k[:, h:h + step].float().transpose(-1, -2))
            scores *= 1.0 / math.sqrt(q.shape[-1])
            if allowed is not None:
                scores.masked_fill_(~allowed, float("-inf"))
            found.append(scores.amax(dim=(0, 2, 3)))
        return q.new_zeros(*q.shape[:-1], v.shape[-1])

    with torch.no_grad():
        if k.shape[1] != heads:  # key groups: one per query head
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
        core(q, k, k, attention_mask, module.config, 0.0, module.window, attend=largest)
        # (each core call, one per packed document, found every head's, a few heads at a time, in order)
        module.max_logits = torch.maximum(module.max_logits, torch.cat(found).view(-1, heads).amax(0))
