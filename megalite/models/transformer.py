"""GPT/BERT transformer layer built from the tensor-parallel layers.

Activations are [sequence, batch, hidden] (sequence-sharded over TP with sequence parallelism).
`attention_mask`, where given, is bool and broadcastable to [b, heads, s, s], True = attend (SDPA's
convention), and is the whole mask; without one, attention is causal or full as `config.causal` says.
Heads are split across TP ranks: QKV is column-parallel with rows ordered [head, (q, k, v),
head_dim], so a contiguous block of rows is whole heads; the output projection is row-parallel.
"""
from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from megalite import ops
from megalite.models.config import TransformerConfig
from megalite.parallel import state
from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear, init_device, normal_init
from megalite.parallel.random import get_rng_tracker


def init_generator(seed: int, component: int, device=None) -> torch.Generator:
    """RNG for one model component (embedding, layer n, ...): depends on the seed and the
    component alone, never on the pipeline stage or TP size that builds it. It lives where the
    weights are generated (`init_device`: the GPU when building on one, else the CPU)."""
    return torch.Generator(device=init_device(device)).manual_seed((seed * 1_000_003 + component) % 2**63)


def hidden_dropout(x: torch.Tensor, p: float, training: bool, sequence_parallel: bool) -> torch.Tensor:
    """Dropout on activations replicated across TP (default RNG, same on every TP rank).

    Under sequence parallelism each rank holds a slice of the sequence: it draws the mask for
    the whole sequence and keeps its slice, so the result equals the run without it.
    """
    if not training or p == 0.0:
        return x
    tp = state.get_tensor_model_parallel_world_size()
    if not sequence_parallel or tp == 1:
        return F.dropout(x, p, True)
    full = torch.empty((x.shape[0] * tp, *x.shape[1:]), dtype=x.dtype, device=x.device)
    keep = full.bernoulli_(1.0 - p).chunk(tp, dim=0)[state.get_tensor_model_parallel_rank()]
    # The scale as a Python number: the product is formed in fp32 and rounded once, while a scale
    # stored in bf16 (1/0.9 -> 1.109375) would shrink every kept value by 0.16%.
    return x * keep * (1.0 / (1.0 - p))


def checkpoint_with_tp_rng(fn, *args):
    """Activation checkpoint whose recomputation replays the same dropout masks, in the default
    RNG (torch restores it) and in the TP-rank RNG stream (restored here)."""
    tracker = get_rng_tracker()
    states_at_forward = tracker.get_states()
    calls = [0]

    def run(*a):
        calls[0] += 1
        if calls[0] == 1:
            return fn(*a)
        now = tracker.get_states()
        tracker.set_states(states_at_forward)
        try:
            return fn(*a)
        finally:
            tracker.set_states(now)

    return _torch_checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose parameters are marked as replicated inside the sequence-parallel
    region (their gradients are partial per TP rank and get summed over TP). `backend` "torch"
    runs F.layer_norm; "auto" and "fused" run megalite.ops.layer_norm (the fused kernel where it
    runs, F.layer_norm elsewhere)."""

    def __init__(self, size: int, eps: float, sequence_parallel: bool, dtype, device, backend: str = "auto"):
        super().__init__(size, eps=eps, dtype=dtype, device=device)
        self.backend = backend
        for p in self.parameters():
            p.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "torch":
            return super().forward(x)
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


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


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension, fp32 statistics (megalite.ops);
    the weight is marked for sequence parallelism like LayerNorm's."""

    def __init__(self, size: int, eps: float, sequence_parallel: bool, dtype, device, backend: str = "auto"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        self.eps, self.backend = eps, backend
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "torch":
            return ops.reference.rms_norm(x, self.weight, self.eps)
        return ops.rms_norm(x, self.weight, self.eps)


def norm_layer(config: TransformerConfig, device=None) -> nn.Module:
    """The config's normalization (LayerNorm or RMSNorm) over the hidden size, on its backend."""
    cls = RMSNorm if config.normalization == "rmsnorm" else LayerNorm
    return cls(config.hidden_size, config.layernorm_epsilon, config.sequence_parallel, config.params_dtype, device,
               config.norm_backend)


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
            if self.config.attention_backend == "torch":
                return _explicit_attention(q, k, v, attention_mask, p, self.config.causal)
            if self.config.attention_backend == "fused":
                return _fused_softmax_attention(q, k, v, attention_mask, p, self.config.causal)
            if attention_mask is None:
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.config.causal)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=p)

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


class ParallelMLP(nn.Module):
    def __init__(self, config: TransformerConfig, init_method, output_init_method, device=None):
        super().__init__()
        sp, dtype = config.sequence_parallel, config.params_dtype
        self.fc1 = ColumnParallelLinear(
            config.hidden_size, config.ffn_hidden_size, init_method=init_method,
            sequence_parallel=sp, params_dtype=dtype, device=device,
        )
        self.fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, init_method=output_init_method,
            sequence_parallel=sp, params_dtype=dtype, device=device,
        )
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class TransformerLayer(nn.Module):
    """Pre-LayerNorm (GPT-2): x + attn(ln(x)), then x + mlp(ln(x)); or post-LayerNorm (original
    BERT, `layernorm_position="post"`): ln(x + attn(x)), then ln(x + mlp(x)).

    The norms are named by where they sit: `input_layernorm` (pre only), `post_attention_layernorm`
    (both: on the stream after the attention residual), `post_mlp_layernorm` (post only).
    `layer_number` (0-based, global over the whole model) and `seed` fix the initialization.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, seed: int, device=None):
        super().__init__()
        self.config, self.layer_number = config, layer_number
        gen = init_generator(seed, 1000 + layer_number, device)
        init = normal_init(config.init_method_std, gen)
        # GPT-2: residual projections scaled by 1/sqrt(2 * layers) to keep the stream's variance.
        out_init = normal_init(config.init_method_std / math.sqrt(2.0 * config.num_layers), gen)
        ln = lambda: norm_layer(config, device)  # noqa: E731
        self.post_norm = config.layernorm_position == "post"
        if not self.post_norm:
            self.input_layernorm = ln()
        self.attention = ParallelAttention(config, init, out_init, device)
        self.post_attention_layernorm = ln()
        self.mlp = ParallelMLP(config, init, out_init, device)
        if self.post_norm:
            self.post_mlp_layernorm = ln()

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        c = self.config
        drop = lambda y: hidden_dropout(y, c.hidden_dropout, self.training, c.sequence_parallel)  # noqa: E731
        if self.post_norm:
            x = self.post_attention_layernorm(x + drop(self.attention(x, attention_mask)))
            return self.post_mlp_layernorm(x + drop(self.mlp(x)))
        x = x + drop(self.attention(self.input_layernorm(x), attention_mask))
        return x + drop(self.mlp(self.post_attention_layernorm(x)))


def compile_layers(model: nn.Module, backend: str | None = None) -> nn.Module:
    """torch.compile each transformer layer of `model` in place (`model.layers`): the layers are
    where the element-wise work (bias + GeLU, dropout + residual, LayerNorm) fuses; the embedding,
    loss and pipeline boundaries stay eager. Parameters and state_dict names do not change. Norms
    left on "auto" run F.layer_norm inside the compiled layers.
    `backend` defaults to $MEGALITE_COMPILE_BACKEND, else inductor."""
    import torch._dynamo

    backend = backend or os.environ.get("MEGALITE_COMPILE_BACKEND", "inductor")
    # Every layer is its own module instance: leave room for one compiled entry each.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(model.layers))
    for layer in model.layers:
        for module in layer.modules():
            # Inductor fuses F.layer_norm with its neighbours; a custom kernel would break the graph.
            if isinstance(module, (LayerNorm, RMSNorm)) and module.backend == "auto":
                module.backend = "torch"
        layer.compile(backend=backend)
    return model


def _run_chunk(layers):
    def run(x, attention_mask):
        for layer in layers:
            x = layer(x, attention_mask)
        return x
    return run


def run_layers(layers: nn.ModuleList, x: torch.Tensor, attention_mask, config: TransformerConfig,
               training: bool) -> torch.Tensor:
    """Run this stage's layers, checkpointing them as `--recompute full` asks.

    uniform: consecutive chunks of `recompute_num_layers` layers (default 1) are each one
    checkpoint, keeping only each chunk's input. block: the first `recompute_num_layers` layers
    (default all) are checkpointed one by one; the rest keep their activations.
    """
    if config.recompute != "full" or not training:
        return _run_chunk(layers)(x, attention_mask)
    if config.recompute_method == "uniform":
        k = config.recompute_num_layers or 1
        for start in range(0, len(layers), k):
            x = checkpoint_with_tp_rng(_run_chunk(layers[start:start + k]), x, attention_mask)
        return x
    k = len(layers) if config.recompute_num_layers is None else config.recompute_num_layers
    for i, layer in enumerate(layers):
        x = checkpoint_with_tp_rng(layer, x, attention_mask) if i < k else layer(x, attention_mask)
    return x
