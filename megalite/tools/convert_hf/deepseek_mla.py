"""DeepSeek-V3's multi-head latent attention (megalite.models.mla) <-> Hugging Face's: the attention rows,
the rotary rows' order, YaRN, and the attention's config fields.

Attention, Hugging Face's names in brackets: q_down [q_a_proj], q_norm [q_a_layernorm], q_up
[q_b_proj] or q [q_proj] without a q_lora_rank; kv_down [kv_a_proj_with_mqa], kv_norm
[kv_a_layernorm], kv_up [kv_b_proj]; proj [o_proj]. Copied row for row but for the rotary rows:
with `rope_interleave` (true in DeepSeek's checkpoints) Hugging Face's d_r rotary dims rotate in
pairs (0, 1), (2, 3), ..., which it first regroups into rotate-half order (the even dims, then the
odd ones). megalite rotates half, so import reorders the rows that make those dims the same way:
the last d_r of each head's d_n + d_r rows of q_b_proj / q_proj, and the last d_r rows of
kv_a_proj_with_mqa (the shared rotary key). megalite then rotates the very numbers Hugging Face
does: the same scores. Export reorders them back and writes `rope_interleave` true.
"""
from __future__ import annotations

from typing import Mapping

import torch

from megalite.tools.convert_hf import llama
from megalite.tools.convert_hf.common import Row, pairs
from megalite.tools.convert_hf.deepseek_shape import Shape
from megalite.tools.convert_hf.rotary_rows import reorder_head_rows
from megalite.tools.convert_hf.yarn_rope import hf_yarn_parameters, yarn_fields

LATENT_NORM_EPS = 1e-6  # Hugging Face's q_a_layernorm and kv_a_layernorm, whatever rms_norm_eps is


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


# ---------------------------------------------------------------------------------------------
# The rotary rows

def reorder_rotary_rows(tensors: Mapping[str, torch.Tensor], c, order: torch.Tensor) -> dict[str, torch.Tensor]:
    """A copy of megalite-named `tensors` whose query heads' and shared key's rotary rows are taken in
    `order` (rotate_half_order on import, its inverse on export)."""
    d_r, out = c.qk_pos_emb_head_dim, dict(tensors)
    query = "q_up" if c.q_lora_rank is not None else "q"
    layers = [f"layers.{i}." for i in range(c.num_layers)] + [f"mtp.{j}.layer." for j in range(c.mtp_num_layers)]
    for layer in layers:
        attn = f"{layer}attention."
        for name, block in ((query, c.qk_head_dim + d_r), ("kv_down", c.kv_lora_rank + d_r)):  # rotary rows last
            out[f"{attn}{name}.weight"] = reorder_head_rows(tensors[f"{attn}{name}.weight"], block, (block - d_r,), d_r,
                                                            order)
    return out


def rope_fields(cfg, problems: list[str]) -> dict:
    rope = llama.rope_parameters(cfg)
    fields = {"rotary_base": float(rope["rope_theta"])}
    if rope["rope_type"] == "yarn":
        fields.update(yarn_fields(rope, problems))
    elif rope["rope_type"] != "default":
        problems.append(f"rope_type {rope['rope_type']!r} (megalite converts DeepSeek-V3's default and yarn RoPE)")
    partial = rope.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        problems.append(f"partial_rotary_factor={partial} (DeepSeek-V3 rotates all qk_rope_head_dim dims)")
    return fields


def hf_rope_parameters(c) -> dict:
    """Hugging Face's rope_parameters of a megalite config (default or yarn)."""
    return {"rope_type": "default", "rope_theta": c.rotary_base, **hf_yarn_parameters(c)}


def attention_fields(cfg, problems: list[str]) -> dict:
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
