"""Rules that join sections: the defaults one section takes from another (resolve), the model a
configuration describes (model_config), and the layout checked against the world (validate).
Validation runs before any process group exists, from the world size torchrun announces, so a bad
layout ends every rank at once with the same one-line message."""
from __future__ import annotations

import dataclasses

import torch

from megalite.config.run import ConfigError, RunConfig
from megalite.config.batch_schedule import batch_schedule
from megalite.config.fields import in_user_spelling
from megalite.errors import UsageError
from megalite.models.config import TP_COMM_OVERLAP_NEEDS, TP_COMM_SPLITS_NEEDS, TransformerConfig
from megalite.models.presets import PRESETS, preset
from megalite.config.stage_split import mtp_layers, split_pipeline_layers, virtual_stages
from megalite.pipeline.partition import V_SCHEDULES

DEFAULT_TRAIN_ITERS, DEFAULT_WARMUP_ITERS = 100, 10


def resolve(config: RunConfig, default_model: str | None, explicit=frozenset(), ignored=()) -> RunConfig:
    """The defaults that depend on other fields, filled in once here so nothing later changes the
    configuration. Idempotent: resolving a resolved configuration changes nothing. The fields it fills
    (not given) are recorded as `derived`: a printed configuration writes them as comments, so a flag
    over the file derives them anew."""
    given = frozenset(explicit) | config.explicit
    m, t, o, d, p = config.model, config.training, config.optimizer, config.data_parallel, config.parallel
    name = m.model or default_model
    if name not in PRESETS:
        import difflib
        close = difflib.get_close_matches(str(name), PRESETS, n=1)
        raise ConfigError(f"--model {name}: no such preset{f' (did you mean {close[0]}?)' if close else ''}; "
                          f"presets: {', '.join(sorted(PRESETS))}")
    seq = m.seq_length or m.max_position_embeddings or PRESETS[name].get("max_position_embeddings")
    if d.use_distributed_optimizer and d.zero_stage == 0:  # before the two become one value
        raise ConfigError("--use-distributed-optimizer is ZeRO stage 1: drop --zero-stage 0, or the flag")
    stage = d.zero_stage if d.zero_stage is not None else int(d.use_distributed_optimizer)
    if t.train_samples is not None and "training.train_iters" in given:
        raise ConfigError("--train-iters and --train-samples both give the run's length: keep one")
    t = _with_step_schedule(t, given, seq)
    if t.train_samples is not None:
        iters = batch_schedule(t, seq).steps_for_samples(t.train_samples)
        if iters < 1:
            raise ConfigError(f"--train-samples {t.train_samples} is less than one --global-batch-size "
                              f"({t.global_batch_size})")
    else:
        iters = t.train_iters if t.train_iters is not None else DEFAULT_TRAIN_ITERS
    if t.train_samples is not None and o.lr_decay_iters is None and o.lr_decay_samples is None:
        # Megatron-LM: a run given in samples decays over them (not over the whole steps they make)
        o = dataclasses.replace(o, lr_decay_samples=t.train_samples)
    no_warmup_given = o.lr_warmup_fraction is None and o.lr_warmup_samples is None
    warmup = o.lr_warmup_iters if o.lr_warmup_iters is not None or not no_warmup_given else DEFAULT_WARMUP_ITERS
    # With --load and no --num-layers a split the preset's depth cannot take waits for the checkpoint's
    # (training.checkpoint_shape splits that again once its model is taken).
    defer = "model.num_layers" not in given and bool(config.checkpoint.load)
    vpp = p.vpp if "parallel.vpp" in given or p.num_layers_per_virtual_pipeline_stage is None else None
    try:
        vpp = virtual_stages(p, m.num_layers or PRESETS[name]["num_layers"], vpp, given)
    except ConfigError:
        if not defer or p.num_layers_per_virtual_pipeline_stage is None:
            raise
    if p.pipeline_schedule in V_SCHEDULES and p.pp > 1 and vpp is None:  # two chunks per rank, in a V
        vpp = 2
    p = dataclasses.replace(p, pipeline_layers=split_pipeline_layers(p, m.num_layers or PRESETS[name]["num_layers"],
                                                                     vpp, given, defer, mtp_layers(m, name)))
    if p.sequence_parallel and p.tp == 1:  # as Megatron-LM: nothing to shard over, so off (said in a note)
        p = dataclasses.replace(p, sequence_parallel=False)
        ignored = (*ignored, "--sequence-parallel (with --tp 1)")
    if "data.split" in given and (config.data.train_data_path or config.data.per_split_data_args_path):
        ignored = (*ignored, "--split (each split reads every document of its own data, as Megatron-LM's per-split "
                             "paths do)")
    ckpt = config.checkpoint
    if ckpt.save_interval is not None and not ckpt.save:  # as Megatron-LM: accepted, nothing to save
        ckpt = dataclasses.replace(ckpt, save_interval=None)
        ignored = (*ignored, "--save-interval (without --save nothing is saved)")
    if m.openai_gelu is None and _megatron_shaped(given) and not m.squared_relu and not m.quick_geglu:
        # A model of Megatron-LM's flags: its GeLU, kept as given so a printed file keeps it. Megatron-LM's
        # fused bias-GeLU (on by default, off without biases or with --no-bias-gelu-fusion) computes the
        # tanh form; its unfused MLP calls the exact one.
        tanh = not m.disable_bias_linear and not m.no_bias_gelu_fusion
        m = dataclasses.replace(m, openai_gelu=tanh)
        given = given | {"model.openai_gelu"}
    megatron_backend = _MEGATRON_BACKENDS.get(m.attention_backend)
    if m.attention_backend == "fused" and not _megatron_shaped(given):
        megatron_backend = None  # megalite's own fused: its fused-softmax kernel, as asked
    if megatron_backend is not None:  # Megatron-LM's names for the same attention (to rounding)
        ignored = (*ignored, f"--attention-backend {m.attention_backend} ({_MEGATRON_BACKEND_NOTES[m.attention_backend]}: "
                             f"megalite's {megatron_backend} runs it)")
        m = dataclasses.replace(m, attention_backend=megatron_backend)
    moe = config.moe
    if moe.moe_token_dispatcher_type == "flex":  # the same tokens to the same experts: the same numbers
        moe = dataclasses.replace(moe, moe_token_dispatcher_type="alltoall")
        ignored = (*ignored, "--moe-token-dispatcher-type flex (DeepEP's fused all-to-all: megalite's all-to-all "
                             "moves the same tokens)")
    prec = config.precision
    if prec.fp8_param_gather and stage < 3:  # megalite gathers FP8 weights in ZeRO-3's gathers; numbers alike
        prec = dataclasses.replace(prec, fp8_param_gather=False)
        ignored = (*ignored, "--fp8-param-gather (FP8 weights travel as FP8 in --zero-stage 3's gathers only)")
    if d.overlap_param_gather and stage == 3:  # stage 3 gathers each layer beside the one before, always
        d = dataclasses.replace(d, overlap_param_gather=False)
        ignored = (*ignored, "--overlap-param-gather (--zero-stage 3 gathers each layer beside the layer before "
                             "it, always)")
    resolved = dataclasses.replace(
        config,
        model=dataclasses.replace(m, model=name, seq_length=seq),
        training=dataclasses.replace(t, train_iters=iters),
        optimizer=dataclasses.replace(o, lr_warmup_iters=warmup),
        data_parallel=dataclasses.replace(d, zero_stage=stage, use_distributed_optimizer=stage >= 1,
                                          # stage 3 frees a layer after its forward unless told otherwise
                                          zero_reshard_after_forward=(d.zero_reshard_after_forward if stage != 3 or
                                                                      d.zero_reshard_after_forward is not None
                                                                      else True)),
        parallel=dataclasses.replace(p, vpp=vpp), precision=prec, moe=moe, checkpoint=ckpt,
        explicit=given, ignored_flags=tuple(ignored) or config.ignored_flags)
    before, after = _dotted(config), _dotted(resolved)
    derived = {k for k in after if after[k] != before[k] and k not in given and k != "model.model"}
    return dataclasses.replace(resolved, derived=frozenset(derived) | config.derived)


def _megatron_shaped(given) -> bool:
    """The model is Megatron-LM's flags' (no --model preset, and the sizes Megatron-LM requires given:
    --num-layers, --hidden-size, --num-attention-heads): its MLP's GeLU is then Megatron-LM's default,
    where the presets (and Hugging Face's GPT-2) keep their own."""
    return "model.model" not in given and all(f"model.{k}" in given for k in
                                              ("num_layers", "hidden_size", "num_attention_heads"))


def _with_step_schedule(t, given, seq: int):
    """--step-batch-size-schedule: checked, and --global-batch-size set to its last batch (Megatron-LM
    refuses a --global-batch-size beside it; one that agrees is let through, as a printed file holds it)."""
    if not t.step_batch_size_schedule:
        return t
    if t.rampup_batch_size is not None:
        raise ConfigError("--step-batch-size-schedule and --rampup-batch-size both grow the batch: keep one")
    try:
        last = batch_schedule(t, seq).global_batch_size
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if "training.global_batch_size" in given and t.global_batch_size != last:
        raise ConfigError(f"--global-batch-size {t.global_batch_size} and --step-batch-size-schedule (last batch "
                          f"{last}) both give the batch: drop --global-batch-size")
    return dataclasses.replace(t, global_batch_size=last)


def _dotted(config: RunConfig) -> dict:
    return {f"{name}.{k}": v for name, section in config.sections() for k, v in dataclasses.asdict(section).items()}


def lr_schedule_lengths(config: RunConfig) -> tuple[float, float, float | None]:
    """(warm-up, decay, WSD's final decay) in iterations; sample counts are divided by the global
    batch (not rounded: the schedule is a function of the samples seen, as Megatron-LM's is)."""
    o, gbs = config.optimizer, config.training.global_batch_size
    decay = (o.lr_decay_samples / gbs if o.lr_decay_samples is not None else
             o.lr_decay_iters if o.lr_decay_iters is not None else config.training.train_iters)
    warmup = (o.lr_warmup_fraction * decay if o.lr_warmup_fraction is not None else
              o.lr_warmup_samples / gbs if o.lr_warmup_samples is not None else o.lr_warmup_iters)
    wsd = (o.lr_wsd_decay_samples / gbs if o.lr_wsd_decay_samples is not None else o.lr_wsd_decay_iters)
    return warmup, decay, wsd


def weight_decay_steps(config: RunConfig) -> float:
    """The steps a linear or cosine weight decay ramps over: the run's (--train-samples over the global
    batch), as Megatron-LM's wd_incr_steps."""
    t = config.training
    return t.train_iters if t.train_samples is None else t.train_samples / t.global_batch_size


YARN_FIELDS = ("yarn_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
               "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int")
_ROPE_FIELDS = ("rotary_base", "rotary_percent", "rope_scaling_factor", "rope_low_freq_factor",
                "rope_high_freq_factor", "rope_original_max_position_embeddings", *YARN_FIELDS,
                "rotary_seq_len_interpolation_factor")


# Model-section fields that are TransformerConfig's own under the same name, whatever the model.
SAME_NAMED = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels", "vocab_size",
              "normalization", "position_embedding_type", "max_position_embeddings", "init_method_std",
              "make_vocab_size_divisible_by")


def _model_overrides(m) -> dict:
    """TransformerConfig fields the model section sets; fields left unset set nothing."""
    same = (*SAME_NAMED, "num_query_groups", "mtp_num_layers", "mtp_loss_scaling_factor", "embedding_init_method_std",
            *_ROPE_FIELDS, "window_size", "window_attn_skip_freq", "no_rope_freq", "softmax_type",
            "glu_linear_offset", "activation_func_clamp_value")
    out = {k: getattr(m, k) for k in same if getattr(m, k) is not None}
    if m.norm_epsilon is not None:
        out["layernorm_epsilon"] = m.norm_epsilon
    gated = m.swiglu or m.quick_geglu or PRESETS.get(m.model, {}).get("gated_linear_unit")
    if m.openai_gelu is not None and not gated:
        out["activation"] = "gelu_tanh" if m.openai_gelu else "gelu"  # a gated MLP's silu stays
    if m.no_position_embedding:  # learned positions off; rotary ones (Megatron-LM's scripts pair the two) stay
        chosen = m.position_embedding_type or PRESETS.get(m.model, {}).get("position_embedding_type")
        if chosen in (None, "learned_absolute"):
            out["position_embedding_type"] = "none"
    mla = bool(m.multi_latent_attention or PRESETS.get(m.model, {}).get("multi_latent_attention"))
    if mla:  # MLA's head widths are its own: Megatron-LM's DeepSeek scripts pass a --kv-channels MLA never reads
        out.pop("kv_channels", None)
    out.update(_megatron_rope_scaling(m, mla))
    if m.position_embedding_type == "yarn":  # Megatron-LM's name for rope with YaRN's scaling (factor 1 by default)
        out["position_embedding_type"] = "rope"
        if "yarn_factor" not in out and PRESETS.get(m.model, {}).get("yarn_factor") is None:
            out["yarn_factor"] = 1.0
        if out.get("rotary_percent", 1.0) != 1.0:  # Megatron-Core's YaRN rotates every head dim, whatever the percent
            raise UsageError(f"--position-embedding-type yarn rotates every dim of a head (Megatron-Core's YaRN reads "
                             f"no --rotary-percent): drop --rotary-percent {out['rotary_percent']:g}")
    if m.use_rope_scaling and "rope_scaling_factor" not in out:
        out["rope_scaling_factor"] = 8.0  # Llama 3.1's factor, as Megatron-LM's --use-rope-scaling
    switches = {"swiglu": dict(gated_linear_unit=True, activation="silu"),
                "disable_bias_linear": dict(add_bias_linear=False),
                "add_qkv_bias": dict(add_qkv_bias=True), "qk_layernorm": dict(qk_layernorm=True),
                "qk_layernorm_full_width": dict(qk_layernorm_full_width=True),
                "untie_embeddings_and_output_weights": dict(untie_embeddings_and_output_weights=True),
                "apply_layernorm_1p": dict(layernorm_zero_centered_gamma=True),
                "bert_no_binary_head": dict(add_binary_head=False), "squared_relu": dict(activation="squared_relu"),
                "quick_geglu": dict(gated_linear_unit=True, activation="quick_gelu"),
                "rotary_interleaved": dict(rotary_interleaved=True), "qk_l2_norm": dict(qk_l2_norm=True),
                "init_method_xavier_uniform": dict(init_method_xavier_uniform=True),
                "fp32_residual_connection": dict(fp32_residual_connection=True)}
    if mla:  # Megatron-LM's MLA norms its query and key/value latents only with --qk-layernorm; megalite's always
        switches.pop("qk_layernorm")
    for name, fields in switches.items():
        if getattr(m, name):
            out.update(fields)
    mla_sizes = {k: getattr(m, k) for k in MLA_SIZES if getattr(m, k) is not None}
    if mla_sizes and not (m.multi_latent_attention or PRESETS.get(m.model, {}).get("multi_latent_attention")):
        raise UsageError(f"{', '.join('--' + k.replace('_', '-') for k in mla_sizes)}: for multi-head latent "
                         f"attention only: add --multi-latent-attention, or drop them")
    if m.multi_latent_attention:  # its latent keys replace a preset's grouped ones
        out["multi_latent_attention"] = True
        out.setdefault("num_query_groups", None)
    return {**out, **mla_sizes}


def _megatron_rope_scaling(m, mla: bool) -> dict:
    """Megatron-LM's --rotary-scaling-factor: Llama 3.1's factor with --use-rope-scaling, else YaRN's when
    --rope-type is yarn (its default with --multi-latent-attention); plain rope takes no factor."""
    factor, kind = m.rotary_scaling_factor, m.rope_type or ("yarn" if mla or m.position_embedding_type == "yarn"
                                                            else "rope")
    if m.use_rope_scaling and m.rope_type == "yarn":
        raise UsageError("--use-rope-scaling (Llama 3.1's) and --rope-type yarn are two rope scalings: choose one")
    if factor is None:
        return {}
    if m.use_rope_scaling:
        return {"rope_scaling_factor": m.rope_scaling_factor if m.rope_scaling_factor is not None else factor}
    if kind == "yarn":
        if m.yarn_factor is not None and m.yarn_factor != factor:
            raise UsageError(f"--rotary-scaling-factor {factor:g} and --yarn-factor {m.yarn_factor:g} disagree: give "
                             f"one")
        return {"yarn_factor": factor}
    if factor != 1.0:
        raise UsageError(f"--rotary-scaling-factor {factor:g} scales rope only with --use-rope-scaling (Llama 3.1) or "
                         f"--rope-type yarn: add one, or drop it")
    return {}


MLA_SIZES = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


MOE_FIELDS = ("moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_score_function",
               "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_num_groups",
               "moe_router_group_topk", "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
               "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
               "moe_router_force_load_balancing", "moe_token_dispatcher_type",
               "moe_expert_capacity_factor", "moe_token_drop_policy", "moe_pad_expert_input_to_capacity",
               "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_apply_probs_on_input",
               "moe_input_jitter_eps")


def _moe_fields(m) -> dict:
    """TransformerConfig's MoE fields from the moe section (`num_experts` is `num_moe_experts` there)."""
    fields = {"num_moe_experts": m.num_experts, **{n: getattr(m, n) for n in MOE_FIELDS}}
    if m.moe_router_score_function == "sigmoid":  # as Megatron-LM's router: softmax's switch, no sigmoid meaning
        fields["moe_router_pre_softmax"] = False
    return fields


# Megatron-LM's --attention-backend names and megalite's backend for each. Its `fused` (cuDNN's fused
# attention) is megalite's sdpa where the model comes from Megatron-LM's flags; a megalite preset's
# `fused` is megalite's own fused-softmax kernel (Megatron-LM's `local`).
_MEGATRON_BACKENDS = {"flash": "sdpa", "fused": "sdpa", "unfused": "torch", "local": "fused"}
_MEGATRON_BACKEND_NOTES = {"flash": "Megatron-LM's flash attention", "fused": "Megatron-LM's fused attention kernel",
                           "unfused": "Megatron-LM's unfused attention", "local": "Megatron-LM's own attention with "
                           "its fused softmax"}


def model_config(config: RunConfig) -> TransformerConfig:
    """The model `config` describes (the preset with its overrides); reads `config`, never changes it.
    Errors name flags as the command line spelled them."""
    try:
        return _model_config(config)
    except UsageError as e:
        raise UsageError(in_user_spelling(str(e), config.spelled)) from None


def _model_config(config: RunConfig) -> TransformerConfig:
    check_sections(config)
    p = config.parallel
    if p.tp_comm_overlap and (p.tp == 1 or not p.sequence_parallel):  # (resolve turns SP off at --tp 1)
        raise UsageError(TP_COMM_OVERLAP_NEEDS)
    if p.tp_comm_overlap_splits > 1 and (p.tp == 1 or not p.sequence_parallel):  # (below 1: check_sections)
        raise UsageError(TP_COMM_SPLITS_NEEDS)
    m = config.model
    overrides = _model_overrides(m)
    moe_given = {k: v for k, v in _moe_fields(config.moe).items()
                 if config.given("num_experts" if k == "num_moe_experts" else k)}
    if PRESETS.get(m.model, {}).get("num_moe_experts") is not None:
        overrides.update(moe_given)  # a MoE preset's own --moe-layer-freq list must not meet the new depth
    if m.swiglu and m.ffn_hidden_size is None and not PRESETS[m.model].get("gated_linear_unit"):
        # As Megatron-LM sizes it: the gated MLP's three matrices hold about the parameters of a 4h
        # GeLU MLP's two (8h/3 each), rounded down to a multiple of 64.
        hidden = m.hidden_size or PRESETS[m.model]["hidden_size"]
        overrides["ffn_hidden_size"] = int(4 * hidden * 2 / 3 / 64) * 64
    try:
        built = preset(m.model, hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
                       sequence_parallel=p.sequence_parallel, tp_comm_overlap=p.tp_comm_overlap,
                       tp_comm_overlap_splits=p.tp_comm_overlap_splits,
                       moe_dispatch_chunks=p.moe_dispatch_chunks, recompute=m.recompute,
                       attention_backend="sdpa" if m.attention_backend == "auto" else m.attention_backend,
                       norm_backend=m.norm_backend, recompute_method=m.recompute_method,
                       recompute_num_layers=m.recompute_num_layers, cp_comm_type=p.cp_comm_type,
                       cp_a2a_size=(p.hierarchical_context_parallel_sizes or [1])[0] if p.cp_comm_type == "a2a+p2p" else 1,
                       **overrides)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if config.moe.num_experts is None and not built.is_moe:
        given = [f"--{n.replace('_', '-')}" for n in MOE_FIELDS if config.given(n)]
        if given or config.parallel.expert_model_parallel_size > 1:
            raise UsageError(f"{', '.join(given) or '--ep'}: for mixture-of-experts models only: add --num-experts N, "
                             f"or drop them")
    else:
        # a MoE preset (moe-tiny, mixtral-8x7b, ...) changes only with the flags given (applied above)
        moe = {} if built.is_moe else _moe_fields(config.moe)
        try:
            built = built.replace(**moe)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if not any(built.moe_layer_freq):
            raise UsageError(f"--moe-layer-freq {config.moe.moe_layer_freq} gives no layer experts (--num-experts "
                             f"{built.num_moe_experts}): put a 1 for each mixture-of-experts layer, or drop "
                             f"--num-experts for a dense model")
    rope_flags = [f"--{k.replace('_', '-')}" for k in _ROPE_FIELDS if k in overrides]
    if rope_flags and built.position_embedding_type != "rope":
        raise UsageError(f"{', '.join(rope_flags)}: for rotary positions only, but this model's position embedding "
                         f"is {built.position_embedding_type}: add --position-embedding-type rope, or drop them")
    yarn_details = [f"--{k.replace('_', '-')}" for k in YARN_FIELDS[1:] if k in overrides]
    if yarn_details and built.yarn_factor is None:
        raise UsageError(f"{', '.join(yarn_details)}: YaRN settings, but YaRN is off: add --yarn-factor, or drop them")
    if m.seq_length > built.max_position_embeddings:
        if m.max_position_embeddings is not None:
            raise UsageError(f"--seq-length {m.seq_length} is above --max-position-embeddings "
                             f"{m.max_position_embeddings}: raise it, or shorten the samples")
        built = built.replace(max_position_embeddings=m.seq_length)
    return built


def check_sections(config: RunConfig) -> None:
    """Each section's own rules, as one-line usage errors."""
    try:
        config.check()
    except ValueError as e:
        raise UsageError(in_user_spelling(str(e), config.spelled)) from None


def model_dtype(config: RunConfig) -> torch.dtype:
    """The dtype parameters and activations train in (the model is built, and masters kept, in fp32)."""
    p = config.precision
    return torch.bfloat16 if p.bf16 else torch.float16 if p.fp16 else torch.float32


def stream_dtype(config: RunConfig) -> torch.dtype:
    """The dtype of the hidden states between pipeline stages: fp32 under --fp32-residual-connection."""
    return torch.float32 if config.model.fp32_residual_connection else model_dtype(config)
