"""`--load` without shape flags: the model's shape comes from the checkpoint (Megatron-LM's
--use-checkpoint-args is the explicit form). A shape flag that disagrees is named in one line; the
layout, intervals and paths just change. The checkpoint's configuration, where it holds one, also
gives the preset and the sequence length."""
from __future__ import annotations

import dataclasses
import json
import os

import torch.distributed as dist

from megalite import checkpoint
from megalite.config import RunConfig, model_config, validate
from megalite.config.rules import MLA_SIZES, MOE_FIELDS, YARN_FIELDS
from megalite.config.stage_split import mtp_layers, split_pipeline_layers, split_rules, virtual_stages
from megalite.models.presets import PRESETS
from megalite.config.fields import section_fields, spec_of
from megalite.config.run import ConfigError, flag_name
from megalite.errors import UsageError
from megalite.models.config import TransformerConfig
from megalite.models.layer_pattern import layer_pattern_fields
from megalite.models.qk_variants import no_rope_pattern
from megalite.models.window import parse_window, window_pattern
from megalite.runtime import env_world, say
from megalite.training import resume_policy as policy

_ROPE = ("rotary_base", "rotary_percent")
_ROPE_SCALING = ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                 "rope_original_max_position_embeddings")


def shape_fields(model: TransformerConfig) -> dict:
    """The model section's shape fields that build `model` (the inverse of config.rules' overrides)."""
    out = dict(num_layers=model.num_layers, hidden_size=model.hidden_size,
               num_attention_heads=model.num_attention_heads, ffn_hidden_size=model.ffn_hidden_size,
               vocab_size=model.vocab_size, make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
               max_position_embeddings=model.max_position_embeddings, normalization=model.normalization,
               position_embedding_type=model.position_embedding_type, num_query_groups=model.num_query_groups,
               group_query_attention=model.num_query_groups is not None, norm_epsilon=model.layernorm_epsilon,
               swiglu=model.gated_linear_unit and model.activation == "silu",
               disable_bias_linear=not model.add_bias_linear,
               add_qkv_bias=model.add_qkv_bias, qk_layernorm=model.qk_layernorm,
               qk_layernorm_full_width=model.qk_layernorm_full_width,
               untie_embeddings_and_output_weights=model.untie_embeddings_and_output_weights,
               apply_layernorm_1p=model.layernorm_zero_centered_gamma, bert_no_binary_head=not model.add_binary_head,
               squared_relu=model.activation == "squared_relu", rotary_interleaved=model.rotary_interleaved,
               qk_l2_norm=model.qk_l2_norm, softmax_type=model.softmax_type,
               quick_geglu=model.gated_linear_unit and model.activation == "quick_gelu",
               glu_linear_offset=model.glu_linear_offset, activation_func_clamp_value=model.activation_func_clamp_value)
    if model.kv_channels is not None and not model.multi_latent_attention:  # heads of their own width (Qwen3's)
        out["kv_channels"] = model.kv_channels
    if not model.gated_linear_unit and model.activation in ("gelu", "gelu_tanh"):  # a gated MLP's silu is swiglu's
        out["openai_gelu"] = model.activation == "gelu_tanh"
    if model.multi_latent_attention:
        out.update(multi_latent_attention=True, **{k: getattr(model, k) for k in MLA_SIZES})
    out.update(layer_pattern_fields(model))
    if model.mtp_num_layers:  # its weight in the loss too, unless a flag retunes it
        out.update(mtp_num_layers=model.mtp_num_layers, mtp_loss_scaling_factor=model.mtp_loss_scaling_factor)
    if model.position_embedding_type == "rope":
        out.update({k: getattr(model, k) for k in _ROPE})
        if model.rope_scaling_factor is not None:
            out.update({k: getattr(model, k) for k in _ROPE_SCALING})
        if model.yarn_factor is not None:
            out.update({k: getattr(model, k) for k in YARN_FIELDS})
        if model.rotary_seq_len_interpolation_factor is not None:
            out["rotary_seq_len_interpolation_factor"] = model.rotary_seq_len_interpolation_factor
    return out


def moe_section(model: TransformerConfig) -> dict:
    """The moe section's fields that build `model`'s experts and router (a checkpoint written without
    a run configuration, e.g. by the Hugging Face import); empty for a dense model."""
    if not model.is_moe:
        return {}
    out = {"num_experts": model.num_moe_experts, **{n: getattr(model, n) for n in MOE_FIELDS}}
    out["moe_layer_freq"] = json.dumps(list(model.moe_layer_freq))  # the flag's text: one 0/1 per layer
    return out


def _shape_flags_given(cfg: RunConfig) -> list[str]:
    return [f.name for f in section_fields(cfg.model) if not spec_of(f).resume and cfg.given(f.name)]


def adopt_checkpoint_shape(cfg: RunConfig) -> RunConfig:
    """`cfg` with the model section of the checkpoint `--load` names, when no shape flag is given (or
    with --use-checkpoint-args), and with what else resume_policy.POLICY takes from it (the experts
    field by field, the learning-rate schedule, the global batch), each change said in one line or
    refused; unchanged when there is no checkpoint (yet)."""
    c = cfg.checkpoint
    if not c.load or not checkpoint.checkpoint_exists(c.load):  # megalite's, or Megatron-LM's torch_dist
        return _uneven_split(_virtual_stages(cfg))
    reader = checkpoint.open_checkpoint(c.load)  # megalite's, or a MegatronCheckpoint
    adoption = policy.Adoption(str(reader.path))
    run_config = reader.metadata.get("run_config", {})
    given = _shape_flags_given(cfg)
    model_said = not given or c.use_checkpoint_args
    adopted = _adopt_model(cfg, reader, given, adoption) if model_said else cfg
    saved_moe = run_config.get("moe", {})
    if not saved_moe.get("num_experts") and reader.config.is_moe:  # an import, or a MoE preset's run
        saved_moe = {**saved_moe, **moe_section(reader.config)}
    adopted = policy.merge_moe(adopted, saved_moe, reader.config, adoption, model_said)
    adopted = policy.adopt_schedule(adopted, run_config, adoption)
    adopted = policy.adopt_kept_and_note(adopted, run_config, adoption)
    adoption.notes.append(policy.old_bert_loss_note(reader.metadata, reader.model_kind, adopted))
    adopted = _uneven_split(_virtual_stages(adopted))
    built = _checked(adopted, adoption)
    if model_said:
        differs = [k for k in checkpoint.SHAPE_FIELDS + checkpoint.LLAMA_SHAPE_FIELDS
                   if getattr(built, k) != getattr(reader.config, k)]
        if differs:
            raise UsageError(f"the model of {reader.path} cannot be described by megalite's flags "
                             f"({', '.join(differs)} differ from its preset): give the model flags (--model and the "
                             f"shape) explicitly")
        why = "--use-checkpoint-args" if c.use_checkpoint_args else "no shape flag given; --use-checkpoint-args says so"
        say(f"megalite: model from {reader.path}: {built.num_layers} layers, hidden {built.hidden_size}, "
            f"{built.num_attention_heads} heads, vocabulary {built.vocab_size}, {built.max_position_embeddings} "
            f"positions ({why})")
    for line in [adoption.line(), *adoption.notes]:
        if line:
            say(line)
    return adopted


def _virtual_stages(cfg: RunConfig) -> RunConfig:
    """--num-layers-per-virtual-pipeline-stage's virtual stages of the model's depth as it now stands (a
    checkpoint's; resolve leaves them to this when the preset's depth cannot take them)."""
    p = cfg.parallel
    if p.num_layers_per_virtual_pipeline_stage is None or cfg.given("vpp"):
        return cfg
    try:
        vpp = virtual_stages(p, cfg.model.num_layers or PRESETS[cfg.model.model]["num_layers"], None)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    return cfg.replace("parallel", vpp=vpp)


def _uneven_split(cfg: RunConfig) -> RunConfig:
    """Megatron-LM's split rule (--pipeline-model-parallel-layout, --decoder-first/last-pipeline-num-layers,
    --account-for-embedding/loss-in-pipeline-split) applied again to the model's depth as it now stands (a
    checkpoint's, taken after the command line was resolved over the preset's)."""
    p = cfg.parallel
    if not split_rules(p):
        return cfg
    try:
        counts = split_pipeline_layers(p, cfg.model.num_layers or PRESETS[cfg.model.model]["num_layers"], p.vpp,
                                       cfg.explicit, mtp=mtp_layers(cfg.model, cfg.model.model))
    except ConfigError as e:
        raise UsageError(str(e)) from None
    return dataclasses.replace(cfg.replace("parallel", pipeline_layers=counts), explicit=cfg.explicit,
                               derived=cfg.derived | {"parallel.pipeline_layers"})


def _adopt_model(cfg: RunConfig, reader, given: list[str], adoption) -> RunConfig:
    """The model section of the checkpoint (a shape flag given with --use-checkpoint-args must agree)."""
    saved = reader.metadata.get("run_config", {}).get("model", {})
    fields = shape_fields(reader.config)
    for name in given:
        if name == "qk_layernorm" and fields.get("qk_l2_norm"):
            continue  # the L2 norm replaced it in the checkpoint's model, as it does given beside it now
        if not _same_flag(name, getattr(cfg.model, name), fields.get(name, getattr(cfg.model, name)),
                          reader.config.num_layers):
            raise UsageError(f"{flag_name(name)} {getattr(cfg.model, name)}: the checkpoint {reader.path} holds "
                             f"{fields[name]}; drop the flag to train the checkpoint's model, or --load another")
    changes = {k: v for k, v in fields.items() if not cfg.given(k)}  # a retuned rope base or epsilon stays
    if not cfg.given("model") and saved.get("model"):
        changes["model"] = saved["model"]
    if not cfg.given("seq_length"):
        changes["seq_length"] = saved.get("seq_length", reader.config.max_position_embeddings)
    if reader.config.position_embedding_type != "learned_absolute" and not cfg.given("max_position_embeddings"):
        # Rotary (or no) positions are no weights: a longer sequence raises them, as without --load.
        seq = changes.get("seq_length", cfg.model.seq_length)
        changes["max_position_embeddings"] = max(reader.config.max_position_embeddings, seq)
    # Said by the "model from" line. Not marked given: a printed configuration writes these values as
    # they differ from the section's defaults (megalite.config.expand).
    adopted = adoption.take(cfg, changes, said_elsewhere=True)
    return dataclasses.replace(adopted, explicit=cfg.explicit, derived=cfg.derived)


def _same_flag(name: str, mine, theirs, num_layers: int) -> bool:
    """A shape flag as given against the checkpoint's value: windows and per-layer patterns by what they
    say (`--no-rope-freq 4` is the checkpoint's "[0,0,0,1]"), the rest as they are."""
    readers = {"window_size": parse_window, "window_attn_skip_freq": lambda v: window_pattern(v, num_layers),
               "no_rope_freq": lambda v: no_rope_pattern(v, num_layers),
               "position_embedding_type": lambda v: "rope" if v == "yarn" else v}  # (yarn: rope with YaRN's factor)
    if name not in readers or mine == theirs:
        return mine == theirs
    try:
        return readers[name](mine) == readers[name](theirs)
    except ValueError:
        return False


def _world_size() -> int | None:
    """The ranks the run will have (--print-config: WORLD_SIZE), for checking taken values early."""
    if dist.is_initialized():
        return dist.get_world_size()
    world = os.environ.get("WORLD_SIZE", str(env_world()[1]))
    return int(world) if world.isdigit() and int(world) >= 1 else None


def _checked(cfg: RunConfig, adoption) -> TransformerConfig:
    """The model `cfg` builds, its layout checked now when values came from the checkpoint, so that an
    error names them as the checkpoint's (not as flags never given)."""
    world = _world_size() if adoption.taken else None
    try:
        built = model_config(cfg)
    except UsageError as e:  # no model: said now, the checkpoint's values named as its
        raise UsageError(policy.with_sources(str(e), adoption)) from None
    try:
        if world is not None:
            validate(cfg, world, built, machine=False)
    except UsageError as e:
        told = policy.with_sources(str(e), adoption)
        if told != str(e):
            raise UsageError(told) from None
        # not about a taken value: the run's own check says it, with the real world
    return built
