"""The pretrain_gpt.py command that trains a layout: the model's flags (its preset and the flags
for what differs from it, a MoE model's expert flags) and the torchrun line with the layout's."""
from __future__ import annotations

import math
import shlex

from megalite.models.config import TransformerConfig
from megalite.models.presets import PRESETS
from megalite.tools.plan.inputs import GPT_PRESETS, extra_warmup_of

SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size")


# Architecture fields -> the pretrain_gpt.py flags that set them (a switch: flags when on).
ARCH_FLAGS = {
    "position_embedding_type": lambda v: ["--position-embedding-type", v],
    "rotary_base": lambda v: ["--rotary-base", f"{v:g}"],
    "rotary_percent": lambda v: ["--rotary-percent", f"{v:g}"],
    "rope_scaling_factor": lambda v: ["--rope-scaling-factor", f"{v:g}"] if v is not None else [],
    "rotary_seq_len_interpolation_factor": lambda v: (["--rotary-seq-len-interpolation-factor", f"{v:g}"]
                                                      if v is not None else []),
    "rope_low_freq_factor": lambda v: ["--rope-low-freq-factor", f"{v:g}"],
    "rope_high_freq_factor": lambda v: ["--rope-high-freq-factor", f"{v:g}"],
    "rope_original_max_position_embeddings": lambda v: ["--rope-original-max-position-embeddings", str(v)],
    "yarn_factor": lambda v: ["--yarn-factor", f"{v:g}"] if v is not None else [],
    "yarn_original_max_position_embeddings": lambda v: ["--yarn-original-max-position-embeddings", str(v)],
    "yarn_beta_fast": lambda v: ["--yarn-beta-fast", f"{v:g}"],
    "yarn_beta_slow": lambda v: ["--yarn-beta-slow", f"{v:g}"],
    "yarn_mscale": lambda v: ["--yarn-mscale", f"{v:g}"],
    "yarn_mscale_all_dim": lambda v: ["--yarn-mscale-all-dim", f"{v:g}"],
    "yarn_correction_range_round_to_int": lambda v: [] if v else ["--no-yarn-correction-range-round-to-int"],
    "gated_linear_unit": lambda v: ["--swiglu"] if v else [],  # --quick-geglu in its place (model_flags)
    "glu_linear_offset": lambda v: ["--glu-linear-offset", f"{v:g}"] if v else [],
    "activation_func_clamp_value": lambda v: ["--activation-func-clamp-value", f"{v:g}"] if v is not None else [],
    "num_query_groups": lambda v: ["--group-query-attention", "--num-query-groups", str(v)] if v else [],
    "normalization": lambda v: ["--normalization", v],
    "add_bias_linear": lambda v: [] if v else ["--disable-bias-linear"],
    "add_qkv_bias": lambda v: ["--add-qkv-bias"] if v else [],
    "qk_layernorm": lambda v: ["--qk-layernorm"] if v else [],
    "qk_layernorm_full_width": lambda v: ["--qk-layernorm-full-width"] if v else [],
    "untie_embeddings_and_output_weights": lambda v: ["--untie-embeddings-and-output-weights"] if v else [],
    "layernorm_epsilon": lambda v: ["--norm-epsilon", f"{v:g}"],
    "multi_latent_attention": lambda v: ["--multi-latent-attention"] if v else [],
    "q_lora_rank": lambda v: ["--q-lora-rank", str(v)] if v is not None else [],
    "kv_lora_rank": lambda v: ["--kv-lora-rank", str(v)],
    "qk_head_dim": lambda v: ["--qk-head-dim", str(v)],
    "qk_pos_emb_head_dim": lambda v: ["--qk-pos-emb-head-dim", str(v)],
    "v_head_dim": lambda v: ["--v-head-dim", str(v)],
    "mtp_num_layers": lambda v: ["--mtp-num-layers", str(v)],
    "window_size": lambda v: ["--window-size", ",".join(map(str, v))] if v is not None else [],
    "window_attn_skip_freq": lambda v: ["--window-attn-skip-freq", _layer_freq(v)] if v is not None else [],
    "qk_l2_norm": lambda v: ["--qk-l2-norm"] if v else [],
    "no_rope_freq": lambda v: ["--no-rope-freq", _layer_freq(v)] if v is not None else [],
    "softmax_type": lambda v: ["--softmax-type", v] if v != "vanilla" else [],
}


# A MoE model's fields -> the flags of pretrain_gpt.py's moe section. Given with --num-experts, that
# section sets every MoE field (its defaults for the flags not given), so all that differ from its
# defaults are spelled out, a preset's included.
MOE_FLAGS = {
    "num_moe_experts": lambda v: ["--num-experts", str(v)],
    "moe_router_topk": lambda v: ["--moe-router-topk", str(v)],
    "moe_ffn_hidden_size": lambda v: ["--moe-ffn-hidden-size", str(v)],
    "moe_layer_freq": lambda v: [] if all(v) else ["--moe-layer-freq", _layer_freq(v)],
    "moe_shared_expert_intermediate_size": lambda v: ["--moe-shared-expert-intermediate-size", str(v)] if v else [],
    "moe_shared_expert_gate": lambda v: ["--moe-shared-expert-gate"] if v else [],
    "moe_router_score_function": lambda v: ["--moe-router-score-function", v] if v != "softmax" else [],
    "moe_router_pre_softmax": lambda v: ["--moe-router-pre-softmax"] if v else [],
    "moe_router_topk_scaling_factor": lambda v: ["--moe-router-topk-scaling-factor", f"{v:g}"] if v else [],
    "moe_aux_loss_coeff": lambda v: ["--moe-aux-loss-coeff", f"{v:g}"] if v else [],
    "moe_z_loss_coeff": lambda v: ["--moe-z-loss-coeff", f"{v:g}"] if v is not None else [],
    "moe_token_dispatcher_type": lambda v: ["--moe-token-dispatcher-type", v] if v != "alltoall" else [],
    "moe_expert_capacity_factor": lambda v: ["--moe-expert-capacity-factor", f"{v:g}"] if v is not None else [],
    "moe_pad_expert_input_to_capacity": lambda v: ["--moe-pad-expert-input-to-capacity"] if v else [],
    "moe_apply_probs_on_input": lambda v: ["--moe-apply-probs-on-input"] if v else [],
    "moe_input_jitter_eps": lambda v: ["--moe-input-jitter-eps", f"{v:g}"] if v else [],
}


def _layer_freq(pattern: list[int]) -> str:
    """A per-layer 0/1 pattern as its flag's text (--moe-layer-freq, --window-attn-skip-freq,
    --no-rope-freq): the list, or Megatron-LM's runs "([0]*3+[1]*58)" where those are shorter."""
    listed = "[" + ",".join(map(str, pattern)) + "]"
    runs: list[list[int]] = []
    for v in pattern:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    spelled = "(" + "+".join(f"[{v}]*{n}" for v, n in runs) + ")"
    return spelled if len(spelled) < len(listed) else listed


def model_flags(config: TransformerConfig, preset_name: str | None = None) -> list[str]:
    """pretrain_gpt.py flags that build this model: the preset, plus flags for what differs from it
    (and a MoE model's expert flags, all of them)."""
    name = preset_name if preset_name in PRESETS else "gpt-tiny"
    ref = TransformerConfig(**PRESETS[name])
    flags = ["--model", name]
    for k in SHAPE_FIELDS:
        if getattr(ref, k) != getattr(config, k) or preset_name not in PRESETS:
            flags += [f"--{k.replace('_', '-')}", str(getattr(config, k))]
    for k, flag in ARCH_FLAGS.items():
        if getattr(ref, k) != getattr(config, k):
            flags += flag(getattr(config, k))
    if config.activation != ref.activation and config.activation in ("quick_gelu", "squared_relu"):
        flags = [f for f in flags if f != "--swiglu"] + [
            {"quick_gelu": "--quick-geglu", "squared_relu": "--squared-relu"}[config.activation]]
    if config.is_moe:
        for k, flag in MOE_FLAGS.items():
            flags += flag(getattr(config, k))
    return flags


def launch_command(pred, flags: list[str] | None = None) -> str:
    """The torchrun line that trains a Prediction's layout; `flags` build the model (default: its
    model_flags)."""
    lay, cl, run = pred.layout, pred.cluster, pred.run
    flags = flags if flags is not None else model_flags(pred.config, _preset_of(pred.config))
    gpn = min(cl.gpus_per_node, lay.gpus)
    nodes = math.ceil(lay.gpus / gpn)
    launcher = f"torchrun --nproc_per_node {gpn}" + (f" --nnodes {nodes}" if nodes > 1 else " --standalone")
    parts = [launcher, "pretrain_gpt.py", *flags, "--tp", str(lay.tp), "--pp", str(lay.pp)]
    if lay.cp > 1:
        parts += ["--cp", str(lay.cp)]
    if lay.ep > 1:
        parts += ["--ep", str(lay.ep)]
    if lay.etp != lay.tp:
        parts += ["--etp", str(lay.etp)]
    if lay.vpp and not lay.v_shape:  # zb-v sets its two chunks itself
        parts += ["--vpp", str(lay.vpp)]
    if lay.schedule != "1f1b":
        parts += ["--pipeline-schedule", lay.schedule]
    if extra_warmup_of(lay, run):  # predicted with it: the run should have it
        parts += ["--pipeline-extra-warmup", "1"]
    if run.pipeline_layers:
        parts += ["--pipeline-layers", ",".join(map(str, run.pipeline_layers))]
    parts += ["--micro-batch-size", str(lay.micro_batch_size), "--global-batch-size", str(run.global_batch_size),
              "--seq-length", str(run.seq_length), "--recompute", lay.recompute]
    if lay.sequence_parallel:
        parts.append("--sequence-parallel")
        if run.tp_comm_overlap:  # predicted with it: the run should have it
            parts.append("--tp-comm-overlap")
            if run.tp_comm_overlap_splits > 1:
                parts += ["--tp-comm-overlap-splits", str(run.tp_comm_overlap_splits)]
    if lay.zero_stage == 1:
        parts.append("--use-distributed-optimizer")
    elif lay.zero_stage >= 2:
        parts += ["--zero-stage", str(lay.zero_stage)]
    if 1 <= lay.zero_stage <= 2 and run.overlap_param_gather:  # predicted with it: the run should have it
        parts.append("--overlap-param-gather")
    if run.moe_dispatch_chunks > 1 and lay.ep > 1:
        parts += ["--moe-dispatch-chunks", str(run.moe_dispatch_chunks)]
    if run.delay_wgrad_compute and lay.zero_stage < 2:  # (refused with ZeRO-2 and -3)
        parts.append("--delay-wgrad-compute")
    if lay.zero_stage == 3 and not run.zero_reshard_after_forward:
        parts += ["--zero-reshard-after-forward", "false"]
    if lay.zero_stage == 3 and run.zero_keep_params_for_step:
        parts.append("--zero-keep-params-for-step")
    if run.grad_reduce_dtype != "fp32":
        parts += ["--grad-reduce-dtype", run.grad_reduce_dtype]
    if run.local_sgd_interval:
        parts += ["--local-sgd-interval", str(run.local_sgd_interval)]
        if run.local_sgd_fragments > 1:
            parts += ["--local-sgd-fragments", str(run.local_sgd_fragments)]
        if run.outer_grad_dtype != "fp32":
            parts += ["--outer-grad-dtype", run.outer_grad_dtype]
        if run.local_sgd_async:
            parts.append("--local-sgd-async")
    if run.muon_tp_mode:  # predicted with Muon: the run should use it
        parts += ["--optimizer", "muon", "--muon-tp-mode", run.muon_tp_mode]
        if run.muon_ns_steps != 5:
            parts += ["--muon-num-ns-steps", str(run.muon_ns_steps)]
    if run.adam_moment_bytes != 8:  # predicted with bf16 moments
        parts.append("--use-precision-aware-optimizer")
        parts += [f for name in ("exp_avg_dtype", "exp_avg_sq_dtype") if getattr(run, name) != "fp32"
                  for f in (f"--{name.replace('_', '-')}", getattr(run, name))]
    if run.dtype != "fp32":
        parts.append(f"--{run.dtype}")
    if run.attention_backend != "sdpa":
        parts += ["--attention-backend", run.attention_backend]
    if run.ddp_bucket_size != 40_000_000:
        parts += ["--ddp-bucket-size", str(run.ddp_bucket_size)]
    return " ".join([parts[0], *(shlex.quote(p) for p in parts[1:])])  # [0,1,1,1] is a shell pattern


def _preset_of(config: TransformerConfig) -> str | None:
    for name in GPT_PRESETS:
        ref = TransformerConfig(**PRESETS[name])
        if all(getattr(ref, k) == getattr(config, k) for k in (*SHAPE_FIELDS, *ARCH_FLAGS, *MOE_FLAGS)):
            return name
    return None
