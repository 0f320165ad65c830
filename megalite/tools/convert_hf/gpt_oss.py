"""OpenAI's gpt-oss (GptOssForCausalLM) <-> megalite's GPTModel with MoE layers.

A gpt-oss layer is a Llama-family layer (RMSNorm, grouped-query attention, rope) with Megatron-LM's
gpt-oss flags: q/k/v/o biases and learned attention sinks (`self_attn.sinks`: --softmax-type learnable),
a sliding window in the layers `layer_types` marks (--window-size W-1,0 --window-attn-skip-freq),
YaRN rope without rounding (`truncate=False`: --no-yarn-correction-range-round-to-int), and every MLP a
MoE layer whose router and experts have biases (add_bias_linear) and whose experts are quick-GeGLU,
clamped and offset (--quick-geglu --activation-func-clamp-value `swiglu_limit` --glu-linear-offset 1):
Hugging Face's `(clamp(up, -l, l) + 1) * g sigmoid(1.702 g)`, g = min(gate, l).

Experts: Hugging Face holds one [E, H, 2F] `gate_up_proj` (x @ W) whose columns interleave gate and up
(gate 0, up 0, gate 1, ...), a [E, 2F] bias alike, one [E, F, H] `down_proj` and a [E, H] bias;
megalite's fc1 [E, 2F, H] holds the gate rows, then the up rows (`gate_up` rows), fc2 [E, H, F] is
down_proj transposed. The router (`mlp.router`, with bias) takes the top k logits, then a softmax over
them: megalite's default router. Released checkpoints store the experts in MXFP4: load them into
transformers dequantized (bf16) and convert that model.
"""
from __future__ import annotations

import math
import warnings
from typing import Mapping

import torch

from megalite.models.config import TransformerConfig
from megalite.tools.convert_hf import llama
from megalite.tools.convert_hf.common import (ConversionNote, Row, export_tensors, import_tensors, load_into, refuse,
                                              table_problems, transformers)

GPT_OSS = "GptOssForCausalLM"
ARCHITECTURES = (GPT_OSS,)
MODEL_TYPES = {"gpt_oss": GPT_OSS}
QUICK_GELU_ALPHA = 1.702  # Megatron-Core's quick_gelu, fixed


def _shape(c) -> llama.Shape:
    return llama.Shape(c.num_layers, grouped=True, qkv_bias=True, linear_bias=True, qk_norm=False,
                       untied=c.untie_embeddings_and_output_weights)


def table(c) -> list[Row]:
    """Rows in the order of GPTModel.state_dict(); Hugging Face names are GptOssForCausalLM's."""
    s = _shape(c)
    rows = llama.embedding_rows(s)
    for i in range(c.num_layers):
        attention = llama.attention_rows(s, i)
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        attention.insert(-1, (f"{ours}attention.softmax_offset", f"{theirs}self_attn.sinks", "same"))
        mlp = [(f"{ours}mlp.router.{p}", f"{theirs}mlp.router.{p}", "same") for p in ("weight", "bias")]
        experts, hf = f"{ours}mlp.experts.", f"{theirs}mlp.experts."
        mlp += [(f"{experts}fc1_weight", f"{hf}gate_up_proj", "gate_up"),
                (f"{experts}fc2_weight", f"{hf}down_proj", "experts_t"),
                (f"{experts}fc1_bias", f"{hf}gate_up_proj_bias", "gate_up"),
                (f"{experts}fc2_bias", f"{hf}down_proj_bias", "same")]
        rows += attention + mlp
    return rows + [llama.FINAL_NORM_ROW]


# ---------------------------------------------------------------------------------------------
# Import

def owns_model(model) -> bool:
    return type(model).__name__ == GPT_OSS


def hf_class(cfg):
    return getattr(transformers(), GPT_OSS)


def config_fields(cfg) -> tuple[dict, list[str]]:
    """(TransformerConfig fields but params_dtype, problems) of a GptOssConfig."""
    problems: list[str] = []
    fields = llama.shared_fields(cfg, GPT_OSS, problems, reads_hidden_act=False)  # (its experts' act is their own)
    if not getattr(cfg, "attention_bias", True):
        problems.append("attention_bias=False (megalite's add_bias_linear gives attention the biases gpt-oss's "
                        "router and experts always have)")
    alpha = getattr(cfg, "swiglu_alpha", QUICK_GELU_ALPHA)
    if not math.isclose(alpha, QUICK_GELU_ALPHA):
        problems.append(f"swiglu_alpha={alpha} (megalite's quick GeLU is Megatron-Core's, x sigmoid(1.702 x))")
    experts = cfg.num_local_experts
    fields.update(
        add_bias_linear=True, softmax_type="learnable", activation="quick_gelu", gated_linear_unit=True,
        glu_linear_offset=1.0, activation_func_clamp_value=float(cfg.swiglu_limit), ffn_hidden_size=cfg.intermediate_size,
        num_moe_experts=experts, moe_router_topk=cfg.num_experts_per_tok, moe_ffn_hidden_size=cfg.intermediate_size,
        moe_layer_freq=[1] * cfg.num_hidden_layers, moe_router_pre_softmax=False,
        moe_router_load_balancing_type="aux_loss" if getattr(cfg, "output_router_logits", False) else "none",
        moe_aux_loss_coeff=float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0))
    if fields["moe_aux_loss_coeff"] and fields["moe_router_load_balancing_type"] != "none":
        warnings.warn(f"{GPT_OSS}'s router_aux_loss_coef {fields['moe_aux_loss_coeff']:g} weighs one balancing loss "
                      f"pooled over every layer; megalite's --moe-aux-loss-coeff weighs each layer's, times experts / "
                      f"top-k: the same coefficient pulls about layers / top-k times harder (docs/moe.md)",
                      ConversionNote, stacklevel=3)
    return fields, problems


def config_problems(cfg) -> list[str]:
    return config_fields(cfg)[1]


def from_hf(model) -> tuple[TransformerConfig, dict[str, torch.Tensor]]:
    fields, problems = config_fields(model.config)
    theirs = dict(model.state_dict())
    if any(k.endswith(("_blocks", "_scales")) for k in theirs):
        problems.append("its experts are MXFP4-quantized (gate_up_proj_blocks / _scales): load the model with "
                        "transformers' Mxfp4Config(dequantize=True) and convert that (or its save_pretrained directory)")
    return llama.imported(GPT_OSS, fields, problems, theirs, lambda theirs, config, padded:
                          import_tensors(theirs, table(config), llama.groups_of(config), padded))


# ---------------------------------------------------------------------------------------------
# Export

def is_gpt_oss_like(c) -> bool:
    """A megalite config only gpt-oss holds: a MoE model with attention sinks."""
    return bool(getattr(c, "is_moe", False)) and getattr(c, "softmax_type", "vanilla") == "learnable"


def export_problems(c) -> list[str]:
    problems = []
    wanted = {"position_embedding_type": "rope", "normalization": "rmsnorm", "gated_linear_unit": True,
              "activation": "quick_gelu", "glu_linear_offset": 1.0, "layernorm_position": "pre", "causal": True,
              "rotary_percent": 1.0, "add_bias_linear": True, "add_qkv_bias": False, "qk_layernorm": False,
              "softmax_type": "learnable", "moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
              "moe_router_topk_scaling_factor": None, "moe_router_num_groups": None,
              "moe_router_enable_expert_bias": False, "moe_shared_expert_intermediate_size": None,
              "moe_apply_probs_on_input": False}
    for name, value in wanted.items():
        if getattr(c, name, None) != value:
            problems.append(f"{GPT_OSS} needs {name}={value!r} (config: {getattr(c, name, None)!r})")
    if c.activation_func_clamp_value is None:
        problems.append(f"{GPT_OSS} clamps its experts' halves (swiglu_limit): the model has no "
                        f"--activation-func-clamp-value")
    if not all(c.moe_layer_freq):
        problems.append(f"{GPT_OSS} has no dense layers (moe_layer_freq={c.moe_layer_freq})")
    problems += llama.attention_problems(c, GPT_OSS)  # rope scalings Hugging Face cannot say together
    if c.ffn_hidden_size != c.moe_ffn_hidden_size:  # (intermediate_size is the experts' width: no dense MLP)
        problems.append(f"{GPT_OSS} has one MLP width: ffn_hidden_size={c.ffn_hidden_size} and moe_ffn_hidden_size="
                        f"{c.moe_ffn_hidden_size} differ")
    return problems


def hf_config(c):
    cls = getattr(transformers(), "GptOssConfig")
    kwargs = llama.hf_config_kwargs(c, cls)
    window = llama.hf_window(c)
    pattern = None if window is None else window[1] or [1] * c.num_layers
    kwargs.update(intermediate_size=c.moe_ffn_hidden_size, num_local_experts=c.num_moe_experts,
                  num_experts_per_tok=c.moe_router_topk, swiglu_limit=c.activation_func_clamp_value,
                  router_aux_loss_coef=c.moe_aux_loss_coeff,
                  output_router_logits=c.moe_router_load_balancing_type != "none" and c.moe_aux_loss_coeff > 0,
                  # a window its every layer ignores where there is none: GptOssModel makes the sliding mask always
                  attention_bias=True, sliding_window=c.max_position_embeddings if window is None else window[0],
                  layer_types=["sliding_attention" if pattern and pattern[i] else "full_attention"
                               for i in range(c.num_layers)])
    for name in ("use_sliding_window", "max_window_layers", "mlp_bias"):
        kwargs.pop(name, None)
    return llama.with_head_dim(cls(**kwargs), c)


def to_hf(config: TransformerConfig, state_dict: Mapping[str, torch.Tensor], architecture: str | None = None):
    """GptOssForCausalLM in eval mode holding a megalite MoE GPT's weights."""
    rows = table(config)
    refuse("this megalite GPT", export_problems(config) + table_problems(state_dict, rows, config.vocab_size),
           to=f"Hugging Face {GPT_OSS}")
    theirs = export_tensors(state_dict, rows, llama.groups_of(config), config.vocab_size)
    model = getattr(transformers(), GPT_OSS)(hf_config(config))
    if not config.untie_embeddings_and_output_weights:
        theirs["lm_head.weight"] = theirs["model.embed_tokens.weight"]
    return load_into(model.to(state_dict["word_embeddings.weight"].dtype), theirs)
