"""DeepseekV3ForCausalLM <-> megalite's GPTModel with multi-head latent attention (megalite.models.mla)
and DeepSeek's mixture of experts.

Attention (deepseek_mla): Hugging Face's q_a_proj, kv_a_proj_with_mqa, ... as megalite's q_down, kv_down,
..., the rotary rows reordered from interleaved to rotate-half, and YaRN. MoE layers (deepseek_moe): the
router with its expert biases, fused experts and shared experts. Multi-token prediction (deepseek_mtp):
DeepSeek's extra decoder layers past num_hidden_layers, read from the files on import and appended to the
model on export. This module holds what builds on all three: the table (the MTP depths' rows included), the
config mapping, the check of a directory's files and reading its MTP layers, and the family's from_hf / to_hf.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Mapping

import torch

from megalite.models.config import TransformerConfig
from megalite.parallel.layers import pad_vocab_size
from megalite.tools.convert_hf import llama, moe
from megalite.tools.convert_hf.common import (ConversionNote, Row, export_tensors, import_tensors, load_into, own,
                                              pairs, refuse, stored_tensor_names, table_problems, transformers)
from megalite.tools.convert_hf.deepseek_mla import (LATENT_NORM_EPS, attention_fields, attention_rows,
                                                    hf_rope_parameters, reorder_rotary_rows, rope_fields)
from megalite.tools.convert_hf.deepseek_moe import (dense_first, export_moe_problems, fill_what_megalite_lacks,
                                                    hf_moe_kwargs, moe_fields, moe_mlp_rows)
from megalite.tools.convert_hf.deepseek_mtp import (MTP_COPIES, differing_copies, layer_of, main_dtype,
                                                    mtp_count_problems, mtp_layers_in, mtp_module, nextn, read_stored)
from megalite.tools.convert_hf.deepseek_shape import DEEPSEEK_V3, Shape, llama_shape, shape_of
from megalite.tools.convert_hf.rotary_rows import rotate_half_order

ARCHITECTURES = (DEEPSEEK_V3,)
MODEL_TYPES = {"deepseek_v3": DEEPSEEK_V3}
GLU = {"glu": 1}  # common.import_tensors' groups: gate and up stacked once


def layer_rows(s: Shape, i: int, has_experts: bool) -> list[Row]:
    """Decoder layer i: its attention and its MoE or dense MLP."""
    mlp = (moe_mlp_rows(s, i) if has_experts
           else llama.dense_mlp_rows(llama_shape(s), f"layers.{i}.mlp.", f"model.layers.{i}.mlp."))
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
    rows = llama.embedding_rows(llama_shape(s))
    for i, has_experts in enumerate(s.moe_layers):
        rows += layer_rows(s, i, bool(has_experts))
    rows.append(llama.FINAL_NORM_ROW)
    for j in range(s.mtp_layers):
        rows += mtp_rows(s, j)
    return rows


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
# Import

def owns_model(model) -> bool:
    return type(model).__name__ in ARCHITECTURES


def hf_class(cfg):
    archs = list(getattr(cfg, "architectures", None) or [])
    return getattr(transformers(), archs[0] if archs else DEEPSEEK_V3)


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
    fields.update(attention_fields(cfg, problems))
    fields.update(rope_fields(cfg, problems))
    fields.update(moe_fields(cfg, problems))
    if cfg.rms_norm_eps != LATENT_NORM_EPS:
        warnings.warn(f"{DEEPSEEK_V3} normalizes its query and key/value latents with epsilon {LATENT_NORM_EPS} "
                      f"whatever rms_norm_eps ({cfg.rms_norm_eps}) is; megalite uses rms_norm_eps for every norm: "
                      f"the latent norms differ by about |difference| / 2 of their mean square (relative)",
                      ConversionNote, stacklevel=3)
    return fields, problems


def config_problems(cfg) -> list[str]:
    return config_fields(cfg)[1]


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
        stored = {n for n in stored if (layer_of(n) or 0) < cfg.num_hidden_layers}
    config = TransformerConfig(**fields, mtp_num_layers=0 if problems else len(layers))
    stored -= {f"model.layers.{i}.{leaf}" for i in layers for leaf in MTP_COPIES}
    rows = table(shape_of(config))
    if not config.moe_shared_expert_intermediate_size:  # n_shared_experts=0: zero-width tensors, nothing to read
        stored = {n for n in stored if ".mlp.shared_experts." not in n}
    problems += moe.file_problems(stored, rows, DEEPSEEK_V3, config) + moe.expert_shape_problems(directory, config)
    if problems or not layers:
        return problems
    return differing_copies(layers, lambda name: read_stored(directory, [name]).get(name))  # before loading the rest


def _mtp_from_files(directory, cfg, depth: int) -> dict[str, torch.Tensor]:
    """The MTP layers' tensors in a directory's files, as the table names them (experts fused as
    transformers holds them: [E, 2I, H] gate_up_proj, [E, H, I] down_proj)."""
    config = TransformerConfig(**config_fields(cfg)[0], mtp_num_layers=depth)
    s, stored = shape_of(config), set(stored_tensor_names(directory))
    names = [n for j in range(depth) for _, theirs, _ in mtp_rows(s, j)
             for n in (theirs if isinstance(theirs, tuple) else (theirs,))]
    parts = {n: [n] if n in stored else moe.stored_names(n, DEEPSEEK_V3, config.num_moe_experts or 0) for n in names}
    read, out = read_stored(directory, [p for ps in parts.values() for p in ps]), {}
    for name, ps in parts.items():
        if ps == [name]:
            out[name] = read[name]
        else:  # one tensor per expert: each expert's parts (gate, up / down) joined, the experts stacked
            k = len(ps) // config.num_moe_experts
            out[name] = torch.stack([torch.cat([read[p] for p in ps[e * k:(e + 1) * k]])
                                     for e in range(config.num_moe_experts)])
    return out


def mtp_tensors(model, theirs: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """({name: tensor} of the multi-token prediction layers, problems). From `theirs` (model's state
    dict) when the model holds them (as megalite's export does), else from the files of the directory
    it was loaded from (transformers does not load them), in the dtype the model gives the main layers'
    tensors. None held: {} and, when num_nextn_predict_layers calls for some, a note."""
    cfg, n = model.config, model.config.num_hidden_layers
    mtp = {k: v for k, v in theirs.items() if (layer_of(k) or 0) >= n}
    directory = str(getattr(model, "name_or_path", "") or "")
    from_files = not mtp and bool(directory) and Path(directory).is_dir()
    if from_files:
        problems = stored_problems(directory, cfg)  # the copies of the head and embedding too
        if problems:
            return {}, problems
        depth = len(mtp_layers_in(stored_tensor_names(directory), n))
        mtp = {k: v.to(main_dtype(k, theirs, n)) for k, v in _mtp_from_files(directory, cfg, depth).items()}
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

def export_problems(c) -> list[str]:
    """What DeepseekV3ForCausalLM cannot hold of a megalite config."""
    wanted = {"multi_latent_attention": True, "normalization": "rmsnorm", "gated_linear_unit": True,
              "activation": "silu", "layernorm_position": "pre", "causal": True, "add_bias_linear": False,
              "rope_scaling_factor": None}
    if c.is_moe:
        wanted.update(moe_router_score_function="sigmoid", moe_shared_expert_gate=False)
    problems = [f"{DEEPSEEK_V3} needs {name}={value!r} (config: {getattr(c, name, None)!r})"
                for name, value in wanted.items() if getattr(c, name, None) != value]
    return problems + export_moe_problems(c)


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
        first_k_dense_replace=dense_first(c), num_nextn_predict_layers=c.mtp_num_layers,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,  # megalite's config holds no token ids
    )
    if c.is_moe:
        kwargs.update(hf_moe_kwargs(c))
    return transformers().DeepseekV3Config(**kwargs)


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
    fill_what_megalite_lacks(theirs, config, model)
    return load_into(model, theirs)
