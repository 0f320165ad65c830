"""Tensor-parallel self-attention and its core backends, chosen by `config.attention_backend`.

Heads are split across TP ranks: QKV is column-parallel with rows ordered [head, (q, k, v),
head_dim], so a contiguous block of rows is whole heads; the output projection is row-parallel.
Grouped-query attention splits q by heads and kv by groups (docs/llama.md has the layouts).
`attention_mask`, where given, is bool and broadcastable to [b, heads, s, s], True = attend (SDPA's
convention), and is the whole mask; without one, attention is causal or full as `config.causal` says.
It may instead be `PackedDocuments` (megalite.models.documents): documents packed into each sequence,
attended one by one and/or with positions restarting at each.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from megalite import ops
from megalite.models.config import TransformerConfig
from megalite.models.documents import PackedDocuments, flash_varlen, flash_varlen_applies, varlen_attention
from megalite.models.max_logit import record_max_logits
from megalite.models.norms import NORMS
from megalite.models.qk_variants import l2_normalized
from megalite.models.rng import checkpoint_with_tp_rng
from megalite.models.rope import rotary_embedding
from megalite.models.softmax_sink import attach_offset, heads_of_rank, sdpa_with_sink, sink_softmax
from megalite.models.window import band_mask, binding, windowed_mask
from megalite.parallel import state, weight_grad
from megalite.parallel.context_parallel import ring_attention
from megalite.parallel.context_parallel_a2a import a2a_attention
from megalite.parallel.context_parallel_hierarchy import get_hierarchy, hierarchical_attention
from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear, part_of_rows
from megalite.parallel.mappings import (copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
                                        sum_over_tensor_model_parallel_region)
from megalite.parallel.random import get_rng_tracker

# Every core backend: (q, k, v [b, heads, s, d], allowed mask or None, dropout_p, causal, sink=None)
# -> [b, heads, s, d]; `sink` [heads]: attention sinks' logits (megalite.models.softmax_sink).


def _sdpa_attention(q, k, v, allowed, dropout_p, causal, sink=None):
    """PyTorch's fused attention (flash where available): no score matrix is stored. k and v may
    hold fewer heads than q (grouped-query attention: query heads in a group adjacent). `sink`
    [heads]: attention sinks (megalite.models.softmax_sink), one more key per head."""
    if allowed is not None or not _SDPA_TAKES_GROUPS:
        # A mask leaves PyTorch's memory-efficient kernel, which takes no key groups in torch 2.13 (flash
        # and the math kernel do; math keeps heads x s x s scores): the groups expanded, the same numbers
        k, v = _expand_groups(k, v, q.shape[1])
    if sink is not None:
        return sdpa_with_sink(q, k, v, allowed, dropout_p, causal, sink)
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    if allowed is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, **gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p)


def _explicit_attention(q, k, v, allowed, dropout_p, causal, sink=None):
    """Attention with the score and probability matrices materialized (the layout the activation
    formula and selective recomputation are about); `allowed` True = attend, None = causal or all;
    `sink` [heads]: attention sinks, a column of the softmax (Megatron-Core's unfused form)."""
    s = q.shape[-2]
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if allowed is None and causal:
        allowed = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    # kept in the activation dtype, as the formula assumes
    probs = torch.softmax(scores, dim=-1) if sink is None else sink_softmax(scores, sink)
    if dropout_p:
        probs = F.dropout(probs, dropout_p, True)
    return torch.matmul(probs, v)


def _fused_softmax_attention(q, k, v, allowed, dropout_p, causal, sink=None):
    """The explicit layout with the scale, mask and softmax in one fused kernel (megalite.ops);
    `allowed` True = attend, None = causal or all. The kernel has no sink column: with `sink` the
    softmax is the explicit one, as Megatron-Core's fused softmax falls back to PyTorch's."""
    if sink is not None:
        return _explicit_attention(q, k, v, allowed, dropout_p, causal, sink)
    scores = torch.matmul(q, k.transpose(-1, -2))
    scale = 1.0 / math.sqrt(q.shape[-1])
    if allowed is None:
        probs = ops.scaled_causal_softmax(scores, scale) if causal else ops.scaled_masked_softmax(scores, None, scale)
    else:
        probs = ops.scaled_masked_softmax(scores, ~allowed, scale)  # e.g. [b, 1, 1, s]: no s x s copy
    if dropout_p:
        probs = F.dropout(probs, dropout_p, True)
    return torch.matmul(probs, v)


_SDPA_TAKES_GROUPS = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)  # enable_gqa

ATTENTION_BACKENDS = {"sdpa": _sdpa_attention, "fused": _fused_softmax_attention, "torch": _explicit_attention}


def _context_parallel_core(q, k, v, attention_mask, config: TransformerConfig, window=None, sink=None):
    """Attention over the sequence split across the context-parallel group: keys and values
    around a ring (p2p), heads exchanged for the sequence (a2a), or both (a2a+p2p). Causal, no dropout, no mask but
    packed documents' (`PackedDocuments`) and the layer's sliding `window` (left, 0); `sink` [heads]:
    attention sinks (the all-to-all's rank attends with its block of them)."""
    documents = attention_mask if isinstance(attention_mask, PackedDocuments) else None
    if (attention_mask is not None and documents is None) or not config.causal:
        raise ValueError("context parallelism attends causally without masks: drop the attention mask or --cp")
    group, ranks = state.get_context_parallel_group(), state.get_context_parallel_ranks()
    whole_length = q.shape[2] * len(ranks)
    window = window if documents is not None else binding(window, whole_length, whole_length, True)
    if config.cp_comm_type == "a2a":
        attend = _sdpa_attention
        if sink is not None:
            attend = functools.partial(_sdpa_attention, sink=heads_of_rank(sink, state.get_context_parallel_rank(),
                                                                          len(ranks)))
        if documents is not None:
            def whole(q, k, v):
                return varlen_attention(q, k, v, documents, attend, 0.0, flash=sink is None, window=window)
        elif window is not None or sink is not None:
            def whole(q, k, v):
                mask = None if window is None else band_mask(q.shape[2], k.shape[2], window, True, q.device)
                return attend(q, k, v, mask, 0.0, True)
        else:
            whole = None
        return a2a_attention(q, k, v, group, ranks, causal=True, attend=whole)
    masks = dict(query_starts=None if documents is None else documents.starts,
                 document_bounds=None if documents is None else documents.bounds,
                 window_left=None if window is None else window[0], sink=sink)
    if config.cp_comm_type == "a2a+p2p":  # the all-to-all inside each node, the ring across them
        return hierarchical_attention(q, k, v, get_hierarchy(config.cp_a2a_size), causal=True, **masks)
    return ring_attention(q, k, v, group, ranks, causal=True, **masks)


def local_core(q, k, v, attention_mask, config: TransformerConfig, dropout_p: float, window=None, sink=None,
               attend=None):
    """Attention over the whole sequence this rank holds (no context parallelism) by the configured
    backend: packed documents one by one, else the mask (None: causal or all), within the layer's
    sliding `window` where it has one; PyTorch's fused backend on a GPU in fp16/bf16 without dropout
    runs a window as flash's variable-length kernel, one sequence per row, with no mask made (the
    kernel has no sinks: with `sink` [heads], the backend's own sink form). `attend`: a core of the
    caller's, given each mask as the backend would be (no flash kernel)."""
    backend = config.attention_backend
    flash = backend == "sdpa" and sink is None and attend is None
    attend = attend or ATTENTION_BACKENDS[backend]
    if sink is not None:
        attend = functools.partial(attend, sink=sink)
    if isinstance(attention_mask, PackedDocuments):
        return varlen_attention(q, k, v, attention_mask, attend, dropout_p, flash, window)
    window = binding(window, q.shape[2], k.shape[2], config.causal)
    if window is None:
        return attend(q, k, v, attention_mask, dropout_p, config.causal)
    b, sq, sk = q.shape[0], q.shape[2], k.shape[2]
    if (flash and attention_mask is None and sq == sk and config.causal
            and flash_varlen_applies(q, v, dropout_p)):
        return flash_varlen(q, k, v, torch.arange(0, (b + 1) * sq, sq), window)
    return attend(q, k, v, windowed_mask(attention_mask, sq, sk, window, config.causal, q.device), dropout_p,
                  config.causal)


def documents_of(attention_mask) -> tuple[PackedDocuments | None, object]:
    """(the packed documents where `attention_mask` is them, the mask attention applies: the
    documents where they confine attention, else none; a tensor mask as it is)."""
    if not isinstance(attention_mask, PackedDocuments):
        return None, attention_mask
    return attention_mask, attention_mask if attention_mask.mask_attention else None


def _full_width_norm(x: torch.Tensor, norm: nn.Module, first_head: int, copies: int) -> torch.Tensor:
    """`norm` (an RMSNorm as wide as all heads) over x [s, b, heads here, d]: this rank holds heads
    [first_head, first_head + heads here), each also held by `copies` - 1 other TP ranks (replicated
    key groups). Over TP the sum of squares is summed over the group, forward and backward."""
    flat = x.flatten(2)
    if state.get_tensor_model_parallel_world_size() == 1:
        return norm(flat).view_as(x)
    xf = flat.float()
    squares = xf.pow(2).sum(-1, keepdim=True)
    squares = sum_over_tensor_model_parallel_region(squares) / copies
    rstd = torch.rsqrt(squares / norm.weight.numel() + norm.eps)
    weight = weight_grad.defer_delivery(norm.weight)
    weight = weight + 1 if norm.zero_centered else weight
    start = first_head * x.shape[-1]
    return (xf * rstd * weight[start:start + flat.shape[-1]].float()).to(x.dtype).view_as(x)


def _expand_groups(k: torch.Tensor, v: torch.Tensor, heads: int):
    """Grouped keys and values [b, groups, s, d] repeated to one per query head (heads in a group are adjacent)."""
    if k.shape[1] == heads:
        return k, v
    repeats = heads // k.shape[1]
    return k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)


class ParallelAttention(nn.Module):
    """Self-attention over this TP rank's query heads.

    Multi-head (num_query_groups None): one column-parallel `qkv`. Grouped-query: `q` (rows [head,
    d]) and `kv` (rows [group, (k, v), d]), both column-parallel; when tp > groups each rank gathers
    the whole kv weight over TP and uses its own group's rows (the gather's backward sums the
    gradients of the ranks sharing a group). With qk_layernorm, `q_norm` / `k_norm` normalize every
    head over head_dim (with qk_layernorm_full_width, all query heads together and all key groups
    together, OLMoE's RMSNorm over the whole projection); rope then rotates q and k.
    """

    def __init__(self, config: TransformerConfig, init_method, output_init_method, device=None, window=None,
                 rope: bool = True, generator: torch.Generator | None = None):
        super().__init__()
        tp = state.get_tensor_model_parallel_world_size()
        config.check_tensor_parallel(tp)
        self.config, self.window = config, window  # window: this layer's sliding window (config.window_of)
        self.heads_per_rank = config.num_attention_heads // tp
        h, d, sp, dtype = config.hidden_size, config.head_dim, config.sequence_parallel, config.params_dtype
        column = dict(bias=config.qkv_bias, sequence_parallel=sp, params_dtype=dtype, device=device,
                      **config.tp_comm_options())
        if config.num_query_groups is None:
            self.qkv = ColumnParallelLinear(h, 3 * config.num_attention_heads * d, init_method=init_method, **column)
        else:  # q and kv: parts of Megatron-LM's one qkv matrix (its fans, where the init reads them)
            init_method = part_of_rows(init_method, (config.num_attention_heads + 2 * config.num_query_groups) * d)
            self.q = ColumnParallelLinear(h, config.num_attention_heads * d, init_method=init_method, **column)
            self.kv = ColumnParallelLinear(h, 2 * config.num_query_groups * d, init_method=init_method, **column)
            self.groups_replicated = tp > config.num_query_groups  # each rank one group, shared with others
            # (then its weight is read whole, in the model dtype: ZeRO-3 must gather those values)
            self.kv.weight.read_gathered_over_tp = self.groups_replicated
        if config.qk_layernorm:
            q_width, k_width = ((config.num_attention_heads * d, config.query_groups * d)
                                if config.qk_layernorm_full_width else (d, d))
            self.q_norm, self.k_norm = self._qk_norm(q_width, device), self._qk_norm(k_width, device)
        self.rotary = rotary_embedding(config) if rope else None  # rope: config.uses_rope of this layer
        self.proj = RowParallelLinear(
            config.num_attention_heads * d, h, init_method=output_init_method, bias=config.add_bias_linear,
            sequence_parallel=sp, params_dtype=dtype, device=device, **config.tp_comm_options(),
        )
        # attention sinks (--softmax-type), drawn from `generator`, a stream of their own (TransformerLayer's)
        attach_offset(self, config, self.heads_per_rank, generator, device)

    def _qk_norm(self, size: int, device) -> nn.Module:
        """A norm over `size` (head_dim, or all heads' width), whole on every rank; each rank sees its
        own heads only, so its gradient is partial over TP and `finalize_grads` sums it there."""
        c = self.config
        norm = NORMS[c.normalization](size, c.layernorm_epsilon, False, c.params_dtype, device, c.norm_backend,
                                      c.layernorm_zero_centered_gamma)
        for p in norm.parameters():
            p.partial_over_tp = True
        return norm

    def _norm_qk(self, q: torch.Tensor, k: torch.Tensor):
        """q_norm(q), k_norm(k) per head, or over every head at once (qk_layernorm_full_width); with
        qk_l2_norm each head at unit root-mean-square, no weights (Llama 4's)."""
        if self.config.qk_l2_norm:
            eps = self.config.layernorm_epsilon
            return l2_normalized(q, eps), l2_normalized(k, eps)
        if not self.config.qk_layernorm_full_width:
            return self.q_norm(q), self.k_norm(k)
        tp, rank = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()
        q_first = rank * q.shape[2]
        if self.config.num_query_groups is not None and self.groups_replicated:
            k_first, k_copies = rank // (tp // self.config.num_query_groups), tp // self.config.num_query_groups
        else:
            k_first, k_copies = rank * k.shape[2], 1
        return _full_width_norm(q, self.q_norm, q_first, 1), _full_width_norm(k, self.k_norm, k_first, k_copies)

    def _core(self, q, k, v, attention_mask):
        """softmax(q k^T / sqrt(d) + mask) v with dropout on the probabilities; q [b, heads, s, d],
        k and v [b, heads or groups, s, d]. With context parallelism s is this rank's share of the
        sequence and the attention spans the whole of it (megalite.parallel.context_parallel)."""
        sink = self.softmax_offset
        if state.get_context_parallel_world_size() > 1:
            return _context_parallel_core(q, k, v, attention_mask, self.config, self.window, sink)
        record_max_logits(self, q, k, attention_mask, local_core)
        p = self.config.attention_dropout if self.training else 0.0
        if self.config.attention_backend != "sdpa" or not _SDPA_TAKES_GROUPS:
            k, v = _expand_groups(k, v, q.shape[1])
        # Heads differ per TP rank, so must their dropout; without dropout no RNG is drawn.
        with get_rng_tracker().fork() if p > 0 else contextlib.nullcontext():
            return local_core(q, k, v, attention_mask, self.config, p, self.window, sink)

    def _project(self, x: torch.Tensor):
        """q [s, b, heads_per_rank, d], k and v [s, b, heads or groups on this rank, d]."""
        d = self.config.head_dim
        if self.config.num_query_groups is None:
            qkv = self.qkv(x)  # [s, b, heads_per_rank * 3 * head_dim]
            return qkv.view(*qkv.shape[:2], self.heads_per_rank, 3, d).unbind(3)
        x = self._input_of_column_parallel(x)
        q = self.q.gemm(x, bias=self.q.bias)
        kv = self.kv.gemm(x, *self._kv_weight_and_bias(), into_main_grad=not self.groups_replicated)
        k, v = kv.view(*kv.shape[:2], -1, 2, d).unbind(3)
        return q.view(*q.shape[:2], self.heads_per_rank, d), k, v

    def _input_of_column_parallel(self, x: torch.Tensor) -> torch.Tensor:
        """The input q and kv share: gathered along the sequence under SP (backward reduce-scatters),
        else copied into the TP region (backward all-reduces), once for both."""
        if self.config.sequence_parallel:
            return gather_from_sequence_parallel_region(x, output_grad_is_parallel=True)
        return copy_to_tensor_model_parallel_region(x)

    def _kv_weight_and_bias(self):
        """This rank's kv rows: its shard when it holds whole groups, else its group's rows of the
        weight gathered over TP."""
        weight, bias = self.kv.weight, self.kv.bias
        if not self.groups_replicated:
            return weight, bias
        tp, rank = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()
        group = rank // (tp // self.config.num_query_groups)
        rows = slice(group * 2 * self.config.head_dim, (group + 1) * 2 * self.config.head_dim)
        weight = gather_from_sequence_parallel_region(weight, output_grad_is_parallel=True)[rows]
        if bias is not None:
            bias = gather_from_sequence_parallel_region(bias, output_grad_is_parallel=True)[rows]
        return weight, bias

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                inference_context=None) -> torch.Tensor:
        if inference_context is not None:
            return self._forward_cached(x, inference_context)
        documents, attention_mask = documents_of(attention_mask)
        q, k, v = self._project(x)  # [s, b, heads (or groups), head_dim]; the whole sequence
        if self.config.qk_layernorm or self.config.qk_l2_norm:
            q, k = self._norm_qk(q, k)
        if self.rotary is not None:
            tables = documents.rotary_tables(self.rotary) if documents is not None else None
            q, k = self.rotary(q, tables), self.rotary(k, tables)
        s, b = q.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, head_dim]
        if self.config.recompute == "selective" and self.training:
            ctx = checkpoint_with_tp_rng(self._core, q, k, v, attention_mask)
        else:
            ctx = self._core(q, k, v, attention_mask)  # [b, heads, s, head_dim]
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.config.head_dim)
        return self.proj(ctx)

    def _forward_cached(self, x: torch.Tensor, cache) -> torch.Tensor:
        """Generation: this step's new tokens x attend to themselves and to the keys and values
        `cache` (megalite.generation.cache.KVCache) holds for this layer, which it extends with
        theirs; rope rotates them at their positions after the cached ones (`cache.rotary_tables`)."""
        q, k, v = self._project(x)
        if self.config.qk_layernorm or self.config.qk_l2_norm:
            q, k = self._norm_qk(q, k)
        if self.rotary is not None:
            tables = cache.rotary_tables(self.rotary)
            q, k = self.rotary(q, tables), self.rotary(k, tables)
        s, b = q.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, head_dim]
        k, v = cache.extend(self, k, v, dim=2)  # [b, heads or groups, cached + s, head_dim]
        ctx = self._core(q, k, v, cache.attention_mask())
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.config.head_dim)
        return self.proj(ctx)
