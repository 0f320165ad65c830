"""Multi-head latent attention (MLA, DeepSeek-V2 arXiv 2405.04434 and DeepSeek-V3 arXiv 2412.19437)
over this TP rank's heads.

With d_n = qk_head_dim (the part of a query/key head without positions), d_r = qk_pos_emb_head_dim
(the rotary part) and d_v = v_head_dim:
- queries: x -> q_down (h -> q_lora_rank) -> RMSNorm -> q_up (-> heads x (d_n + d_r)); without a
  q_lora_rank one projection `q` (h -> heads x (d_n + d_r));
- keys and values: x -> kv_down (h -> kv_lora_rank + d_r), whose first kv_lora_rank dims are the
  latent c_kv -> RMSNorm -> kv_up (-> heads x (d_n + d_v)): each head's key part and value; the
  last d_r dims are one rotary key shared by every head ("decoupled RoPE");
- rope rotates the queries' d_r dims and the shared key; a head's key is [its d_n dims; the shared
  d_r], its query [d_n; d_r]; attention scales by 1 / sqrt(d_n + d_r); `proj` (heads x d_v -> h).

Tensor parallelism splits the up projections' rows (and `q`) by heads, column-parallel, and `proj`
row-parallel. The down projections and the latent norms are small and replicated: every rank
computes them on the whole (gathered, under sequence parallelism) input, and each rank's gradient of
them is partial (through its own heads only), summed over TP by `finalize_grads` (`partial_over_tp`).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megalite.models.attention import _context_parallel_core, documents_of, local_core
from megalite.models.config import TransformerConfig
from megalite.models.max_logit import record_max_logits
from megalite.models.norms import NORMS
from megalite.models.rng import checkpoint_with_tp_rng, weight_init
from megalite.models.rope import rotary_embedding, yarn_softmax_scale
from megalite.models.softmax_sink import attach_offset
from megalite.parallel import state
from megalite.parallel.fp8_linear import FP8Linear, amax_groups, fp8_linear
from megalite.parallel.grad_accumulation import linear
from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear, default_device, init_device
from megalite.parallel.mappings import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region
from megalite.parallel.random import get_rng_tracker


class ReplicatedLinear(nn.Module):
    """A bias-free linear map held whole on every TP rank, whose gradient each rank sees only in part."""

    def __init__(self, input_size: int, output_size: int, config: TransformerConfig, init_method=None, device=None):
        super().__init__()
        device = default_device(device)
        full = torch.zeros(output_size, input_size, dtype=torch.float32, device=init_device(device))
        (init_method or weight_init(config))(full)
        self.weight = nn.Parameter(full.to(device=device, dtype=config.params_dtype))
        self.weight.partial_over_tp = True
        self.fp8: FP8Linear | None = None

    def use_fp8(self, recipe) -> None:
        """Its GEMMs in FP8 as `recipe` says (None: not). Its input is whole over TP (split over CP);
        its output gradient is each TP rank's part of the sum, so its amax is reduced over TP x CP."""
        self.fp8 = None if recipe is None else FP8Linear(recipe, amax_groups("replicated"), self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return fp8_linear(x, self.weight, None, self.fp8)
        return linear(x, self.weight, None, into_main_grad=True)


class MultiLatentAttention(nn.Module):
    """Self-attention with low-rank (latent) queries, keys and values; see the module docstring."""

    def __init__(self, config: TransformerConfig, init_method, output_init_method, device=None, window=None,
                 generator: torch.Generator | None = None):
        super().__init__()
        tp = state.get_tensor_model_parallel_world_size()
        config.check_tensor_parallel(tp)
        self.config, self.window = config, window  # window: this layer's sliding window (config.window_of)
        heads, h = config.num_attention_heads, config.hidden_size
        self.heads_per_rank = heads // tp
        self.nope, self.rope, self.v_dim = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        column = dict(init_method=init_method, bias=False, sequence_parallel=config.sequence_parallel,
                      params_dtype=config.params_dtype, device=device, **config.tp_comm_options())
        q_width = heads * (self.nope + self.rope)
        if config.q_lora_rank is None:
            self.q = ColumnParallelLinear(h, q_width, **column)
        else:
            self.q_down = ReplicatedLinear(h, config.q_lora_rank, config, init_method, device)
            self.q_norm = self._latent_norm(config.q_lora_rank, device)
            self.q_up = ColumnParallelLinear(config.q_lora_rank, q_width, **column)
        self.kv_down = ReplicatedLinear(h, config.kv_lora_rank + self.rope, config, init_method, device)
        self.kv_norm = self._latent_norm(config.kv_lora_rank, device)
        self.kv_up = ColumnParallelLinear(config.kv_lora_rank, heads * (self.nope + self.v_dim), **column)
        self.rotary = rotary_embedding(config)
        self.proj = RowParallelLinear(heads * self.v_dim, h, init_method=output_init_method,
                                      bias=config.add_bias_linear, sequence_parallel=config.sequence_parallel,
                                      params_dtype=config.params_dtype, device=device,
                                      **config.tp_comm_options())
        attach_offset(self, config, self.heads_per_rank, generator, device)  # attention sinks (--softmax-type)

    def _latent_norm(self, size: int, device) -> nn.Module:
        c = self.config
        norm = NORMS["rmsnorm"](size, c.layernorm_epsilon, False, c.params_dtype, device, c.norm_backend,
                                c.layernorm_zero_centered_gamma)
        for p in norm.parameters():
            p.partial_over_tp = True
        return norm

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        """The whole input every projection reads: gathered along the sequence under SP (backward
        reduce-scatters the ranks' partial gradients), else copied into the TP region (all-reduced)."""
        if self.config.sequence_parallel:
            return gather_from_sequence_parallel_region(x, output_grad_is_parallel=True)
        return copy_to_tensor_model_parallel_region(x)

    def _project(self, x: torch.Tensor, rotary_tables=None):
        """q and k [s, b, heads_per_rank, d_n + d_r] (rope applied), v [s, b, heads_per_rank, d_v]."""
        s, b = x.shape[:2]
        if self.config.q_lora_rank is None:
            q = self.q.gemm(x)
        else:
            q = self.q_up.gemm(self.q_norm(self.q_down(x)))
        q_nope, q_pe = q.view(s, b, self.heads_per_rank, self.nope + self.rope).split([self.nope, self.rope], -1)
        latent, k_pe = self.kv_down(x).split([self.config.kv_lora_rank, self.rope], -1)
        kv = self.kv_up.gemm(self.kv_norm(latent))
        k_nope, v = kv.view(s, b, self.heads_per_rank, self.nope + self.v_dim).split([self.nope, self.v_dim], -1)
        q_pe, k_pe = self.rotary(q_pe, rotary_tables), self.rotary(k_pe.unsqueeze(2), rotary_tables)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.heads_per_rank, -1)], dim=-1)
        return q, k, v

    def _core(self, q, k, v, attention_mask):
        """softmax(q k^T / sqrt(d_n + d_r) + mask) v, q and k [b, heads, s, d_n + d_r], v [b, heads, s, d_v].
        With context parallelism s is this rank's share and the ring carries k and v (the latent is
        expanded per head first: what attention needs, as for any attention). Under YaRN the scale is
        m(mscale_all_dim)^2 / sqrt(d_n + d_r): q is multiplied by that ratio here, since every backend
        scales by 1 / sqrt(q's width): the same scores but for one extra rounding of q in its dtype
        (fp32: 6e-8 relative; bf16: the size of the rounding q had already), and autograd carries the
        ratio into q's gradient as the scaled scores require."""
        ratio = yarn_softmax_scale(self.config)  # 1 without YaRN
        if ratio != 1.0:
            q = q * ratio
        if state.get_context_parallel_world_size() > 1:
            # The ring's kernels take values as wide as keys: zero dims pad them, cut off after.
            pad = q.shape[-1] - v.shape[-1]
            if pad < 0:
                raise ValueError(f"context parallelism with MLA needs --v-head-dim ({v.shape[-1]}) at most "
                                 f"--qk-head-dim + --qk-pos-emb-head-dim ({q.shape[-1]})")
            out = _context_parallel_core(q, k, F.pad(v, (0, pad)), attention_mask, self.config, self.window,
                                         self.softmax_offset)
            return out[..., :v.shape[-1]]
        record_max_logits(self, q, k, attention_mask, local_core)
        p = self.config.attention_dropout if self.training else 0.0
        with get_rng_tracker().fork() if p > 0 else contextlib.nullcontext():
            return local_core(q, k, v, attention_mask, self.config, p, self.window, self.softmax_offset)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                inference_context=None) -> torch.Tensor:
        if inference_context is not None:
            return self._forward_cached(self._input(x), inference_context)
        documents, attention_mask = documents_of(attention_mask)
        q, k, v = self._project(self._input(x), documents.rotary_tables(self.rotary) if documents is not None else None)
        s, b = q.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        if self.config.recompute == "selective" and self.training:
            ctx = checkpoint_with_tp_rng(self._core, q, k, v, attention_mask)
        else:
            ctx = self._core(q, k, v, attention_mask)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.v_dim)
        return self.proj(ctx)

    def _forward_cached(self, x: torch.Tensor, cache) -> torch.Tensor:
        """Generation: `cache` (megalite.generation.cache.KVCache) keeps what MLA compresses the keys
        and values to, per token the normed latent c_kv [kv_lora_rank] and the rotated shared key
        [d_r] (not heads x (d_n + d_r + d_v)); each step expands the whole cached latent through
        kv_up for this rank's heads (the up projections are not absorbed into q and proj)."""
        s, b = x.shape[:2]
        tables = cache.rotary_tables(self.rotary)
        q = self.q.gemm(x) if self.config.q_lora_rank is None else self.q_up.gemm(self.q_norm(self.q_down(x)))
        q_nope, q_pe = q.view(s, b, self.heads_per_rank, self.nope + self.rope).split([self.nope, self.rope], -1)
        q = torch.cat([q_nope, self.rotary(q_pe, tables)], dim=-1)
        latent, k_pe = self.kv_down(x).split([self.config.kv_lora_rank, self.rope], -1)
        k_pe = self.rotary(k_pe.unsqueeze(2), tables).squeeze(2)
        latent, k_pe = cache.extend(self, self.kv_norm(latent).transpose(0, 1), k_pe.transpose(0, 1), dim=1)
        n = latent.shape[1]  # cached + new tokens: [b, n, kv_lora_rank], [b, n, d_r]
        kv = self.kv_up.gemm(latent)
        k_nope, v = kv.view(b, n, self.heads_per_rank, self.nope + self.v_dim).split([self.nope, self.v_dim], -1)
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(-1, -1, self.heads_per_rank, -1)], dim=-1)
        q, k, v = q.permute(1, 2, 0, 3), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, tokens, d]
        ctx = self._core(q, k, v, cache.attention_mask())
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.v_dim)
        return self.proj(ctx)
