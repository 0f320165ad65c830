"""Tensor-parallel self-attention and its core backends, chosen by `config.attention_backend`.

Heads are split across TP ranks: QKV is column-parallel with rows ordered [head, (q, k, v),
head_dim], so a contiguous block of rows is whole heads; the output projection is row-parallel.
`attention_mask`, where given, is bool and broadcastable to [b, heads, s, s], True = attend (SDPA's
convention), and is the whole mask; without one, attention is causal or full as `config.causal` says.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megalite import ops
from megalite.models.config import TransformerConfig
from megalite.models.rng import checkpoint_with_tp_rng
from megalite.parallel import state
from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.parallel.random import get_rng_tracker

# Every core backend: (q, k, v [b, heads, s, d], allowed mask or None, dropout_p, causal) -> [b, heads, s, d].


def _sdpa_attention(q, k, v, allowed, dropout_p, causal):
    """PyTorch's fused attention (flash where available): no score matrix is stored."""
    if allowed is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p)


def _explicit_attention(q, k, v, allowed, dropout_p, causal):
    """Attention with the score and probability matrices materialized (the layout the activation
    formula and selective recomputation are about); `allowed` True = attend, None = causal or all."""
    s = q.shape[-2]
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if allowed is None and causal:
        allowed = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # kept in the activation dtype, as the formula assumes
    if dropout_p:
        probs = F.dropout(probs, dropout_p, True)
    return torch.matmul(probs, v)


def _fused_softmax_attention(q, k, v, allowed, dropout_p, causal):
    """The explicit layout with the scale, mask and softmax in one fused kernel (megalite.ops);
    `allowed` True = attend, None = causal or all."""
    scores = torch.matmul(q, k.transpose(-1, -2))
    scale = 1.0 / math.sqrt(q.shape[-1])
    if allowed is None:
        probs = ops.scaled_causal_softmax(scores, scale) if causal else ops.scaled_masked_softmax(scores, None, scale)
    else:
        probs = ops.scaled_masked_softmax(scores, ~allowed, scale)  # e.g. [b, 1, 1, s]: no s x s copy
    if dropout_p:
        probs = F.dropout(probs, dropout_p, True)
    return torch.matmul(probs, v)


ATTENTION_BACKENDS = {"sdpa": _sdpa_attention, "fused": _fused_softmax_attention, "torch": _explicit_attention}


class ParallelAttention(nn.Module):
    def __init__(self, config: TransformerConfig, init_method, output_init_method, device=None):
        super().__init__()
        tp = state.get_tensor_model_parallel_world_size()
        config.check_tensor_parallel(tp)
        self.config = config
        self.heads_per_rank = config.num_attention_heads // tp
        sp, dtype = config.sequence_parallel, config.params_dtype
        self.qkv = ColumnParallelLinear(
            config.hidden_size, 3 * config.hidden_size, init_method=init_method,
            sequence_parallel=sp, params_dtype=dtype, device=device,
        )
        self.proj = RowParallelLinear(
            config.hidden_size, config.hidden_size, init_method=output_init_method,
            sequence_parallel=sp, params_dtype=dtype, device=device,
        )

    def _core(self, q, k, v, attention_mask):
        """softmax(q k^T / sqrt(d) + mask) v with dropout on the probabilities; q, k, v [b, heads, s, d]."""
        p = self.config.attention_dropout if self.training else 0.0
        # Heads differ per TP rank, so must their dropout; without dropout no RNG is drawn.
        with get_rng_tracker().fork() if p > 0 else contextlib.nullcontext():
            return ATTENTION_BACKENDS[self.config.attention_backend](q, k, v, attention_mask, p, self.config.causal)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.qkv(x)  # [s, b, heads_per_rank * 3 * head_dim]
        s, b = qkv.shape[:2]
        q, k, v = qkv.view(s, b, self.heads_per_rank, 3, self.config.head_dim).permute(3, 1, 2, 0, 4).unbind(0)
        if self.config.recompute == "selective" and self.training:
            ctx = checkpoint_with_tp_rng(self._core, q, k, v, attention_mask)
        else:
            ctx = self._core(q, k, v, attention_mask)  # [b, heads, s, head_dim]
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.config.head_dim)
        return self.proj(ctx)
