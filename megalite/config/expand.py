"""The preset written out: what a printed configuration (--print-config, the run's .config.toml)
says of the model is the model that trains, not the preset's name beside the sections' defaults.

Every model and MoE field the user did not give takes the value of the model the configuration
builds (`model_config`) and is marked derived, so the file shows it as a comment: read back it
changes nothing (the preset decides it again), and a flag given over the file derives it anew.
Uncommented, each line gives the same model (tests/test_config_truth.py reads every preset back
both ways)."""
from __future__ import annotations

import dataclasses

from megalite.config.rules import _ROPE_FIELDS, MLA_SIZES, MOE_FIELDS, SAME_NAMED, YARN_FIELDS, model_config
from megalite.config.run import RunConfig
from megalite.models.layer_pattern import layer_pattern_fields, pattern_text

# Switches: on in the section when the built model has them.
_SWITCHES = {
    "swiglu": lambda c: c.gated_linear_unit and c.activation == "silu",
    "disable_bias_linear": lambda c: not c.add_bias_linear,
    "add_qkv_bias": lambda c: c.add_qkv_bias,
    "qk_layernorm": lambda c: c.qk_layernorm and not c.multi_latent_attention,
    "qk_layernorm_full_width": lambda c: c.qk_layernorm_full_width,
    "untie_embeddings_and_output_weights": lambda c: c.untie_embeddings_and_output_weights,
    "apply_layernorm_1p": lambda c: c.layernorm_zero_centered_gamma,
    "multi_latent_attention": lambda c: c.multi_latent_attention,
    "squared_relu": lambda c: c.activation == "squared_relu",
    "quick_geglu": lambda c: c.gated_linear_unit and c.activation == "quick_gelu",
    "bert_no_binary_head": lambda c: not c.add_binary_head,
    "rotary_interleaved": lambda c: c.rotary_interleaved,
    "qk_l2_norm": lambda c: c.qk_l2_norm,
}


def _model_fields(built) -> dict:
    fields = {name: getattr(built, name) for name in SAME_NAMED}
    fields["norm_epsilon"] = built.layernorm_epsilon
    fields.update({name: bool(on(built)) for name, on in _SWITCHES.items()})
    if built.num_query_groups is not None and not built.multi_latent_attention:
        fields.update(group_query_attention=True, num_query_groups=built.num_query_groups)
    if built.position_embedding_type == "rope":
        rope = [n for n in _ROPE_FIELDS if n not in YARN_FIELDS or built.yarn_factor is not None]
        fields.update({n: getattr(built, n) for n in rope})
    if built.multi_latent_attention:
        fields.update({n: getattr(built, n) for n in MLA_SIZES})
    if built.mtp_num_layers:
        fields.update(mtp_num_layers=built.mtp_num_layers, mtp_loss_scaling_factor=built.mtp_loss_scaling_factor)
    fields.update(layer_pattern_fields(built))
    fields.update(softmax_type=built.softmax_type, glu_linear_offset=built.glu_linear_offset,
                  activation_func_clamp_value=built.activation_func_clamp_value)
    return fields


def _moe_fields(built) -> dict:
    if not built.is_moe:
        return {}
    fields = {"num_experts": built.num_moe_experts, **{n: getattr(built, n) for n in MOE_FIELDS}}
    fields["moe_layer_freq"] = pattern_text(built.moe_layer_freq)
    return fields


def expanded(config: RunConfig) -> RunConfig:
    """`config` with every model and MoE field it leaves to the preset (not given, still the section's
    default) set to the built model's value and marked derived."""
    built = model_config(config)
    derived = set(config.derived)
    changes = {}
    # A dense model's MoE fields mean nothing: comments too (read back as given, they would be refused).
    moe = _moe_fields(built) or dataclasses.asdict(config.moe)
    for section, fields in (("model", _model_fields(built)), ("moe", moe)):
        current = getattr(config, section)
        # Left to the preset: not given and still the section's default (a value adopted from --load's
        # checkpoint stays a value of its own)
        defaults = {f.name: f.default for f in dataclasses.fields(current)}
        chosen = {k: v for k, v in fields.items() if k in defaults and not config.given(k) and v is not None
                  and getattr(current, k) == defaults[k]}
        changes[section] = dataclasses.replace(current, **chosen)
        derived |= {f"{section}.{k}" for k in chosen}
    return dataclasses.replace(config, **changes, derived=frozenset(derived))
