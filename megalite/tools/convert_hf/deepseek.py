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

Multi-token prediction: DeepSeek's files hold depth k's module as decoder layer num_hidden_layers + k - 1
(num_nextn_predict_layers of them) with `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` (megalite's
`mtp.{k-1}.final_layernorm`) and copies of the head and embedding (`shared_head.head`, `embed_tokens`),
which megalite shares and import checks. transformers' DeepseekV3ForCausalLM does not load them, so
import reads them from the directory the model came from (its layer through the main layers' rows, the
rotary rows reordered alike); export appends them to DeepseekV3Model.layers, which runs only the first
num_hidden_layers, so that save_pretrained writes them as DeepSeek's files hold them.
"""
from __future__ import annotations

import copy
import json
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from megalite.models.config import TransformerConfig
from megalite.models.rope import yarn_attention_factor, yarn_mscale
from megalite.parallel.layers import pad_vocab_size
from megalite.tools.convert_hf import llama, moe
from megalite.tools.convert_hf.common import (ConversionNote, Row, export_tensors, import_tensors, load_into, own,
                                              pairs, refuse, stored_tensor_names, table_problems, transformers)

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
    mtp_layers: int = 0  # multi-token prediction's depths: Hugging Face's layers num_layers, num_layers + 1, ...


def shape_of(c) -> Shape:
    moe_layers = tuple(c.moe_layer_freq) if c.is_moe else (0,) * c.num_layers
    return Shape(c.num_layers, c.q_lora_rank is not None, moe_layers, c.is_moe and c.moe_router_enable_expert_bias,
                 bool(c.moe_shared_expert_intermediate_size), c.untie_embeddings_and_output_weights,
                 c.mtp_num_layers)


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


def layer_rows(s: Shape, i: int, has_experts: bool) -> list[Row]:
    """Decoder layer i: its attention and its MoE or dense MLP."""
    mlp = (moe_mlp_rows(s, i) if has_experts
           else llama.dense_mlp_rows(_llama_shape(s), f"layers.{i}.mlp.", f"model.layers.{i}.mlp."))
    return attention_rows(s, i) + mlp


def mtp_rows(s: Shape, j: int) -> list[Row]:
    """Multi-token prediction's depth j + 1: megalite's `mtp.{j}`, DeepSeek's decoder layer num_layers + j
    with enorm, hnorm, eh_proj and shared_head.norm beside it (the layer MoE when the last main one is)."""
    i = s.num_layers + j
    ours, theirs, main = f"mtp.{j}.", f"model.layers.{i}.", f"layers.{i}."
    rows = pairs([(f"{ours}{name}", f"{theirs}{name}") for name in ("enorm", "hnorm", "eh_proj")], ("weight",))
    rows += [(f"{ours}layer.{a[len(main):]}", b, how) for a, b, how in layer_rows(s, i, bool(s.moe_layers[-1]))]
    return rows + [(f"{ours}final_layernorm.weight", f"{theirs}shared_head.norm.weight", "same")]


def table(s: Shape) -> list[Row]:
    """Rows in the order of GPTModel.state_dict(); HF names are the in-memory DeepseekV3ForCausalLM's
    (the MTP layers' are those of DeepSeek's files, experts fused: `mtp_tensors` reads them)."""
    rows = llama.embedding_rows(_llama_shape(s))
    for i, has_experts in enumerate(s.moe_layers):
        rows += layer_rows(s, i, bool(has_experts))
    rows.append(llama.FINAL_NORM_ROW)
    for j in range(s.mtp_layers):
        rows += mtp_rows(s, j)
    return rows


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
    layers = [f"layers.{i}." for i in range(c.num_layers)] + [f"mtp.{j}.layer." for j in range(c.mtp_num_layers)]
    for layer in layers:
        attn = f"{layer}attention."
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
    """moe.file_problems of a save_pretrained directory ([] without weight files), its multi-token
    prediction layers included (`model.layers.{num_hidden_layers + j}`, which transformers'
    DeepseekV3ForCausalLM does not load): none, or as many as num_nextn_predict_layers, each whole (their
    copies of lm_head and embed_tokens may be left out)."""
    stored = set(stored_tensor_names(directory))
    if not stored:
        return []
    fields, _ = config_fields(cfg)
    layers = mtp_layers_in(stored, cfg.num_hidden_layers)
    problems = mtp_count_problems(layers, cfg)
    if problems:  # said once: the main layers are still checked
        stored = {n for n in stored if (_layer_of(n) or 0) < cfg.num_hidden_layers}
    config = TransformerConfig(**fields, mtp_num_layers=0 if problems else len(layers))
    stored -= {f"model.layers.{i}.{leaf}" for i in layers for leaf in MTP_COPIES}
    rows = table(shape_of(config))
    if not config.moe_shared_expert_intermediate_size:  # n_shared_experts=0: zero-width tensors, nothing to read
        stored = {n for n in stored if ".mlp.shared_experts." not in n}
    problems += moe.file_problems(stored, rows, DEEPSEEK_V3, config)
    if problems or not layers:
        return problems
    return differing_copies(layers, lambda name: _read_stored(directory, [name]).get(name))  # before loading the rest


# ---------------------------------------------------------------------------------------------
# Multi-token prediction: DeepSeek's layers num_hidden_layers, num_hidden_layers + 1, ...

# Beside each MTP layer DeepSeek's files hold copies of the output head and the embedding, which
# megalite's MTP modules share with the main model.
MTP_COPIES = {"shared_head.head.weight": "lm_head.weight", "embed_tokens.weight": "model.embed_tokens.weight"}


def nextn(cfg) -> int:
    """num_nextn_predict_layers (transformers' num_mtp_layers)."""
    return int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)


def mtp_layers_in(names, num_layers: int) -> list[int]:
    """The layer numbers from num_layers on (multi-token prediction's) of tensor `names`."""
    return sorted({i for i in map(_layer_of, names) if i is not None and i >= num_layers})


def mtp_count_problems(layers: list[int], cfg) -> list[str]:
    """The MTP layers weights hold against num_nextn_predict_layers' (holding none is a note, not a problem)."""
    n, depth = cfg.num_hidden_layers, nextn(cfg)
    if not layers or layers == list(range(n, n + depth)):
        return []
    held = ", ".join(f"model.layers.{i}" for i in layers)
    wanted = ", ".join(f"model.layers.{i}" for i in range(n, n + depth)) or "none"
    return [f"the weights hold multi-token prediction layer(s) {held} but num_hidden_layers={n} and "
            f"num_nextn_predict_layers={depth} call for {wanted} (use the config saved with these weights)"]


def differing_copies(layers: list[int], get) -> list[str]:
    """The MTP layers' copies of the output head and embedding that are not the main model's (`get(name)`:
    a tensor, or None when absent; a tied model's lm_head is its embedding)."""
    problems = []
    for i in layers:
        for leaf, main in MTP_COPIES.items():
            held = get(f"model.layers.{i}.{leaf}")
            if held is None:
                continue
            shared = get(main)
            shared = get("model.embed_tokens.weight") if shared is None else shared
            if not torch.equal(held.to(shared.dtype), shared):
                problems.append(f"model.layers.{i}.{leaf} differs from {main} (megalite's multi-token prediction "
                                f"shares the output head and the embedding with the main model)")
    return problems


def _read_stored(directory, names) -> dict[str, torch.Tensor]:
    """Tensors `names` of a save_pretrained directory's weight files (safetensors or pytorch_model.bin,
    sharded or not; the order stored_tensor_names reads them in)."""
    path, wanted = Path(directory), set(names)
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / index).is_file():
            weight_map = json.loads((path / index).read_text())["weight_map"]
            files = [path / f for f in sorted({weight_map[n] for n in wanted if n in weight_map})]
            break
    out = {}
    for file in files:
        if file.suffix == ".safetensors":
            from safetensors import safe_open  # installed with transformers

            with safe_open(str(file), framework="pt") as f:
                out.update({n: f.get_tensor(n) for n in wanted & set(f.keys())})
        else:
            tensors = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            out.update({n: tensors[n] for n in wanted & set(tensors)})
    return out


def _mtp_from_files(directory, cfg, depth: int) -> dict[str, torch.Tensor]:
    """The MTP layers' tensors in a directory's files, as the table names them (experts fused as
    transformers holds them: [E, 2I, H] gate_up_proj, [E, H, I] down_proj)."""
    config = TransformerConfig(**config_fields(cfg)[0], mtp_num_layers=depth)
    s, stored = shape_of(config), set(stored_tensor_names(directory))
    names = [n for j in range(depth) for _, theirs, _ in mtp_rows(s, j)
             for n in (theirs if isinstance(theirs, tuple) else (theirs,))]
    parts = {n: [n] if n in stored else moe.stored_names(n, DEEPSEEK_V3, config.num_moe_experts or 0) for n in names}
    read, out = _read_stored(directory, [p for ps in parts.values() for p in ps]), {}
    for name, ps in parts.items():
        if ps == [name]:
            out[name] = read[name]
        else:  # one tensor per expert: each expert's parts (gate, up / down) joined, the experts stacked
            k = len(ps) // config.num_moe_experts
            out[name] = torch.stack([torch.cat([read[p] for p in ps[e * k:(e + 1) * k]])
                                     for e in range(config.num_moe_experts)])
    return out


def _main_dtype(name: str, theirs: Mapping[str, torch.Tensor], n: int) -> torch.dtype:
    """The dtype of the last main layer's tensor of the same name (the routers' fp32 biases), else the
    embedding's."""
    twin = re.sub(r"^model\.layers\.\d+\.", f"model.layers.{n - 1}.", name)
    return theirs[twin].dtype if twin in theirs else theirs["model.embed_tokens.weight"].dtype


def mtp_tensors(model, theirs: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """({name: tensor} of the multi-token prediction layers, problems). From `theirs` (model's state
    dict) when the model holds them (as megalite's export does), else from the files of the directory
    it was loaded from (transformers does not load them), in the dtype the model gives the main layers'
    tensors. None held: {} and, when num_nextn_predict_layers calls for some, a note."""
    cfg, n = model.config, model.config.num_hidden_layers
    mtp = {k: v for k, v in theirs.items() if (_layer_of(k) or 0) >= n}
    directory = str(getattr(model, "name_or_path", "") or "")
    from_files = not mtp and bool(directory) and Path(directory).is_dir()
    if from_files:
        problems = stored_problems(directory, cfg)  # the copies of the head and embedding too
        if problems:
            return {}, problems
        depth = len(mtp_layers_in(stored_tensor_names(directory), n))
        mtp = {k: v.to(_main_dtype(k, theirs, n)) for k, v in _mtp_from_files(directory, cfg, depth).items()}
    layers = mtp_layers_in(mtp, n)
    if not layers:
        if nextn(cfg):
            where = "the weight files hold" if from_files else "the model holds"
            warnings.warn(f"num_nextn_predict_layers={nextn(cfg)} but {where} no multi-token prediction layer "
                          f"(model.layers.{n}...): imported without them (mtp_num_layers 0)",
                          ConversionNote, stacklevel=3)
        return {}, []
    if from_files:
        return mtp, []
    return mtp, mtp_count_problems(layers, cfg) + differing_copies(layers, {**theirs, **mtp}.get)


def from_hf(model) -> tuple[TransformerConfig, dict[str, torch.Tensor]]:
    fields, problems = config_fields(model.config)
    theirs = dict(model.state_dict())
    mtp, mtp_problems = mtp_tensors(model, theirs)
    refuse(DEEPSEEK_V3, problems + mtp_problems + moe.unfused_expert_problems(theirs)
           + llama.tied_head_problems(theirs, fields))
    config = TransformerConfig(**fields, mtp_num_layers=len(mtp_layers_in(mtp, model.config.num_hidden_layers)),
                               params_dtype=theirs["model.embed_tokens.weight"].dtype)
    padded = pad_vocab_size(config.vocab_size, 1, config.make_vocab_size_divisible_by)
    return config, tensors_from_hf({**theirs, **mtp}, config, padded,
                                   bool(getattr(model.config, "rope_interleave", True)))


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
        first_k_dense_replace=_dense_first(c), num_nextn_predict_layers=c.mtp_num_layers,
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
    moe_layers = shape_of(c).moe_layers
    for i, has_experts in enumerate(moe_layers + moe_layers[-1:] * c.mtp_num_layers):
        name = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        if has_experts and name not in theirs:
            theirs[name] = torch.zeros(c.num_moe_experts, dtype=torch.float32)
    theirs.update({n: t for n, t in model.state_dict().items() if n not in theirs and t.numel() == 0})


def mtp_module(cfg, i: int, has_experts: bool) -> nn.Module:
    """DeepSeek's MTP layer i (num_hidden_layers + j) as its files hold it: a DeepseekV3DecoderLayer
    with enorm, hnorm, eh_proj, shared_head (norm, head) and embed_tokens beside it. Appended to
    DeepseekV3Model.layers, which runs its first num_hidden_layers only, save_pretrained writes it and
    the logits stay the main model's."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    cfg = copy.deepcopy(cfg)
    cfg.first_k_dense_replace = 0 if has_experts else i + 1  # the MLP's kind: the last main layer's
    layer = hf.DeepseekV3DecoderLayer(cfg, layer_idx=i)
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    layer.enorm, layer.hnorm = hf.DeepseekV3RMSNorm(h, eps), hf.DeepseekV3RMSNorm(h, eps)
    layer.eh_proj = nn.Linear(2 * h, h, bias=False)
    layer.shared_head = nn.Module()
    layer.shared_head.norm = hf.DeepseekV3RMSNorm(h, eps)
    layer.shared_head.head = nn.Linear(h, cfg.vocab_size, bias=False)
    layer.embed_tokens = nn.Embedding(cfg.vocab_size, h)
    return layer


def to_hf(config: TransformerConfig, state_dict: Mapping[str, torch.Tensor], architecture: str | None = None):
    """DeepseekV3ForCausalLM in eval mode holding a megalite MLA GPT's weights (routers in fp32, as
    transformers keeps them); the multi-token prediction layers appended to model.layers (mtp_module)."""
    refuse("this megalite GPT", export_problems(config)
           + table_problems(state_dict, table(shape_of(config)), config.vocab_size), to=f"Hugging Face {DEEPSEEK_V3}")
    theirs = tensors_to_hf(state_dict, config)
    if not config.untie_embeddings_and_output_weights:
        theirs["lm_head.weight"] = theirs["model.embed_tokens.weight"]
    model = transformers().DeepseekV3ForCausalLM(hf_config(config))
    for j in range(config.mtp_num_layers):
        i = config.num_layers + j
        model.model.layers.append(mtp_module(model.config, i, bool(shape_of(config).moe_layers[-1])))
        theirs.update({f"model.layers.{i}.{leaf}": own(theirs[main]) for leaf, main in MTP_COPIES.items()})
    model = model.to(state_dict["word_embeddings.weight"].dtype)
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.float()
    _fill_what_megalite_lacks(theirs, config, model)
    return load_into(model, theirs)
