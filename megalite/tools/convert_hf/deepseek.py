"""DeepseekV3ForCausalLM <-> megalite's GPTModel with multi-head latent attention (megalite.models.mla)
and DeepSeek's mixture of experts.

Attention, Hugging Face's names in brackets: q_down [q_a_proj], q_norm [q_a_layernorm], q_up
[q_b_proj] or q [q_proj] without a q_lora_rank; kv_down [kv_a_proj_with_mqa], kv_norm
[kv_a_layernorm], kv_up [kv_b_proj]; proj [o_proj]. Copied row for row but for the rotary rows:
with `rope_interleave` (true in DeepSeek's checkpoints) Hugging Face's d_r rotary dims rotate in
pairs (0, 1), (2, 3), ..., which it first regroups into rotate-half order (the even dims, then the
odd ones). megalite rotates half, so import reorders the rows that make those dims the same way:
the last d_r of each head's d_n + d_r rows of q_b_proj / q_proj, and the last d_r rows of
kv_a_proj_with_mqa (the shared rotary key). megalite then rotates the very numbers Hugging Face
does: the same scores. Export reorders them back and writes `rope_interleave` true.

MoE layers (after `first_k_dense_replace` dense ones): the router `mlp.gate` (sigmoid scores;
`e_score_correction_bias`, on selection only, is megalite's `router.expert_bias`), the experts
fused in memory as for the other MoE families (moe.py; one tensor per expert in the files), and
`n_shared_experts` ungated shared experts, which are one MLP n times `moe_intermediate_size` wide.
"""
from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from typing import Mapping

import torch

from megalite.models.config import TransformerConfig
from megalite.models.rope import yarn_attention_factor, yarn_mscale
from megalite.parallel.layers import pad_vocab_size
from megalite.tools.convert_hf import llama, moe
from megalite.tools.convert_hf.common import (ConversionNote, Row, export_tensors, import_tensors, load_into, pairs,
                                              refuse, stored_tensor_names, table_problems, transformers)

DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
ARCHITECTURES = (DEEPSEEK_V3,)
MODEL_TYPES = {"deepseek_v3": DEEPSEEK_V3}
LATENT_NORM_EPS = 1e-6  # Hugging Face's q_a_layernorm and kv_a_layernorm, whatever rms_norm_eps is
GLU = {"glu": 1}  # common.import_tensors' groups: gate and up stacked once


@dataclass(frozen=True)
class Shape:
    """What decides the table's rows."""
    num_layers: int
    q_lora: bool  # q_down, q_norm, q_up; else one `q`
    moe_layers: tuple[int, ...]  # 1: layer i's MLP has experts, 0: dense
    expert_bias: bool
    shared_expert: bool
    untied: bool


def shape_of(c) -> Shape:
    moe_layers = tuple(c.moe_layer_freq) if c.is_moe else (0,) * c.num_layers
    return Shape(c.num_layers, c.q_lora_rank is not None, moe_layers, c.is_moe and c.moe_router_enable_expert_bias,
                 bool(c.moe_shared_expert_intermediate_size), c.untie_embeddings_and_output_weights)


def _llama_shape(s: Shape) -> llama.Shape:
    """The Llama family's Shape, for its embedding and (bias-free) dense MLP rows."""
    return llama.Shape(s.num_layers, grouped=False, qkv_bias=False, linear_bias=False, qk_norm=False, untied=s.untied)


def attention_rows(s: Shape, i: int) -> list[Row]:
    """Layer i's input norm, attention and post-attention norm."""
    ours, theirs = f"layers.{i}.", f"model.layers.{i}."
    queries = ([("q_down", "q_a_proj"), ("q_norm", "q_a_layernorm"), ("q_up", "q_b_proj")] if s.q_lora
               else [("q", "q_proj")])
    modules = queries + [("kv_down", "kv_a_proj_with_mqa"), ("kv_norm", "kv_a_layernorm"), ("kv_up", "kv_b_proj"),
                         ("proj", "o_proj")]
    rows = [(f"{ours}input_layernorm.weight", f"{theirs}input_layernorm.weight", "same")]
    rows += pairs([(f"{ours}attention.{a}", f"{theirs}self_attn.{b}") for a, b in modules], ("weight",))
    return rows + [(f"{ours}post_attention_layernorm.weight", f"{theirs}post_attention_layernorm.weight", "same")]


def moe_mlp_rows(s: Shape, i: int) -> list[Row]:
    """Layer i's MoE MLP, in the order of MoELayer.state_dict()."""
    ours, theirs = f"layers.{i}.mlp.", f"model.layers.{i}.mlp."
    rows = [(f"{ours}router.weight", f"{theirs}gate.weight", "same")]
    if s.expert_bias:
        rows.append((f"{ours}router.expert_bias", f"{theirs}gate.e_score_correction_bias", "same"))
    rows += [(f"{ours}experts.fc1_weight", f"{theirs}experts.gate_up_proj", "same"),
             (f"{ours}experts.fc2_weight", f"{theirs}experts.down_proj", "same")]
    if s.shared_expert:
        rows += llama.dense_mlp_rows(_llama_shape(s), f"{ours}shared_experts.", f"{theirs}shared_experts.")
    return rows


def table(s: Shape) -> list[Row]:
    """Rows in the order of GPTModel.state_dict(); HF names are the in-memory DeepseekV3ForCausalLM's."""
    base = _llama_shape(s)
    rows = llama.embedding_rows(base)
    for i, has_experts in enumerate(s.moe_layers):
        mlp = (moe_mlp_rows(s, i) if has_experts
               else llama.dense_mlp_rows(base, f"layers.{i}.mlp.", f"model.layers.{i}.mlp."))
        rows += attention_rows(s, i) + mlp
    return rows + [llama.FINAL_NORM_ROW]


# ---------------------------------------------------------------------------------------------
# The rotary rows

def rotate_half_order(d_r: int) -> torch.Tensor:
    """Interleaved rotary dims (pairs (0, 1), (2, 3), ...) in rotate-half order: even, then odd."""
    return torch.cat([torch.arange(0, d_r, 2), torch.arange(1, d_r, 2)])


def _reorder_tail(w: torch.Tensor, block: int, d_r: int, order: torch.Tensor) -> torch.Tensor:
    """w's rows as blocks of `block` rows, the last d_r rows of each block taken in `order`."""
    blocks = w.reshape(-1, block, *w.shape[1:])
    kept, rotary = blocks[:, :block - d_r], blocks[:, block - d_r:]
    return torch.cat([kept, rotary[:, order]], dim=1).reshape(w.shape)


def reorder_rotary_rows(tensors: Mapping[str, torch.Tensor], c, order: torch.Tensor) -> dict[str, torch.Tensor]:
    """A copy of megalite-named `tensors` whose query heads' and shared key's rotary rows are taken in
    `order` (rotate_half_order on import, its inverse on export)."""
    d_r, out = c.qk_pos_emb_head_dim, dict(tensors)
    query = "q_up" if c.q_lora_rank is not None else "q"
    for i in range(c.num_layers):
        attn = f"layers.{i}.attention."
        out[f"{attn}{query}.weight"] = _reorder_tail(tensors[f"{attn}{query}.weight"], c.qk_head_dim + d_r, d_r, order)
        out[f"{attn}kv_down.weight"] = _reorder_tail(tensors[f"{attn}kv_down.weight"], c.kv_lora_rank + d_r, d_r, order)
    return out


def tensors_from_hf(theirs: Mapping[str, torch.Tensor], c, padded_vocab: int,
                    interleaved: bool = True) -> dict[str, torch.Tensor]:
    """megalite's tp = 1 tensors from a DeepseekV3ForCausalLM state dict (`interleaved`: its config's
    rope_interleave)."""
    ours = import_tensors(theirs, table(shape_of(c)), GLU, padded_vocab)
    return reorder_rotary_rows(ours, c, rotate_half_order(c.qk_pos_emb_head_dim)) if interleaved else ours


def tensors_to_hf(ours: Mapping[str, torch.Tensor], c) -> dict[str, torch.Tensor]:
    """The inverse of tensors_from_hf, rotary rows interleaved (no lm_head.weight when tied)."""
    order = torch.argsort(rotate_half_order(c.qk_pos_emb_head_dim))
    return export_tensors(reorder_rotary_rows(ours, c, order), table(shape_of(c)), GLU, c.vocab_size)


# ---------------------------------------------------------------------------------------------
# YaRN

def hf_yarn_attention_factor(rope: Mapping, factor: float) -> float:
    """What Hugging Face multiplies cos and sin by under YaRN: `attention_factor` when given, else
    m(mscale) / m(mscale_all_dim) when both are non-zero, else m(1) (mscale alone is ignored)."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return yarn_mscale(factor, 1.0)


def _yarn_mscale_for(wanted: float, factor: float, all_dim: float, given: float, problems: list[str]) -> float:
    """megalite's yarn_mscale giving cos/sin the factor `wanted` beside `all_dim`: `given` when it
    does (DeepSeek's configs), else solved from m(mscale) = wanted * m(all_dim)."""
    if math.isclose(yarn_mscale(factor, given) / yarn_mscale(factor, all_dim), wanted, rel_tol=1e-12):
        return given
    if factor <= 1.0:
        problems.append(f"yarn attention_factor={wanted} with factor={factor} (megalite's is 1 when the factor is at most 1)")
        return given
    return (wanted * yarn_mscale(factor, all_dim) - 1.0) / (0.1 * math.log(factor))


def _yarn_fields(rope: Mapping, problems: list[str]) -> dict:
    factor, original = rope.get("factor"), rope.get("original_max_position_embeddings")
    if factor is None or original is None:
        problems.append("yarn rope scaling without factor or original_max_position_embeddings")
        return {}
    if factor < 1.0:
        problems.append(f"yarn factor={factor} (below 1 it shortens wavelengths; megalite's YaRN needs >= 1)")
        return {}
    if rope.get("truncate", True) is False:
        problems.append("yarn truncate=False (megalite rounds the blend's bounds outwards to whole dims, as "
                        "DeepSeek-V3 does)")
    all_dim = float(rope.get("mscale_all_dim") or 0.0)  # Hugging Face scales the softmax only when it is non-zero
    given = float(rope["mscale"]) if rope.get("mscale") and all_dim else 1.0
    mscale = _yarn_mscale_for(hf_yarn_attention_factor(rope, factor), factor, all_dim, given, problems)
    return dict(yarn_factor=float(factor), yarn_original_max_position_embeddings=int(original),
                yarn_beta_fast=float(rope.get("beta_fast") or 32.0), yarn_beta_slow=float(rope.get("beta_slow") or 1.0),
                yarn_mscale=mscale, yarn_mscale_all_dim=all_dim)


def _rope_fields(cfg, problems: list[str]) -> dict:
    rope = llama.rope_parameters(cfg)
    fields = {"rotary_base": float(rope["rope_theta"])}
    if rope["rope_type"] == "yarn":
        fields.update(_yarn_fields(rope, problems))
    elif rope["rope_type"] != "default":
        problems.append(f"rope_type {rope['rope_type']!r} (megalite converts DeepSeek-V3's default and yarn RoPE)")
    partial = rope.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        problems.append(f"partial_rotary_factor={partial} (DeepSeek-V3 rotates all qk_rope_head_dim dims)")
    return fields


def hf_rope_parameters(c) -> dict:
    """Hugging Face's rope_parameters of a megalite config (default or yarn)."""
    rope = {"rope_type": "default", "rope_theta": c.rotary_base}
    if c.yarn_factor is None:
        return rope
    rope.update(rope_type="yarn", factor=c.yarn_factor,
                original_max_position_embeddings=c.yarn_original_max_position_embeddings, beta_fast=c.yarn_beta_fast,
                beta_slow=c.yarn_beta_slow, mscale=c.yarn_mscale, mscale_all_dim=c.yarn_mscale_all_dim)
    ours = yarn_attention_factor(c)
    if not math.isclose(hf_yarn_attention_factor(rope, c.yarn_factor), ours, rel_tol=1e-12):
        rope["attention_factor"] = ours  # e.g. an mscale without mscale_all_dim, which Hugging Face ignores
    return rope


# ---------------------------------------------------------------------------------------------
# Import

def owns_model(model) -> bool:
    return type(model).__name__ in ARCHITECTURES


def hf_class(cfg):
    archs = list(getattr(cfg, "architectures", None) or [])
    return getattr(transformers(), archs[0] if archs else DEEPSEEK_V3)


def _attention_fields(cfg, problems: list[str]) -> dict:
    heads, hidden = cfg.num_attention_heads, cfg.hidden_size
    if hidden % heads:
        problems.append(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} (megalite's "
                        f"config needs it, with MLA too)")
    if getattr(cfg, "attention_bias", False):
        problems.append("attention_bias=True (biases on q_a_proj, kv_a_proj_with_mqa and o_proj; megalite's MLA "
                        "has none)")
    return dict(num_attention_heads=heads, multi_latent_attention=True, q_lora_rank=cfg.q_lora_rank,
                kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_nope_head_dim,
                qk_pos_emb_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, add_bias_linear=False,
                attention_dropout=float(getattr(cfg, "attention_dropout", 0.0) or 0.0))


def _group_fields(cfg, problems: list[str]) -> dict:
    """Group-limited routing. Hugging Face scores a group by the sum of its 2 best (biased) scores,
    megalite by its best topk / group_topk: the same when topk = 2 x group_topk (DeepSeek-V3: 8, 4)."""
    groups, chosen, k = cfg.n_group or 1, cfg.topk_group or 1, cfg.num_experts_per_tok
    if groups <= 1 or chosen >= groups:  # every group stays in: plain top-k
        return {}
    if k != 2 * chosen:
        problems.append(f"n_group={groups}, topk_group={chosen} with num_experts_per_tok={k} (Hugging Face scores a "
                        f"group by its 2 best experts, megalite by its num_experts_per_tok / topk_group best: they "
                        f"agree only when num_experts_per_tok = 2 x topk_group)")
        return {}
    return dict(moe_router_num_groups=groups, moe_router_group_topk=chosen)


def _moe_fields(cfg, problems: list[str]) -> dict:
    """The MLP widths and, when some layer has experts, the MoE fields."""
    layers, dense = cfg.num_hidden_layers, min(cfg.first_k_dense_replace or 0, cfg.num_hidden_layers)
    fields = dict(ffn_hidden_size=cfg.intermediate_size)
    if dense == layers:  # no MoE layer: a dense model with MLA
        return fields
    k, width = cfg.num_experts_per_tok, cfg.moe_intermediate_size
    # megalite's sigmoid router renormalises its top-k weights whenever k > 1 (router.route).
    if bool(cfg.norm_topk_prob) != (k > 1):
        problems.append(f"norm_topk_prob={cfg.norm_topk_prob} with num_experts_per_tok={k} (megalite's sigmoid "
                        f"router divides the top-k scores by their sum exactly when k > 1)")
    scaling = float(cfg.routed_scaling_factor)
    fields.update(num_moe_experts=cfg.n_routed_experts, moe_router_topk=k, moe_ffn_hidden_size=width,
                  moe_layer_freq=[0] * dense + [1] * (layers - dense), moe_router_score_function="sigmoid",
                  moe_router_enable_expert_bias=True, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                  moe_router_topk_scaling_factor=scaling if scaling != 1.0 else None,
                  moe_shared_expert_intermediate_size=(cfg.n_shared_experts or 0) * width or None,
                  **_group_fields(cfg, problems))
    return fields


def config_fields(cfg) -> tuple[dict, list[str]]:
    """(TransformerConfig fields but params_dtype, problems) of a DeepseekV3Config."""
    problems = []
    if cfg.hidden_act != "silu":
        problems.append(f"hidden_act={cfg.hidden_act!r} (megalite's gated MLP is SwiGLU: silu)")
    fields = dict(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                  max_position_embeddings=cfg.max_position_embeddings, hidden_dropout=0.0,
                  layernorm_epsilon=cfg.rms_norm_eps, init_method_std=cfg.initializer_range, layernorm_position="pre",
                  normalization="rmsnorm", activation="silu", gated_linear_unit=True, causal=True,
                  position_embedding_type="rope",
                  untie_embeddings_and_output_weights=not getattr(cfg, "tie_word_embeddings", False))
    fields.update(_attention_fields(cfg, problems))
    fields.update(_rope_fields(cfg, problems))
    fields.update(_moe_fields(cfg, problems))
    if cfg.rms_norm_eps != LATENT_NORM_EPS:
        warnings.warn(f"{DEEPSEEK_V3} normalizes its query and key/value latents with epsilon {LATENT_NORM_EPS} "
                      f"whatever rms_norm_eps ({cfg.rms_norm_eps}) is; megalite uses rms_norm_eps for every norm: "
                      f"the latent norms differ by about |difference| / 2 of their mean square (relative)",
                      ConversionNote, stacklevel=3)
    return fields, problems


def config_problems(cfg) -> list[str]:
    return config_fields(cfg)[1]


def _layer_of(name: str) -> int | None:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def stored_problems(directory, cfg) -> list[str]:
    """moe.file_problems of a save_pretrained directory ([] without weight files). Multi-token
    prediction layers (`model.layers.{num_hidden_layers}...`, which transformers' DeepseekV3ForCausalLM
    does not load either) are left out, with a note."""
    stored = set(stored_tensor_names(directory))
    if not stored:
        return []
    fields, _ = config_fields(cfg)
    config = TransformerConfig(**fields)
    mtp = {n for n in stored if (_layer_of(n) or 0) >= config.num_layers}
    if mtp:
        layers = sorted({_layer_of(n) for n in mtp})
        warnings.warn(f"the weight files hold {len(layers)} multi-token prediction layer(s) (model.layers."
                      f"{', '.join(map(str, layers))}; num_nextn_predict_layers="
                      f"{getattr(cfg, 'num_nextn_predict_layers', '?')}): they are not imported yet (transformers' "
                      f"{DEEPSEEK_V3} drops them too); the model predicts the next token only",
                      ConversionNote, stacklevel=3)
    rows = table(shape_of(config))
    if not config.moe_shared_expert_intermediate_size:  # n_shared_experts=0: zero-width tensors, nothing to read
        stored = {n for n in stored if ".mlp.shared_experts." not in n}
    return moe.file_problems(stored - mtp, rows, DEEPSEEK_V3, config)


def from_hf(model) -> tuple[TransformerConfig, dict[str, torch.Tensor]]:
    fields, problems = config_fields(model.config)
    theirs = dict(model.state_dict())
    refuse(DEEPSEEK_V3, problems + moe.unfused_expert_problems(theirs) + llama.tied_head_problems(theirs, fields))
    config = TransformerConfig(**fields, params_dtype=theirs["model.embed_tokens.weight"].dtype)
    padded = pad_vocab_size(config.vocab_size, 1, config.make_vocab_size_divisible_by)
    return config, tensors_from_hf(theirs, config, padded, bool(getattr(model.config, "rope_interleave", True)))


# ---------------------------------------------------------------------------------------------
# Export

def _dense_first(c) -> int:
    """first_k_dense_replace: the dense layers before the first MoE one (all, without experts)."""
    return list(c.moe_layer_freq).index(1) if c.is_moe and any(c.moe_layer_freq) else c.num_layers


def export_problems(c) -> list[str]:
    """What DeepseekV3ForCausalLM cannot hold of a megalite config."""
    wanted = {"multi_latent_attention": True, "normalization": "rmsnorm", "gated_linear_unit": True,
              "activation": "silu", "layernorm_position": "pre", "causal": True, "add_bias_linear": False,
              "rope_scaling_factor": None}
    if c.is_moe:
        wanted.update(moe_router_score_function="sigmoid", moe_shared_expert_gate=False)
    problems = [f"{DEEPSEEK_V3} needs {name}={value!r} (config: {getattr(c, name, None)!r})"
                for name, value in wanted.items() if getattr(c, name, None) != value]
    if not c.is_moe:
        return problems
    freq, dense = list(c.moe_layer_freq), _dense_first(c)
    if freq != [0] * dense + [1] * (len(freq) - dense):
        problems.append(f"{DEEPSEEK_V3} has its dense layers first (first_k_dense_replace): moe_layer_freq {freq} "
                        f"has a dense layer after a MoE one")
    shared, width = c.moe_shared_expert_intermediate_size or 0, c.moe_ffn_hidden_size
    if shared % width:
        problems.append(f"moe_shared_expert_intermediate_size={shared} is not a multiple of moe_ffn_hidden_size="
                        f"{width} ({DEEPSEEK_V3}'s shared experts are n_shared_experts x moe_intermediate_size wide)")
    groups, chosen, k = c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk
    if groups and chosen < groups and k != 2 * chosen:
        problems.append(f"moe_router_topk={k} with moe_router_group_topk={chosen} ({DEEPSEEK_V3} scores a group by "
                        f"its 2 best experts, megalite by its topk / group_topk = {k // chosen} best)")
    return problems


def hf_config(c):
    kwargs = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_attention_heads,  # MLA's keys are per head
        hidden_act="silu", max_position_embeddings=c.max_position_embeddings, initializer_range=c.init_method_std,
        rms_norm_eps=c.layernorm_epsilon, attention_dropout=c.attention_dropout, attention_bias=False,
        tie_word_embeddings=not c.untie_embeddings_and_output_weights, q_lora_rank=c.q_lora_rank,
        kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_head_dim, qk_rope_head_dim=c.qk_pos_emb_head_dim,
        v_head_dim=c.v_head_dim, rope_parameters=hf_rope_parameters(c), rope_interleave=True,
        first_k_dense_replace=_dense_first(c), num_mtp_layers=0,  # megalite's export holds no MTP layers
        bos_token_id=None, eos_token_id=None, pad_token_id=None,  # megalite's config holds no token ids
    )
    if c.is_moe:
        k, width = c.moe_router_topk, c.moe_ffn_hidden_size
        kwargs.update(n_routed_experts=c.num_moe_experts, num_experts_per_tok=k, moe_intermediate_size=width,
                      n_shared_experts=(c.moe_shared_expert_intermediate_size or 0) // width,
                      routed_scaling_factor=float(c.moe_router_topk_scaling_factor or 1.0), norm_topk_prob=k > 1,
                      n_group=c.moe_router_num_groups or 1, topk_group=c.moe_router_group_topk or 1)
    return transformers().DeepseekV3Config(**kwargs)


def _fill_what_megalite_lacks(theirs: dict[str, torch.Tensor], c, model) -> None:
    """Zero correction biases for a router without expert biases (selection by the scores alone),
    and the zero-width shared experts of n_shared_experts=0, which have no elements to copy."""
    for i, has_experts in enumerate(shape_of(c).moe_layers):
        name = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        if has_experts and name not in theirs:
            theirs[name] = torch.zeros(c.num_moe_experts, dtype=torch.float32)
    theirs.update({n: t for n, t in model.state_dict().items() if n not in theirs and t.numel() == 0})


def to_hf(config: TransformerConfig, state_dict: Mapping[str, torch.Tensor], architecture: str | None = None):
    """DeepseekV3ForCausalLM in eval mode holding a megalite MLA GPT's weights (routers in fp32, as
    transformers keeps them)."""
    refuse("this megalite GPT", export_problems(config)
           + table_problems(state_dict, table(shape_of(config)), config.vocab_size), to=f"Hugging Face {DEEPSEEK_V3}")
    theirs = tensors_to_hf(state_dict, config)
    if not config.untie_embeddings_and_output_weights:
        theirs["lm_head.weight"] = theirs["model.embed_tokens.weight"]
    model = transformers().DeepseekV3ForCausalLM(hf_config(config)).to(state_dict["word_embeddings.weight"].dtype)
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.float()
    _fill_what_megalite_lacks(theirs, config, model)
    return load_into(model, theirs)
