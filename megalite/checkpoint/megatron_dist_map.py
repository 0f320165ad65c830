"""What a Megatron-LM checkpoint means in megalite's terms: its saved `args` as megalite's
configuration (through the Megatron-LM flags megalite's command line already reads), and where each
of megalite's layout-free tensors lies in its `torch_dist` files.

megatron-core's dist checkpoint stores every tensor whole (its global shape), whatever the tp/pp/ep
it was saved at: a transformer layer's tensors are stacked on a leading layer axis
(`decoder.layers.self_attention.linear_qkv.weight` is [layers, rows, cols]); a MoE layer's experts
on a further expert axis (`decoder.layers.mlp.experts.experts.linear_fc1.weight` is [layers,
experts, rows, cols]); a gated MLP's linear_fc1 is [gate; up]; the norms before attention and before
the MLP are saved under the linear they feed (`linear_qkv.layer_norm_weight`,
`linear_fc1.layer_norm_weight`) or under their own module's name. The query/key/value rows are
grouped per query group, [q heads of the group, k, v] x head_dim each.

Sources: megatron-core 0.19's `sharded_state_dict` of TransformerBlock, SelfAttention, MLP,
SequentialMLP/TEGroupedMLP and the GPT layer specs' `sharded_state_dict_keys_map` (facts about the
layout, not code), and Megatron-LM's `arguments.py` for the names of `args`' fields.
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from megalite.errors import UsageError
from megalite.models.layer_pattern import pattern_text

# args fields megalite cannot honour: (field, the value megalite needs or a test, what it is)
_UNSUPPORTED = (
    ("multi_latent_attention", False, "multi-latent attention"),
    ("mtp_num_layers", (None, 0), "multi-token prediction"),
    ("moe_shared_expert_intermediate_size", (None, 0), "shared experts"),
    ("heterogeneous_layers_config_path", (None, ""), "heterogeneous layers"),
    ("hybrid_override_pattern", (None, ""), "a hybrid (Mamba) model"),
    ("add_position_embedding", True, "learned positions off without rope"),
)


@dataclasses.dataclass(frozen=True)
class Translation:
    """The flags that describe the checkpoint's model, and what they cannot say."""
    flags: list[str]
    vocab_size: int  # the real vocabulary (args.vocab_size, else the saved padded size)
    padded_vocab_size: int
    notes: list[str]


def _arg(args, name, default=None):
    return getattr(args, name, default)


def _is(value, wanted) -> bool:
    return value in wanted if isinstance(wanted, tuple) else value == wanted


def translate_args(args, where: str) -> Translation:
    """Megatron-LM's `args` (an argparse.Namespace, megatron classes replaced by stand-ins) as the
    command-line flags of megalite that build the same model; a feature megalite lacks is refused
    in one line naming the field."""
    if args is None:
        raise UsageError(f"{where} holds no 'args', which megalite builds the model from: re-save it with "
                         f"Megatron-LM's training script (it stores them in every checkpoint)")
    if not isinstance(args, argparse.Namespace):
        raise UsageError(f"{where}: its 'args' is a {type(args).__name__}, not Megatron-LM's argparse.Namespace: it "
                         f"was not saved by Megatron-LM's training script")
    for name, wanted, what in _UNSUPPORTED:
        value = _arg(args, name, wanted[0] if isinstance(wanted, tuple) else wanted)
        if name == "add_position_embedding" and _arg(args, "position_embedding_type") is not None:
            continue  # superseded by position_embedding_type
        if not _is(value, wanted):
            raise UsageError(f"{where}: args.{name} = {value!r} ({what}): megalite cannot load this Megatron-LM "
                             f"model; convert it another way or train it with Megatron-LM")
    swiglu = bool(_arg(args, "swiglu", False))
    linear_bias = bool(_arg(args, "add_bias_linear", True))
    # Megatron-LM's GeLU: the tanh form with --openai-gelu, and in its fused bias-GeLU (bias_gelu_fusion, on by
    # default, needs biases); the exact (erf) one otherwise (megatron.core.transformer.mlp)
    gelu = not swiglu and not _arg(args, "squared_relu", False) and not _arg(args, "quick_geglu", False)
    tanh_gelu = gelu and bool(_arg(args, "openai_gelu", False) or (_arg(args, "bias_gelu_fusion", True)
                                                                   and linear_bias))
    padded = _arg(args, "padded_vocab_size")
    vocab = _arg(args, "vocab_size") or padded
    if not vocab:
        raise UsageError(f"{where}: args has neither vocab_size nor padded_vocab_size: the vocabulary is unknown")
    heads, hidden = args.num_attention_heads, args.hidden_size
    flags = ["--num-layers", args.num_layers, "--hidden-size", hidden, "--num-attention-heads", heads,
             "--ffn-hidden-size", _arg(args, "ffn_hidden_size") or 4 * hidden,
             "--vocab-size", vocab, "--make-vocab-size-divisible-by", _arg(args, "make_vocab_size_divisible_by", 128),
             "--max-position-embeddings", args.max_position_embeddings,
             "--seq-length", _arg(args, "seq_length") or args.max_position_embeddings,
             "--normalization", _arg(args, "normalization", "LayerNorm"),
             "--norm-epsilon", _arg(args, "norm_epsilon", _arg(args, "layernorm_epsilon", 1e-5))]
    kv = _arg(args, "kv_channels")
    if kv and kv != hidden // heads:
        flags += ["--kv-channels", kv]
    position = _arg(args, "position_embedding_type") or (
        "rope" if _arg(args, "use_rotary_position_embeddings") else "learned_absolute")
    flags += ["--position-embedding-type", position]
    if position == "yarn":  # rope with YaRN's scaling; its fields (a few named without yarn_) as Megatron-LM reads them
        flags += ["--rotary-scaling-factor", _arg(args, "rotary_scaling_factor") or 1.0]
        args = argparse.Namespace(**{**vars(args), "rotary_percent": 1.0})  # its YaRN rotates whole heads
        for name in ("yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow", "mscale",
                     "mscale_all_dim"):
            if _arg(args, name) is not None:
                flags += [f"--{name.replace('_', '-')}", args.__dict__[name]]
        if _arg(args, "yarn_correction_range_round_to_int") is False:
            flags.append("--no-yarn-correction-range-round-to-int")
    if position in ("rope", "yarn"):
        flags += ["--rotary-base", _arg(args, "rotary_base", 10000), "--rotary-percent", _arg(args, "rotary_percent", 1.0)]
        if _arg(args, "use_rope_scaling"):
            flags += ["--use-rope-scaling", "--rope-scaling-factor", _arg(args, "rope_scaling_factor", 8.0)]
        if _arg(args, "rotary_interleaved"):  # (Megatron-LM reads it with rope alone)
            flags.append("--rotary-interleaved")
        if _arg(args, "rotary_seq_len_interpolation_factor"):
            flags += ["--rotary-seq-len-interpolation-factor", args.rotary_seq_len_interpolation_factor]
        if _arg(args, "no_rope_freq"):  # an int, or one 0/1 per layer
            flags += ["--no-rope-freq", pattern_text(args.no_rope_freq)]
    if _arg(args, "group_query_attention"):
        flags += ["--group-query-attention", "--num-query-groups", args.num_query_groups]
    if _arg(args, "window_size"):  # (left, right), and which layers keep it
        flags += ["--window-size", ",".join(map(str, args.window_size))]
        if _arg(args, "window_attn_skip_freq") is not None:
            flags += ["--window-attn-skip-freq", pattern_text(args.window_attn_skip_freq)]
    switches = {"swiglu": "--swiglu", "add_qkv_bias": "--add-qkv-bias", "qk_layernorm": "--qk-layernorm",
                "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
                "apply_layernorm_1p": "--apply-layernorm-1p", "squared_relu": "--squared-relu",
                "qk_l2_norm": "--qk-l2-norm", "quick_geglu": "--quick-geglu"}
    flags += [flag for name, flag in switches.items() if _arg(args, name)]
    if _arg(args, "softmax_type", "vanilla") != "vanilla":  # attention sinks
        flags += ["--softmax-type", args.softmax_type]
    if _arg(args, "glu_linear_offset"):
        flags += ["--glu-linear-offset", args.glu_linear_offset]
    if _arg(args, "activation_func_clamp_value") is not None:
        flags += ["--activation-func-clamp-value", args.activation_func_clamp_value]
    if not linear_bias:
        flags.append("--disable-bias-linear")
    if tanh_gelu:
        flags.append("--openai-gelu")
    flags += _moe_flags(args)
    notes = [] if _arg(args, "vocab_size") else [
        f"args.vocab_size is unset: the vocabulary is taken as the saved {padded} rows (padding included)"]
    if _arg(args, "apply_residual_connection_post_layernorm"):  # a torch_dist checkpoint is Megatron-Core's
        notes.append("args.apply_residual_connection_post_layernorm is set, which no Megatron-Core layer reads: "
                     "the model loads as it trained")
    return Translation([str(f) for f in flags], int(vocab), int(padded or vocab), notes)


_MOE_VALUES = ("moe_router_topk", "moe_ffn_hidden_size", "moe_router_score_function", "moe_router_topk_scaling_factor",
               "moe_router_num_groups", "moe_router_group_topk", "moe_router_load_balancing_type",
               "moe_z_loss_coeff", "moe_router_bias_update_rate", "moe_expert_capacity_factor",
               "moe_token_drop_policy", "moe_input_jitter_eps")
_MOE_SWITCHES = ("moe_router_pre_softmax", "moe_router_enable_expert_bias", "moe_pad_expert_input_to_capacity",
                 "moe_apply_probs_on_input")


def _moe_flags(args) -> list:
    experts = _arg(args, "num_experts")
    if not experts:
        return []
    flags = ["--num-experts", experts]
    for name in _MOE_VALUES:
        value = _arg(args, name)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", value]
    coeff = _arg(args, "moe_aux_loss_coeff")
    if coeff is not None:  # a list (one per balancing type) in newer Megatron-LM
        flags += ["--moe-aux-loss-coeff", coeff[0] if isinstance(coeff, (list, tuple)) else coeff]
    flags += ["--moe-layer-freq", pattern_text(_arg(args, "moe_layer_freq", 1))]
    dispatcher = _arg(args, "moe_token_dispatcher_type")
    if dispatcher in ("alltoall", "allgather"):  # flex and others move tokens as alltoall does: the same numbers
        flags += ["--moe-token-dispatcher-type", dispatcher]
    flags += [f"--{name.replace('_', '-')}" for name in _MOE_SWITCHES if _arg(args, name)]
    return flags


# --- where megalite's tensors lie ------------------------------------------------------------------

# megalite name (after 'layers.L.') -> candidate dist-checkpoint keys (after 'decoder.layers.'), first found wins
LAYER_KEYS = {
    "input_layernorm.weight": ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    "input_layernorm.bias": ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
    "attention.qkv.weight": ("self_attention.linear_qkv.weight",),
    "attention.qkv.bias": ("self_attention.linear_qkv.bias",),
    "attention.q.weight": ("self_attention.linear_qkv.weight",),
    "attention.q.bias": ("self_attention.linear_qkv.bias",),
    "attention.kv.weight": ("self_attention.linear_qkv.weight",),
    "attention.kv.bias": ("self_attention.linear_qkv.bias",),
    "attention.q_norm.weight": ("self_attention.q_layernorm.weight",),
    "attention.k_norm.weight": ("self_attention.k_layernorm.weight",),
    "attention.softmax_offset": ("self_attention.core_attention.softmax_offset",),
    "attention.proj.weight": ("self_attention.linear_proj.weight",),
    "attention.proj.bias": ("self_attention.linear_proj.bias",),
    "post_attention_layernorm.weight": ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    "post_attention_layernorm.bias": ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
    "mlp.fc1.weight": ("mlp.linear_fc1.weight",),
    "mlp.fc1.bias": ("mlp.linear_fc1.bias",),
    "mlp.fc2.weight": ("mlp.linear_fc2.weight",),
    "mlp.fc2.bias": ("mlp.linear_fc2.bias",),
    "mlp.router.weight": ("mlp.router.weight",),
    "mlp.router.bias": ("mlp.router.bias",),
    "mlp.router.expert_bias": ("mlp.router.expert_bias",),
}
TOP_KEYS = {
    "word_embeddings.weight": "embedding.word_embeddings.weight",
    "position_embeddings.weight": "embedding.position_embeddings.weight",
    "output_layer.weight": "output_layer.weight",
    "final_layernorm.weight": "decoder.final_layernorm.weight",
    "final_layernorm.bias": "decoder.final_layernorm.bias",
}
# one expert's weight: the stacked SequentialMLP / TEGroupedMLP layout, or one tensor per expert
EXPERT_KEYS = {"fc1_weight": ("mlp.experts.experts.linear_fc1.weight", "mlp.experts.linear_fc1.weight{e}"),
               "fc2_weight": ("mlp.experts.experts.linear_fc2.weight", "mlp.experts.linear_fc2.weight{e}"),
               "fc1_bias": ("mlp.experts.experts.linear_fc1.bias", "mlp.experts.linear_fc1.bias{e}"),
               "fc2_bias": ("mlp.experts.experts.linear_fc2.bias", "mlp.experts.linear_fc2.bias{e}")}


def qkv_part(t: torch.Tensor, leaf: str, heads: int, groups: int) -> torch.Tensor:
    """megalite's `attention.{qkv,q,kv}` rows from Megatron's linear_qkv rows [group, (q heads of the
    group, k, v), head_dim] (weight [rows, hidden] or bias [rows]). Without grouped-query attention
    megalite's qkv is the same layout with one head per group; with it, q is the heads in order
    and kv [group, (k, v), head_dim]."""
    rest = t.shape[1:]
    per_group = heads // groups
    rows = t.reshape(groups, per_group + 2, -1, *rest)  # [g, q heads + k + v, head_dim, ...]
    if leaf == "qkv":
        return t
    if leaf == "q":
        return rows[:, :per_group].reshape(-1, *rest)
    return rows[:, per_group:].reshape(-1, *rest)  # kv


# --- the configuration and the tensors it implies ----------------------------------------------------

def config_of(translation: Translation, where: str):
    """(TransformerConfig, the run configuration's model and moe sections) of the translated flags,
    parsed by megalite's own command line (its Megatron-LM aliases and rules)."""
    from megalite.config import ConfigError, build_parser, model_config

    parser = build_parser("a Megatron-LM checkpoint's args", "gpt-tiny")
    ns, extras = parser.parse_known_args(translation.flags)
    try:
        if extras:
            raise ConfigError(f"flags megalite does not read: {' '.join(extras)}")
        cfg = parser.configure(ns)
        built = model_config(cfg)
    except (ConfigError, ValueError) as e:
        raise UsageError(f"{where}: its args describe a model megalite cannot build ({e})") from None
    sections = cfg.to_dict()
    # no preset: --load's model is the default preset with the checkpoint's shape (as a Hugging Face import's)
    run_config = {"model": {"seq_length": cfg.model.seq_length},
                  "moe": sections.get("moe", {}) if built.is_moe else {}}
    return built, run_config


def expected_names(c) -> list[str]:
    """Every layout-free tensor of megalite's GPT model `c` (a TransformerConfig)."""
    norm = ("weight", "bias") if c.normalization == "layernorm" else ("weight",)
    linear = ("weight", "bias") if c.add_bias_linear else ("weight",)
    qkv = ("weight", "bias") if c.add_bias_linear or c.add_qkv_bias else ("weight",)
    names = ["word_embeddings.weight"]
    if c.position_embedding_type == "learned_absolute":
        names.append("position_embeddings.weight")
    for i in range(c.num_layers):
        layer = [f"input_layernorm.{p}" for p in norm]
        parts = ("qkv",) if c.num_query_groups is None else ("q", "kv")
        layer += [f"attention.{part}.{p}" for part in parts for p in qkv]
        if c.qk_layernorm:
            layer += ["attention.q_norm.weight", "attention.k_norm.weight"]
        if c.softmax_type == "learnable":
            layer.append("attention.softmax_offset")
        layer += [f"attention.proj.{p}" for p in linear] + [f"post_attention_layernorm.{p}" for p in norm]
        if c.is_moe_layer(i):
            layer += [f"mlp.router.{p}" for p in linear]
            if c.moe_router_enable_expert_bias:
                layer.append("mlp.router.expert_bias")
            layer += [f"mlp.experts.{e}.{fc}_{p}" for e in range(c.num_moe_experts) for fc in ("fc1", "fc2")
                      for p in linear]
        else:
            layer += [f"mlp.{fc}.{p}" for fc in ("fc1", "fc2") for p in linear]
        names += [f"layers.{i}.{n}" for n in layer]
    names += [f"final_layernorm.{p}" for p in norm]
    if c.untie_embeddings_and_output_weights:
        names.append("output_layer.weight")
    return names
