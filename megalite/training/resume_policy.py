"""What a resumed run may change, field by field (issue #48: nothing changes silently).

`POLICY` puts every configuration field in one class; docs/checkpoints.md prints the same table and
tests/test_resume_policy.py checks that every field (a new one too) is in exactly one class:

- shape: what the weights are. Not given: the checkpoint's. Given and different: refused in one line
  naming the field, both values and the fix (the model section's through the built model,
  `checkpoint.check_compatible`; the experts' here, before anything is built).
- schedule: the learning-rate schedule and weight decay (Megatron-LM's optimizer-parameter
  scheduler). Not given: the checkpoint's. Given and different: refused unless
  --override-opt_param-scheduler (this command line's schedule) or
  --use-checkpoint-opt_param-scheduler (the checkpoint's); each change is said in one line.
- kept: may change. Not given: the checkpoint's; given and different: said in one line.
- noted: may change; this run's value (given, or the default); one that differs from the
  checkpoint's is said in one line.
- free: this invocation's own (layout, paths, logging, intervals, kernels and other ways of
  computing the same numbers, the resume switches): not compared.

What comes from the checkpoint is said once, in one line; an error about such a value names it as
the checkpoint's (`the checkpoint's num_experts 4`), not as a flag the user never gave.
--finetune starts a new run from the weights: only shape and the experts' kept fields apply.
--no-load-optim, like Megatron-LM's, leaves the schedule to the command line."""
from __future__ import annotations

import dataclasses
import math
import re
import typing

from megalite.config import RunConfig, lr_schedule_lengths, weight_decay_steps
from megalite.config.run import FIELD_SECTION, SECTIONS, flag_name
from megalite.errors import UsageError
from megalite.models.config import moe_layer_pattern
from megalite.training.datasets import loss_form

SHAPE, SCHEDULE, KEPT, NOTED, FREE = "shape", "schedule", "kept", "noted", "free"

_TABLE = {
    SHAPE: """model num_layers hidden_size num_attention_heads ffn_hidden_size kv_channels vocab_size
        make_vocab_size_divisible_by max_position_embeddings normalization position_embedding_type
        no_position_embedding rotary_percent swiglu group_query_attention num_query_groups disable_bias_linear
        add_qkv_bias qk_layernorm qk_layernorm_full_width untie_embeddings_and_output_weights multi_latent_attention
        q_lora_rank kv_lora_rank qk_head_dim qk_pos_emb_head_dim v_head_dim mtp_num_layers apply_layernorm_1p
        openai_gelu bert_no_binary_head squared_relu rotary_interleaved window_size window_attn_skip_freq
        qk_l2_norm no_rope_freq softmax_type quick_geglu glu_linear_offset activation_func_clamp_value
        num_experts moe_router_topk moe_ffn_hidden_size moe_layer_freq moe_router_score_function
        moe_router_pre_softmax moe_router_topk_scaling_factor moe_router_num_groups moe_router_group_topk
        moe_router_enable_expert_bias moe_shared_expert_intermediate_size moe_shared_expert_gate
        moe_apply_probs_on_input""",
    SCHEDULE: """lr min_lr lr_decay_style lr_warmup_iters lr_warmup_fraction lr_warmup_samples lr_decay_iters
        lr_decay_samples lr_wsd_decay_style lr_wsd_decay_iters lr_wsd_decay_samples decoupled_lr decoupled_min_lr
        weight_decay lr_warmup_init weight_decay_incr_style start_weight_decay end_weight_decay""",
    KEPT: """global_batch_size rampup_batch_size step_batch_size_schedule seq_length moe_router_load_balancing_type
        moe_aux_loss_coeff moe_z_loss_coeff moe_router_bias_update_rate moe_token_dispatcher_type moe_expert_capacity_factor
        moe_token_drop_policy moe_pad_expert_input_to_capacity""",
    NOTED: """hidden_dropout attention_dropout rotary_base rotary_seq_len_interpolation_factor rope_scaling_factor
        rope_low_freq_factor rope_high_freq_factor rope_original_max_position_embeddings use_rope_scaling
        rotary_scaling_factor rope_type
        yarn_factor yarn_original_max_position_embeddings yarn_beta_fast yarn_beta_slow yarn_mscale
        yarn_mscale_all_dim yarn_correction_range_round_to_int mtp_loss_scaling_factor norm_epsilon
        fp32_residual_connection
        data_path train_data_path valid_data_path test_data_path data_args_path per_split_data_args_path
        tokenizer tokenizer_type vocab_file merge_file tokenizer_model split mock_data mask_prob
        short_seq_prob
        reset_attention_mask reset_position_ids eod_mask_loss sft_data_path sft_no_packing
        train_iters train_samples seed data_parallel_random_init calculate_per_token_loss moe_router_force_load_balancing moe_input_jitter_eps
        optimizer adam_beta1 adam_beta2 adam_eps clip_grad sgd_momentum muon_momentum muon_use_nesterov
        muon_split_qkv muon_scale_mode muon_extra_scale_factor muon_num_ns_steps muon_fp32_matmul_prec muon_tp_mode
        qk_clip qk_clip_alpha qk_clip_threshold log_max_attention_logit use_precision_aware_optimizer exp_avg_dtype
        exp_avg_sq_dtype main_params_dtype main_grads_dtype
        bf16 fp16 loss_scale initial_loss_scale loss_scale_window hysteresis min_loss_scale fp8_format fp8_recipe
        fp8_margin fp8_amax_history_len fp8_amax_compute_algo fp8_wgrad fp8_param_gather first_last_layers_bf16
        num_layers_at_start_in_bf16 num_layers_at_end_in_bf16
        local_sgd_interval outer_lr outer_momentum outer_grad_dtype local_sgd_async local_sgd_fragments
        local_sgd_warmup_iters""",
    FREE: """tp pp vpp num_layers_per_virtual_pipeline_stage pipeline_schedule pipeline_pass_costs pipeline_extra_warmup
        pipeline_layers decoder_first_pipeline_num_layers decoder_last_pipeline_num_layers
        pipeline_model_parallel_layout account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split
        sequence_parallel tp_comm_overlap tp_comm_overlap_splits overlap_moe_expert_parallel_comm
        delay_wgrad_compute deterministic_mode full_validation multiple_validation_sets validation_set_names
        moe_dispatch_chunks moe_use_upcycling moe_upcycling_granularity cp cp_comm_type hierarchical_context_parallel_sizes expert_model_parallel_size expert_tensor_parallel_size
        distributed_timeout_minutes
        init_method_std init_method_xavier_uniform embedding_init_method_std
        recompute recompute_method recompute_num_layers attention_backend torch_compile norm_backend
        no_bias_gelu_fusion
        micro_batch_size eval_interval eval_iters eval_prompts eval_tasks eval_tasks_path eval_tasks_limit
        skip_train exit_interval exit_duration_in_mins no_exit_signal_handler
        max_skipped_iters plan plan_gpu_memory_gib use_apex_adam no_tf32 disable_bf16_reduced_precision_matmul
        use_distributed_optimizer zero_stage zero_reshard_after_forward zero_keep_params_for_step ddp_bucket_size
        grad_reduce_dtype overlap_grad_reduce overlap_param_gather
        save load ckpt_step exit_on_missing_checkpoint save_interval save_async no_save_optim no_save_rng no_load_optim no_load_rng finetune use_checkpoint_args
        override_opt_param_scheduler use_checkpoint_opt_param_scheduler
        log_interval metrics_file sample_log tensorboard_dir log_params_norm timeline timeline_iters no_progress_bar peak_tflops
        wandb_project wandb_exp_name wandb_save_dir wandb_entity""",
}
POLICY: dict[str, str] = {name: kind for kind, names in _TABLE.items() for name in names.split()}
CLASSES = tuple(_TABLE)

# Noted fields another check says in its own words: the model's rope and norm settings are compared on
# the built model (checkpoint.check_compatible: an alias spelling counts once), local SGD's rounds by
# resume.resume_local_sgd.
NOTED_ELSEWHERE = frozenset(
    "rotary_base rotary_seq_len_interpolation_factor rope_scaling_factor rope_low_freq_factor rope_high_freq_factor "
    "rope_original_max_position_embeddings use_rope_scaling rotary_scaling_factor rope_type yarn_factor "
    "yarn_original_max_position_embeddings yarn_beta_fast yarn_beta_slow yarn_mscale yarn_mscale_all_dim norm_epsilon "
    "yarn_correction_range_round_to_int "
    "local_sgd_interval".split())

# Fields that one setting spreads over: a group is the checkpoint's as a whole, or this run's.
_GROUPS = (("lr_warmup_iters", "lr_warmup_fraction", "lr_warmup_samples"), ("lr_decay_iters", "lr_decay_samples"),
           ("lr_wsd_decay_iters", "lr_wsd_decay_samples"),
           ("global_batch_size", "rampup_batch_size", "step_batch_size_schedule"))


def _group(name: str) -> tuple[str, ...]:
    return next((g for g in _GROUPS if name in g), (name,))


def _fmt(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_fmt(v) for v in value) + "]"
    return str(value)


def source(cfg: RunConfig, name: str) -> str:
    """Where this run's value of `name` comes from, as a note says it."""
    if cfg.given(name):
        return flag_name(name)
    return "derived" if f"{FIELD_SECTION[name]}.{name}" in cfg.derived else "the default"


def saved_value(run_config: dict, name: str):
    """The checkpoint's value of `name` from its run_config (a None value is not written; a field
    newer than the checkpoint reads as its default unless None is one of its values)."""
    section = FIELD_SECTION[name]
    values = run_config.get(section, {})
    if name in values:
        return values[name]
    f = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
    if type(None) in typing.get_args(typing.get_type_hints(SECTIONS[section])[name]):
        return None
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return (list(a) if isinstance(a, tuple) else a) == (list(b) if isinstance(b, tuple) else b)


@dataclasses.dataclass
class Adoption:
    """What the policy took from the checkpoint (said once; named in errors), and its notes."""
    path: str
    taken: dict = dataclasses.field(default_factory=dict)  # field -> the checkpoint's value, taken
    before: dict = dataclasses.field(default_factory=dict)  # field -> what this command line alone gave
    quiet: set = dataclasses.field(default_factory=set)  # taken, and said by another line ("model from ...")
    notes: list = dataclasses.field(default_factory=list)

    def take(self, cfg: RunConfig, values: dict, said_elsewhere: bool = False) -> RunConfig:
        """`cfg` with `values` (field -> the checkpoint's value), marked as given (a printed
        configuration writes them) and remembered for the line that says so."""
        by_section: dict[str, dict] = {}
        for name, value in values.items():
            self.before.setdefault(name, getattr(getattr(cfg, FIELD_SECTION[name]), name))
            self.taken[name] = value
            if said_elsewhere:
                self.quiet.add(name)
            by_section.setdefault(FIELD_SECTION[name], {})[name] = value
        for section, changes in by_section.items():
            cfg = cfg.replace(section, **changes)
        dotted = {f"{FIELD_SECTION[n]}.{n}" for n in values}
        return dataclasses.replace(cfg, explicit=cfg.explicit | dotted, derived=cfg.derived - dotted)

    def line(self) -> str | None:
        changed = [n for n in self.taken if n not in self.quiet and not _same(self.taken[n], self.before[n])]
        if not changed:
            return None
        return (f"megalite: from the checkpoint {self.path} (not given here): "
                f"{', '.join(f'{n} {_fmt(self.taken[n])}' for n in changed)} (the resume policy of "
                f"docs/checkpoints.md says which flags may change them)")


def merge_moe(cfg: RunConfig, saved: dict, model, adoption: Adoption, model_said: bool) -> RunConfig:
    """The experts field by field: the flags given where the checkpoint's model allows them (shape
    fields only equal to its own), the checkpoint's section for the rest. `saved`: the checkpoint's
    moe section (empty for a dense model); `model`: its TransformerConfig; `model_said`: the
    "model from" line names the checkpoint's model (its experts' shape too)."""
    names = [f.name for f in dataclasses.fields(cfg.moe)]
    given = [n for n in names if cfg.given(n) and POLICY[n] != FREE]
    if not saved.get("num_experts"):
        if cfg.moe.moe_use_upcycling:  # the experts are this run's flags (megalite.checkpoint.upcycle)
            return cfg
        if given:
            flags = ", ".join(flag_name(n) for n in given)
            raise UsageError(f"{flags}: the checkpoint {adoption.path} holds a dense model (no experts): drop "
                             f"{'it' if len(given) == 1 else 'them'} to train it, or --load a mixture-of-experts "
                             f"checkpoint")
        return cfg
    taken = {}
    for name in (n for n in names if POLICY[n] != FREE):
        mine, theirs = getattr(cfg.moe, name), saved.get(name, saved_value({}, name))
        if name not in given:
            taken[name] = theirs
        elif POLICY[name] == SHAPE:
            _check_expert_shape(name, mine, model, adoption.path)
        elif not _same(mine, theirs):
            adoption.notes.append(f"megalite: note: on resume {name} {_fmt(theirs)} (the checkpoint's) -> "
                                  f"{_fmt(mine)} ({flag_name(name)})")
    shape = {n: v for n, v in taken.items() if POLICY[n] == SHAPE}
    cfg = adoption.take(cfg, shape, said_elsewhere=model_said)
    return adoption.take(cfg, {n: v for n, v in taken.items() if n not in shape})


def _check_expert_shape(name: str, mine, model, path: str) -> None:
    attr = "num_moe_experts" if name == "num_experts" else name
    theirs = getattr(model, attr)
    if name == "moe_layer_freq":
        try:
            same = moe_layer_pattern(mine, model.num_layers) == list(theirs)
        except ValueError as e:
            raise UsageError(str(e)) from None
    elif name == "moe_ffn_hidden_size" and mine is None:
        same = True  # the default: the checkpoint's own width (a changed --ffn-hidden-size is a model shape flag)
    else:
        same = _same(mine, theirs)
    if not same:
        raise UsageError(f"{flag_name(name)} {_fmt(mine)}: the checkpoint {path} holds experts of another shape: "
                         f"{name} {_fmt(theirs)} (checkpoint) vs {_fmt(mine)} (now); drop the flag to train the "
                         f"checkpoint's experts, or --load another")


_SCHEDULE_GROUPS = (("lr",), ("min_lr",), ("lr_decay_style",), _GROUPS[0], _GROUPS[1], ("lr_wsd_decay_style",),
                    _GROUPS[2], ("decoupled_lr",), ("decoupled_min_lr",), ("weight_decay",), ("lr_warmup_init",),
                    ("weight_decay_incr_style",), ("start_weight_decay",), ("end_weight_decay",))


_WD_LENGTH = "weight-decay ramp"  # the item of a linear or cosine weight decay's length


def _effective(cfg: RunConfig) -> dict:
    """The schedule a run trains on, lengths in iterations (how `training.build.lr_schedules` reads it)."""
    o = cfg.optimizer
    warmup, decay, wsd = lr_schedule_lengths(cfg)
    out = {"lr": o.lr, "min_lr": o.min_lr, "lr_decay_style": o.lr_decay_style, "warm-up": warmup, "decay": decay}
    if o.lr_decay_style == "WSD":
        out.update({"lr_wsd_decay_style": o.lr_wsd_decay_style, "WSD decay": wsd})
    if o.decoupled_lr is not None:
        out.update(decoupled_lr=o.decoupled_lr,
                   decoupled_min_lr=o.decoupled_min_lr if o.decoupled_min_lr is not None else o.min_lr)
    if warmup:  # (without a warm-up its starting value is no part of the schedule)
        out["lr_warmup_init"] = o.lr_warmup_init
    out["weight_decay_incr_style"] = o.weight_decay_incr_style
    if o.weight_decay_incr_style == "constant":
        out["weight_decay"] = o.weight_decay
    else:  # Megatron-LM's ramp runs over the run's length, kept with its scheduler's state
        out.update({"start_weight_decay": o.start_weight_decay, "end_weight_decay": o.end_weight_decay,
                    _WD_LENGTH: weight_decay_steps(cfg)})
    return out


_LENGTHS = {"warm-up": _GROUPS[0], "decay": _GROUPS[1], "WSD decay": _GROUPS[2], _WD_LENGTH: ("train_iters",
                                                                                             "train_samples")}
_ITEMS = ("lr", "min_lr", "lr_decay_style", "warm-up", "decay", "lr_wsd_decay_style", "WSD decay", "decoupled_lr",
          "decoupled_min_lr", "weight_decay", "lr_warmup_init", "weight_decay_incr_style", "start_weight_decay",
          "end_weight_decay", _WD_LENGTH)


def _item_source(cfg: RunConfig, item: str) -> str:
    """Which flag gives a schedule item (a length: its group's flag, else what it is derived from)."""
    group = _LENGTHS.get(item, (item,) if item in POLICY else ())
    for name in group:
        if cfg.given(name):
            return flag_name(name)
    if item == "decay":
        for name in ("train_samples", "train_iters", "global_batch_size"):
            if cfg.given(name):
                return f"from {flag_name(name)}"
    return "derived" if item in _LENGTHS else "the default"


def _item_text(item: str, value) -> str:
    return f"{item} {_fmt(value)}{' iterations' if item in _LENGTHS else ''}"


def adopt_schedule(cfg: RunConfig, run_config: dict, adoption: Adoption) -> RunConfig:
    """The learning-rate schedule: the checkpoint's where no flag gives it; a given one that differs is
    refused unless one of Megatron-LM's two scheduler flags settles it."""
    c = cfg.checkpoint
    if "optimizer" not in run_config or c.finetune or c.no_load_optim or cfg.moe.moe_use_upcycling:
        return cfg  # (upcycling: a new run on a dense run's weights, as --finetune)
    theirs = cfg.replace("optimizer", **{n: saved_value(run_config, n) for g in _SCHEDULE_GROUPS for n in g})
    theirs = theirs.replace("training", **{n: saved_value(run_config, n) for n in
                                           ("train_iters", "train_samples", "global_batch_size")})
    if not any(cfg.given(n) for n in _GROUPS[1]) and all(saved_value(run_config, n) is None for n in _GROUPS[1]):
        # The checkpoint decayed over its run's length: its schedule keeps that length (a longer
        # --train-iters trains on at the floor unless --override-opt_param-scheduler says otherwise).
        if not _same(cfg.training.train_iters, theirs.training.train_iters) and cfg.training.train_samples is None:
            theirs = theirs.replace("optimizer", lr_decay_iters=theirs.training.train_iters)
    keep_all = c.use_checkpoint_opt_param_scheduler
    if c.override_opt_param_scheduler:
        groups = []
    else:
        groups = [g for g in _SCHEDULE_GROUPS if keep_all or not any(cfg.given(n) for n in g)]
    taken = {n: getattr(theirs.optimizer, n) for g in groups for n in g}
    adopted = adoption.take(cfg, taken) if taken else cfg
    if keep_all:  # each schedule flag given that the checkpoint's value replaces
        adoption.notes += [f"megalite: note: --use-checkpoint-opt_param-scheduler: {n} stays the checkpoint's "
                           f"{_fmt(v)} ({flag_name(n)} {_fmt(getattr(cfg.optimizer, n))} set aside)"
                           for n, v in taken.items() if cfg.given(n) and not _same(v, getattr(cfg.optimizer, n))]
    mine, saved = _effective(adopted), _effective(theirs)
    differs = [k for k in _ITEMS if not _same(mine.get(k), saved.get(k))]
    if "weight_decay_incr_style" in differs:  # the style names the change; the values it reads differ with it
        differs = [k for k in differs
                   if k not in ("weight_decay", "start_weight_decay", "end_weight_decay", _WD_LENGTH)]
    if not differs:
        return adopted
    if c.override_opt_param_scheduler:
        adoption.notes += [f"megalite: note: --override-opt_param-scheduler: {_item_text(k, saved.get(k))} (the "
                           f"checkpoint's) -> {_fmt(mine.get(k))} ({_item_source(cfg, k)})" for k in differs]
        return adopted
    if keep_all and differs == [_WD_LENGTH]:
        raise UsageError(f"--use-checkpoint-opt_param-scheduler: the weight decay ramps over the run's length, "
                         f"{_fmt(saved.get(_WD_LENGTH))} iterations in the checkpoint {adoption.path} against "
                         f"{_fmt(mine.get(_WD_LENGTH))} now: keep its --train-iters, or use "
                         f"--override-opt_param-scheduler")
    if keep_all:  # only a length in samples over a changed global batch can still differ
        raise UsageError(f"--use-checkpoint-opt_param-scheduler: the checkpoint {adoption.path}'s schedule is in "
                         f"samples and this run's global batch changes it ({', '.join(differs)}): keep its "
                         f"--global-batch-size, or use --override-opt_param-scheduler")
    items = "; ".join(f"{_item_text(k, mine.get(k))} ({_item_source(cfg, k)}) vs the checkpoint's "
                      f"{_fmt(saved.get(k))}" for k in differs)
    raise UsageError(f"this run's learning-rate schedule differs from the checkpoint {adoption.path}'s: {items}: add "
                     f"--override-opt_param-scheduler to train on with this command line's, or "
                     f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's (or give its values)")


def adopt_kept_and_note(cfg: RunConfig, run_config: dict, adoption: Adoption) -> RunConfig:
    """Kept fields the checkpoint's where not given (the experts' are merged by `merge_moe`); every
    kept and noted field that differs from the checkpoint's said in one line. A new run
    (--finetune, or upcycling a dense checkpoint) compares nothing."""
    if cfg.checkpoint.finetune or cfg.moe.moe_use_upcycling:
        return cfg
    taken = {}
    for name, kind in POLICY.items():
        section = FIELD_SECTION.get(name)
        if kind != KEPT or section not in run_config or section == "moe":
            continue
        if not any(cfg.given(n) for n in _group(name)):
            taken[name] = saved_value(run_config, name)
    cfg = adoption.take(cfg, taken) if taken else cfg
    for name, kind in POLICY.items():
        section = FIELD_SECTION.get(name)
        if kind not in (KEPT, NOTED) or name in NOTED_ELSEWHERE or section not in run_config or section == "moe":
            continue
        mine, theirs = getattr(getattr(cfg, section), name), saved_value(run_config, name)
        if not _same(mine, theirs) and name not in adoption.taken:
            adoption.notes.append(f"megalite: note: on resume {name} {_fmt(theirs)} (the checkpoint's) -> "
                                  f"{_fmt(mine)} ({source(cfg, name)})")
    return cfg


def old_bert_loss_note(metadata: dict, model_kind: str, cfg: RunConfig) -> str | None:
    """A megalite BERT checkpoint saved before checkpoints recorded their loss ("loss" in the metadata)
    trained on the global batch's per-token mean, since replaced by Megatron-LM's mean of micro-batch
    means under the same flags: said in one line when this run takes the new form."""
    if (model_kind != "bert" or "run_config" not in metadata or "loss" in metadata or cfg.checkpoint.finetune
            or loss_form(cfg, loss_counts_vary=True) == "per_token"):  # (BERT's masking: counts vary)
        return None
    return ("megalite: note: on resume the BERT loss was the global batch's per-token mean (the checkpoint's, "
            "saved before checkpoints recorded it) -> Megatron-LM's mean of micro-batch means (this run's): add "
            "--calculate-per-token-loss to keep the checkpoint's")


def with_sources(message: str, adoption: Adoption) -> str:
    """An error about a value taken from the checkpoint names it as the checkpoint's, not as a flag
    the user never gave: `--num-experts 4 is ...` -> `the checkpoint's num_experts 4 is ...`."""
    for name, value in adoption.taken.items():
        if value is None:
            continue
        flag = rf"(?<![\w-]){re.escape(flag_name(name))}(?![\w-])"
        for text in sorted({str(value), _fmt(value)}, key=len, reverse=True):
            message = re.sub(rf"{flag} \(?{re.escape(text)}\)?(?![\w.])", f"the checkpoint's {name} {text}", message)
        message = re.sub(flag, f"{flag_name(name)} (the checkpoint's {_fmt(value)}, not given)", message, count=1)
        # a model check names the field itself: `num_attention_heads (4) is not divisible ...`
        shown = "|".join(map(re.escape, {str(value), _fmt(value)}))
        message = re.sub(rf"(?<![\w'-])(?<!the checkpoint's ){name} \(({shown})\)", rf"the checkpoint's {name} (\1)",
                         message)
    return message
