"""NVIDIA's Nemotron family (NemotronForCausalLM: Nemotron-4, Minitron) <-> megalite's GPTModel with
squared-ReLU MLPs (--squared-relu), zero-centred LayerNorms with biases (--apply-layernorm-1p), rope
on part of each head (--rotary-percent) and grouped-query attention: Megatron-LM's Nemotron flags.

Hugging Face's NemotronLayerNorm1P stores its weight zero-centred and computes with weight + 1, as
megalite's zero-centred norms do, so the norms copy unchanged; its rope rotates "half" of the first
`partial_rotary_factor` of each head's dims, as megalite's does. The attention rows are the Llama
family's; the MLP is one up_proj (fc1) and down_proj (fc2), no gate.
"""
from __future__ import annotations

from typing import Mapping

import torch

from megalite.models.config import TransformerConfig
from megalite.tools.convert_hf import llama
from megalite.tools.convert_hf.common import (ConversionError, Row, export_tensors, import_tensors, pairs, refuse,
                                              table_problems)

NEMOTRON = "NemotronForCausalLM"
ARCHITECTURES = (NEMOTRON,)
MODEL_TYPES = {"nemotron": NEMOTRON}


def _norm_rows(ours: str, theirs: str) -> list[Row]:
    return pairs([(ours, theirs)], ("weight", "bias"))


def table(s: llama.Shape) -> list[Row]:
    """Rows in the order of GPTModel.state_dict(): the Llama family's attention with LayerNorm biases
    beside each norm weight, an ungated MLP."""
    linear_params = ("weight", "bias") if s.linear_bias else ("weight",)
    rows = llama.embedding_rows(s)
    for i in range(s.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for row in llama.attention_rows(s, i):
            rows.append(row)
            if row[0].endswith("layernorm.weight"):  # the LayerNorm's bias follows its weight
                rows.append((row[0][:-len("weight")] + "bias", row[1][:-len("weight")] + "bias", "same"))
        rows += pairs([(f"{ours}mlp.fc1", f"{theirs}mlp.up_proj"), (f"{ours}mlp.fc2", f"{theirs}mlp.down_proj")],
                      linear_params)
    return rows + _norm_rows("final_layernorm", "model.norm")


def owns_model(model) -> bool:
    return type(model).__name__ in ARCHITECTURES


def hf_class(cfg):
    return _classes()[1]


def config_fields(cfg) -> tuple[dict, list[str]]:
    """(TransformerConfig fields but params_dtype, problems) of a NemotronConfig."""
    problems = []
    heads, hidden = cfg.num_attention_heads, cfg.hidden_size
    groups = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    if heads % groups:
        problems.append(f"num_key_value_heads={groups} does not divide num_attention_heads={heads}")
    if cfg.hidden_act != "relu2":
        problems.append(f"hidden_act={cfg.hidden_act!r} (megalite's Nemotron MLP is squared ReLU: relu2)")
    attention_bias, mlp_bias = bool(getattr(cfg, "attention_bias", False)), bool(getattr(cfg, "mlp_bias", False))
    if attention_bias != mlp_bias:
        problems.append(f"attention_bias={attention_bias} with mlp_bias={mlp_bias} (megalite's add_bias_linear puts "
                        f"biases on attention and MLP together)")
    rope = llama.rope_parameters(cfg)
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    if rope["rope_type"] != "default":
        problems.append(f"rope_type {rope['rope_type']!r} (megalite converts Nemotron's default RoPE)")
    fields = dict(
        num_layers=cfg.num_hidden_layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        kv_channels=head_dim if hidden % heads or head_dim != hidden // heads else None,
        ffn_hidden_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings, hidden_dropout=0.0,
        attention_dropout=float(getattr(cfg, "attention_dropout", 0.0) or 0.0), layernorm_epsilon=cfg.norm_eps,
        init_method_std=cfg.initializer_range, layernorm_position="pre", normalization="layernorm",
        layernorm_zero_centered_gamma=True, activation="squared_relu", gated_linear_unit=False, causal=True,
        position_embedding_type="rope", rotary_base=float(rope["rope_theta"]), rotary_percent=float(partial),
        add_bias_linear=attention_bias, add_qkv_bias=False,
        untie_embeddings_and_output_weights=not getattr(cfg, "tie_word_embeddings", False))
    return fields, problems


def config_problems(cfg) -> list[str]:
    return config_fields(cfg)[1]


def from_hf(model) -> tuple[TransformerConfig, dict[str, torch.Tensor]]:
    fields, problems = config_fields(model.config)
    return llama.imported(NEMOTRON, fields, problems, dict(model.state_dict()), lambda theirs, config, padded:
                          import_tensors(theirs, table(llama.shape_of(config)), llama.groups_of(config), padded))


def is_nemotron_like(c) -> bool:
    """Whether a megalite GPT config is of this family: rope with squared-ReLU MLPs."""
    return getattr(c, "position_embedding_type", None) == "rope" and getattr(c, "activation", None) == "squared_relu"


def export_problems(c) -> list[str]:
    """What NemotronForCausalLM cannot hold of a megalite config."""
    wanted = {"position_embedding_type": "rope", "normalization": "layernorm", "layernorm_zero_centered_gamma": True,
              "gated_linear_unit": False, "activation": "squared_relu", "layernorm_position": "pre", "causal": True,
              "add_qkv_bias": False, "qk_layernorm": False, "rope_scaling_factor": None, "yarn_factor": None,
              "rotary_seq_len_interpolation_factor": None, "multi_latent_attention": False, "num_moe_experts": None}
    problems = [f"{NEMOTRON} needs {name}={value!r} (config: {getattr(c, name, None)!r})"
                for name, value in wanted.items() if getattr(c, name, None) != value]
    return problems  # (a sliding window, and Llama 4's settings: refused by convert.to_hf for every family)


def _classes():
    tf = llama.transformers()
    if not hasattr(tf, "NemotronForCausalLM"):  # transformers before 4.44
        raise ConversionError(f"this transformers ({tf.__version__}) has no {NEMOTRON}: install transformers >= 4.44")
    return tf.NemotronConfig, tf.NemotronForCausalLM


def hf_config(c):
    cls = _classes()[0]
    rope = {"rope_theta": c.rotary_base, "partial_rotary_factor": c.rotary_percent}
    if llama._accepts(cls, "rope_parameters"):
        rope = {"rope_parameters": {"rope_type": "default", **rope}}  # transformers >= 5; earlier: the two alone
    return cls(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
               num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
               num_key_value_heads=c.query_groups, head_dim=c.head_dim, hidden_act="relu2",
               max_position_embeddings=c.max_position_embeddings, initializer_range=c.init_method_std,
               norm_eps=c.layernorm_epsilon, attention_dropout=c.attention_dropout,
               tie_word_embeddings=not c.untie_embeddings_and_output_weights, attention_bias=c.add_bias_linear,
               mlp_bias=c.add_bias_linear, bos_token_id=None, eos_token_id=None, pad_token_id=None, **rope)


def to_hf(config: TransformerConfig, state_dict: Mapping[str, torch.Tensor], architecture: str | None = None):
    """NemotronForCausalLM in eval mode, holding a megalite GPT's weights."""
    rows = table(llama.shape_of(config))
    refuse("this megalite GPT", export_problems(config) + table_problems(state_dict, rows, config.vocab_size),
           to=f"Hugging Face {NEMOTRON}")
    theirs = export_tensors(state_dict, rows, llama.groups_of(config), config.vocab_size)
    return llama.load_exported(config, state_dict, theirs, _classes()[1](hf_config(config)))
