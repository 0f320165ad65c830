"""The transformer layer, built from its components (attention.py, mlp.py, norms.py), and how a
stage runs its layers: activation recomputation and torch.compile.

Activations are [sequence, batch, hidden] (sequence-sharded over TP with sequence parallelism).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from megalite.models.attention import ParallelAttention
from megalite.models.config import TransformerConfig
from megalite.models.mlp import mlp_layer
from megalite.models.norms import NORMS, norm_layer
from megalite.models.rng import (FIRST_LAYER_COMPONENT, SINK_FIRST_COMPONENT, checkpoint_with_tp_rng, hidden_dropout,
                                 init_generator, output_weight_init, weight_init)


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
        gen = init_generator(seed, FIRST_LAYER_COMPONENT + layer_number, device)
        init, out_init = weight_init(config, gen), output_weight_init(config, gen)
        self.post_norm = config.layernorm_position == "post"
        if not self.post_norm:
            self.input_layernorm = norm_layer(config, device)
        window = config.window_of(layer_number)
        # sinks from a stream of their own: every weight stays what a vanilla model's seed draws
        sinks = init_generator(seed, SINK_FIRST_COMPONENT + layer_number, device) \
            if config.softmax_type == "learnable" else None
        if config.multi_latent_attention:
            from megalite.models.mla import MultiLatentAttention
            self.attention = MultiLatentAttention(config, init, out_init, device, window, sinks)
        else:
            self.attention = ParallelAttention(config, init, out_init, device, window, config.uses_rope(layer_number),
                                               sinks)
        self.post_attention_layernorm = norm_layer(config, device)
        if config.is_moe_layer(layer_number):
            from megalite.models.moe import MoELayer

            self.mlp = MoELayer(config, init, out_init, device, layer_number=layer_number)
        else:
            self.mlp = mlp_layer(config, init, out_init, device)
        if self.post_norm:
            self.post_mlp_layernorm = norm_layer(config, device)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                inference_context=None) -> torch.Tensor:
        """`inference_context`: generation's key/value cache (megalite.generation.cache), or None (training)."""
        c = self.config
        # A branch joins the stream in the stream's dtype (fp32 under --fp32-residual-connection, where the
        # dropout and the sum are fp32 as Megatron-Core's bias-dropout-add makes them; else a no-op).
        drop = lambda y: hidden_dropout(y.to(x.dtype), c.hidden_dropout, self.training, c.sequence_parallel)  # noqa: E731
        cache = {} if inference_context is None else {"inference_context": inference_context}
        if self.post_norm:
            x = self.post_attention_layernorm(x + drop(self.attention(x, attention_mask, **cache)))
            return self.post_mlp_layernorm(x + drop(self.mlp(x)))
        x = x + drop(self.attention(self.input_layernorm(x), attention_mask, **cache))
        return x + drop(self.mlp(self.post_attention_layernorm(x)))


def _norms_to_torch(module: nn.Module) -> None:
    """Inductor fuses F.layer_norm with its neighbours; a custom kernel would break the graph."""
    for m in module.modules():
        if isinstance(m, tuple(NORMS.values())) and m.backend == "auto":
            m.backend = "torch"


def compile_layers(model: nn.Module, backend: str | None = None, whole: bool = False) -> nn.Module:
    """torch.compile each transformer layer of `model` in place (`model.layers`): the layers are
    where the element-wise work (bias + GeLU, dropout + residual, LayerNorm) fuses; the embedding,
    loss and pipeline boundaries stay eager. `whole`: compile the model (this stage's chunk) as one
    region instead, so the embedding, final norm, output layer and loss fuse too and no graph
    boundary sits between layers (where no tensor-parallel collective runs between them).
    Parameters and state_dict names do not change. Norms left on "auto" run F.layer_norm inside the
    compiled code. `backend` defaults to $MEGALITE_COMPILE_BACKEND, else inductor."""
    import torch._dynamo

    backend = backend or os.environ.get("MEGALITE_COMPILE_BACKEND", "inductor")
    _norms_to_torch(model)
    if whole:
        model.compile(backend=backend)
        return model
    # Every layer is its own module instance: leave room for one compiled entry each.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(model.layers))
    for layer in model.layers:
        layer.compile(backend=backend)
    return model


def _run_chunk(layers):
    def run(x, attention_mask):
        for layer in layers:
            x = layer(x, attention_mask)
        return x
    return run


def run_layers(layers: nn.ModuleList, x: torch.Tensor, attention_mask, config: TransformerConfig,
               training: bool, inference_context=None) -> torch.Tensor:
    """Run this stage's layers, checkpointing them as `--recompute full` asks.

    uniform: consecutive chunks of `recompute_num_layers` layers (default 1) are each one
    checkpoint, keeping only each chunk's input. block: the first `recompute_num_layers` layers
    (default all) are checkpointed one by one; the rest keep their activations.
    With an `inference_context` (generation, megalite.generation) every layer runs plainly against its cache.
    """
    if inference_context is not None:
        for layer in layers:
            x = layer(x, attention_mask, inference_context=inference_context)
        return x
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
