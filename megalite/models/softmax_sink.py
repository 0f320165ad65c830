"""Attention sinks: Megatron-LM's --softmax-type (gpt-oss's learned sinks, Evan Miller's "off by one").

Each head h has a sink logit s_h that joins every query's softmax as one more score with a value of
zero: p_j = exp(x_j) / (exp(s_h) + sum_k exp(x_k)) over the (scaled, masked) scores x. `off-by-one`
fixes s_h = 0; `learnable` makes it a parameter per head (split over TP with the heads, N(0,
init_method_std) at init, no weight decay as a 1-D tensor); `vanilla` is the plain softmax.

Every path computes the same function:
- the explicit and fused-softmax backends append the sink column to the scores, as Megatron-Core's
  unfused softmax does (`sink_softmax`);
- PyTorch's fused attention gets one more key whose score is s_h: queries gain a dimension holding
  s_h / scale, the real keys a zero there and the sink key a one, its value zero (`sdpa_with_sink`),
  so the fused kernels keep running (flash, with its key groups, for causal attention without a
  mask), and autograd carries the gradient into s_h;
- ring context parallelism merges its blocks as before and adds the sink to the final log-sum-exp,
  out * sigmoid(lse - s_h), whose backward is the plain one with that log-sum-exp plus
  d s_h = -sum(P_sink * rowsum(dO * O)) (megalite.parallel.context_parallel);
- the all-to-all attends the whole sequence with its rank's block of the heads' sinks.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megalite.parallel.layers import normal_init, sharded_parameter

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")

# Zero dims after the queries' unit one: head widths stay multiples of 8, as the fused kernels want.
_EXTRA_DIMS = 8


def sink_softmax(scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """softmax over [scores, s_h] without its last column: scores [b, heads, sq, sk] scaled and masked
    (-inf hidden), `sink` [heads]."""
    column = sink.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]


def _allowed_with_sink(allowed, sq: int, sk: int, causal: bool, device) -> torch.Tensor:
    """Bool [..., sq, 1 + sk]: the sink key (first), which every query sees, then `allowed` (None:
    causal over the last sq of sk positions). Made once for every layer that reads the same mask
    tensor (kept with it), as attention keeps it for its backward."""
    def make(allowed):
        if allowed is None:
            allowed = torch.ones(sq, sk, dtype=torch.bool, device=device).tril(sk - sq)
        allowed = allowed.expand(*allowed.shape[:-2], sq, sk)
        return torch.cat([allowed.new_ones(*allowed.shape[:-1], 1), allowed], dim=-1)
    if allowed is None or torch.compiler.is_compiling():  # (in a graph a cache would be a guarded side effect)
        return make(allowed)
    memo = allowed.__dict__.setdefault("_megalite_with_sink", {})
    if (sq, sk) not in memo:
        memo[(sq, sk)] = make(allowed)
    return memo[(sq, sk)]


def sdpa_with_sink(q, k, v, allowed, dropout_p: float, causal: bool, sink: torch.Tensor) -> torch.Tensor:
    """PyTorch's fused attention with a sink: q [b, heads, sq, d], k and v [b, heads or groups, sk, d],
    `sink` [heads]. One key goes first: a unit vector in a dimension queries gain, where each head's
    queries hold s_h / scale (real keys hold zero there), its value zero: its score is s_h (up to a
    rounding of s_h / scale in q's dtype); values gain zero columns to q's width. Causal attention
    without a mask keeps the kernels' own causal mask and the key groups (flash on a GPU, no mask
    made) by one query put first too, a dummy that sees only the sink key, whose output row is
    dropped. With a mask, k and v come with their groups expanded (megalite.models.attention)."""
    b, heads, sq, d = q.shape
    groups, sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d)
    logit = (sink.to(q.dtype) / scale).view(1, heads, 1, 1).expand(b, heads, sq, 1)
    q = torch.cat([q, logit, q.new_zeros(b, heads, sq, _EXTRA_DIMS - 1)], dim=-1)
    unit = k.new_zeros(b, groups, 1, d + _EXTRA_DIMS)
    unit[..., d] = 1
    k = torch.cat([unit, F.pad(k, (0, _EXTRA_DIMS))], dim=2)
    dv = v.shape[-1]  # values as wide as q and k (zero columns, cut off after): flash takes one width
    v = torch.cat([v.new_zeros(b, groups, 1, dv), v], dim=2)
    v = F.pad(v, (0, max(0, d + _EXTRA_DIMS - dv)))
    gqa = {"enable_gqa": True} if groups != heads else {}
    if allowed is None and causal and sq == sk:
        q = torch.cat([q.new_zeros(b, heads, 1, d + _EXTRA_DIMS), q], dim=2)  # the dummy query
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, **gqa)
        return out[:, :, 1:, :dv]
    if allowed is None and not causal:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale, **gqa)[..., :dv]
    mask = _allowed_with_sink(allowed, sq, sk, causal, q.device)  # (a caller's mask came with its groups expanded)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                          **gqa)[..., :dv]


def attach_offset(module: torch.nn.Module, config, heads_here: int, generator: torch.Generator | None,
                  device) -> None:
    """`module.softmax_offset`: None (vanilla), a zero buffer (off-by-one: not in the state dict, as in
    Megatron-Core's), or a parameter of this TP rank's heads, drawn for all heads from `generator` (the
    layer's sink stream: the weights stay a vanilla model's), so a TP layout draws the same sinks."""
    if config.softmax_type == "learnable":
        module.softmax_offset = sharded_parameter((config.num_attention_heads,), 0,
                                                  normal_init(config.init_method_std, generator),
                                                  config.params_dtype, device)
    elif config.softmax_type == "off-by-one":
        module.register_buffer("softmax_offset", torch.zeros(heads_here, dtype=config.params_dtype, device=device),
                               persistent=False)
    else:
        module.softmax_offset = None


def heads_of_rank(sink: torch.Tensor | None, part: int, parts: int) -> torch.Tensor | None:
    """The sinks of part `part` of `parts` equal head blocks (the all-to-all's head split)."""
    return None if sink is None else sink.chunk(parts)[part]
