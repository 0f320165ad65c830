"""What the planner prints: the table of layouts, the rejections, the formulas with their numbers
(--explain), the pretrain_gpt.py command of a layout, and the JSON forms."""
from __future__ import annotations

import math
import shlex
from dataclasses import asdict

from megalite.models.config import PRESETS, TransformerConfig
from megalite.models.memory import layer_activation_bytes
from megalite.optim.zero import MAX_IN_FLIGHT
from megalite.tools.plan.experts import activation_terms, routed_rows, routed_tokens
from megalite.tools.plan.inputs import DTYPE_BYTES, GIB, GPT_PRESETS, layer_numels, positions, stage_parameters
from megalite.tools.plan.memory import kept_activations
from megalite.tools.plan.predict import Prediction, predict
from megalite.tools.plan.search import PlanResult, stage_that_makes_it_fit, with_zero_stage
from megalite.tools.plan.step_time import StepTime

SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size")


# Architecture fields -> the pretrain_gpt.py flags that set them (a switch: flags when on).
ARCH_FLAGS = {
    "position_embedding_type": lambda v: ["--position-embedding-type", v],
    "rotary_base": lambda v: ["--rotary-base", f"{v:g}"],
    "rotary_percent": lambda v: ["--rotary-percent", f"{v:g}"],
    "rope_scaling_factor": lambda v: ["--rope-scaling-factor", f"{v:g}"] if v is not None else [],
    "rope_low_freq_factor": lambda v: ["--rope-low-freq-factor", f"{v:g}"],
    "rope_high_freq_factor": lambda v: ["--rope-high-freq-factor", f"{v:g}"],
    "rope_original_max_position_embeddings": lambda v: ["--rope-original-max-position-embeddings", str(v)],
    "gated_linear_unit": lambda v: ["--swiglu"] if v else [],
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
}


def _layer_freq(pattern: list[int]) -> str:
    """--moe-layer-freq's spelling of a 0/1 pattern: the list, or Megatron-LM's runs
    "([0]*3+[1]*58)" where those are shorter."""
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
    if config.is_moe:
        for k, flag in MOE_FLAGS.items():
            flags += flag(getattr(config, k))
    return flags


def launch_command(pred: Prediction, flags: list[str] | None = None) -> str:
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
    if run.pipeline_layers:
        parts += ["--pipeline-layers", ",".join(map(str, run.pipeline_layers))]
    parts += ["--micro-batch-size", str(lay.micro_batch_size), "--global-batch-size", str(run.global_batch_size),
              "--seq-length", str(run.seq_length), "--recompute", lay.recompute]
    if lay.sequence_parallel:
        parts.append("--sequence-parallel")
    if lay.zero_stage == 1:
        parts.append("--use-distributed-optimizer")
    elif lay.zero_stage >= 2:
        parts += ["--zero-stage", str(lay.zero_stage)]
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


# -------------------------------------------------------------------------------------------------
# JSON
# -------------------------------------------------------------------------------------------------
def prediction_json(pred: Prediction, model_flags: list[str] | None = None) -> dict:
    memory, time, layout = asdict(pred.memory), asdict(pred.time), asdict(pred.layout)
    if pred.layout.cp == 1:  # without context parallelism the JSON stays as it was
        del layout["cp"], time["cp_comm"]
    if not pred.config.is_moe:  # nor for a dense model
        del layout["ep"], layout["etp"], time["ep_comm"], memory["experts"]
    if not pred.config.mtp_num_layers:  # nor without multi-token prediction
        del memory["mtp"]
    if pred.layout.schedule == "1f1b":  # nor with the default schedule
        del layout["schedule"]
    return {
        "layout": layout, "fits": pred.fits, "reason": pred.reason,
        "micro_batches": pred.micro_batches, "peak_stage": pred.peak_stage,
        "memory_bytes": {k: int(v) for k, v in memory.items()},
        "memory_gib": {k: round(v / GIB, 3) for k, v in memory.items()},
        "build_peak_gib": round(pred.build_peak / GIB, 3), "peak_gib": round(pred.peak_bytes / GIB, 3),
        "time_s": {k: round(v, 6) for k, v in time.items()},
        "dp_traffic_bytes": {k: int(v) for k, v in pred.dp_parts[pred.dp_stage].traffic.items()},
        "zero_stage_makes_it_fit": stage_that_makes_it_fit(pred) is not None,
        "bubble_fraction": round(pred.bubble_fraction, 6), "mfu": round(pred.mfu, 4),
        "tokens_per_s": round(pred.tokens_per_s, 1), "model_flops": pred.model_flops,
        "hardware_flops": pred.hardware_flops, "command": pred.command(model_flags),
    }


def config_json(config: TransformerConfig) -> dict:
    return {k: getattr(config, k) for k in (*SHAPE_FIELDS, "max_position_embeddings")}


def rejected_json(result: PlanResult) -> list:
    return [{"reason": kind, "count": r.count, "example": r.example} for kind, r in _by_count(result)]


def _by_count(result: PlanResult) -> list:
    return sorted(result.rejected.items(), key=lambda kv: -kv[1].count)


# -------------------------------------------------------------------------------------------------
# Text
# -------------------------------------------------------------------------------------------------
def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def format_table(preds: list[Prediction]) -> str:
    with_cp = any(x.layout.cp > 1 for x in preds)  # the cp columns only where context parallelism is used
    moe = any(x.config.is_moe for x in preds)  # ep, etp, expert states and the dispatch time for MoE models
    zb = any(x.layout.schedule != "1f1b" for x in preds)  # the schedule column where one is not 1f1b
    sw = max([5] + [len(x.layout.schedule) for x in preds])
    head = (f"{'#':>2} {'tp':>3} " + (f"{'cp':>3} " if with_cp else "") + f"{'pp':>3} {'dp':>4} "
            + (f"{'ep':>3} {'etp':>3} " if moe else "") + f"{'vpp':>3} " + (f"{'sched':>{sw}} " if zb else "")
            + f"{'mb':>3} "
            f"{'recompute':>9} {'sp':>3} {'zero':>4} | "
            f"{'GiB':>5} {'param':>5} {'grad':>5} {'optim':>5} " + (f"{'exprt':>5} " if moe else "")
            + f"{'act':>5} {'out':>4} | "
            f"{'step s':>7} {'bubble':>6} {'tp':>5} {'pp':>5} {'dp':>5} " + (f"{'cp':>5} " if with_cp else "")
            + (f"{'a2a':>5} " if moe else "") + f"| {'MFU':>5}")
    lines = [head, "-" * len(head)]
    for i, x in enumerate(preds, 1):
        L, M, T = x.layout, x.memory, x.time
        lines.append(
            f"{i:>2} {L.tp:>3} " + (f"{L.cp:>3} " if with_cp else "") + f"{L.pp:>3} {L.dp:>4} "
            + (f"{L.ep:>3} {L.etp:>3} " if moe else "") + f"{L.vpp or '-':>3} "
            + (f"{L.schedule:>{sw}} " if zb else "")
            + f"{L.micro_batch_size:>3} {L.recompute:>9} "
            f"{'on' if L.sequence_parallel else '-':>3} {L.zero_stage or '-':>4} | "
            f"{_gib(x.peak_bytes):>5} {_gib(M.parameters):>5} {_gib(M.gradients):>5} "
            f"{_gib(M.optimizer):>5} " + (f"{_gib(M.experts):>5} " if moe else "")
            + f"{_gib(M.activations):>5} {_gib(M.output_layer):>4} | "
            f"{T.total:>7.3f} {_pct(T.bubble, T):>6} {_pct(T.tp_comm, T):>5} {_pct(T.pp_comm, T):>5} "
            f"{_pct(T.dp_comm, T):>5} " + (f"{_pct(T.cp_comm, T):>5} " if with_cp else "")
            + (f"{_pct(T.ep_comm, T):>5} " if moe else "") + "| "
            f"{100 * x.mfu:4.1f}%")
    return "\n".join(lines)


def _pct(seconds: float, time: StepTime) -> str:
    return f"{100 * seconds / time.total:4.1f}%"


def format_rejections(result: PlanResult) -> str:
    if not result.rejected:
        return "rejected: none"
    lines = ["rejected (counted where they fail: a tp value, a (tp, pp) pair, or one full layout):"]
    for kind, r in _by_count(result):
        lines.append(f"  {r.count:>6} x {kind:<22} e.g. {r.example}")
    return "\n".join(lines)


def _dp_label(lay) -> str:
    """What states are sharded over: dp, or dp x cp (CP ranks hold the same parameters)."""
    return f"dp={lay.dp}" if lay.cp == 1 else f"dp x cp={lay.dp_cp}"


def explain(pred: Prediction) -> str:
    """The formulas of the prediction, with its numbers."""
    lay, run, m = pred.layout, pred.run, pred.micro_batches
    out = [(f"layout: {lay.short()} on {lay.gpus} GPUs; {m} micro-batches per step; {run.dtype}; "
            f"attention backend {run.attention_backend}"),
           "", f"memory on pipeline stage {pred.peak_stage} (the fullest), per GPU:"]
    note = zero_stage_note(pred)
    if note:
        out[1:1] = [note]
    out += _explain_memory(pred)
    out += ["", "step time:"]
    out += _explain_time(pred)
    return "\n".join(out)


def zero_stage_note(pred: Prediction) -> str | None:
    """One line when the layout fits only at its ZeRO stage (2 or 3): what the stage below needs."""
    stage = stage_that_makes_it_fit(pred)
    if stage is None:
        return None
    below = predict(pred.config, with_zero_stage(pred.layout, stage - 1), pred.cluster, run=pred.run)
    return (f"note: ZeRO stage {stage} is what makes this layout fit: at stage {stage - 1} it needs "
            f"{_gib(below.peak_bytes)} GiB per GPU, more than {pred.cluster.gpu_memory_gib:g} GiB "
            f"(stage {stage}: {_gib(pred.peak_bytes)} GiB)")


def _explain_memory(pred: Prediction) -> list[str]:
    c, lay, cl, run, K = pred.config, pred.layout, pred.cluster, pred.run, pred.costs
    s, b, h, a, V = run.seq_length, lay.micro_batch_size, c.hidden_size, c.num_attention_heads, K.vocab
    t, p, v = lay.tp, lay.pp, lay.v
    ab = DTYPE_BYTES[run.dtype]
    r = pred.peak_stage
    S = pred.stages[r]
    st = S.state
    out = []
    layer = sum(layer_numels(c, t))
    shape = ("MLA's q_down, q_up (or q), kv_down and norms whole, kv_up and proj / tp, MLP / tp, norms"
             if c.multi_latent_attention else "= (4h^2 + 2h*ffn + 3h + ffn)/tp + 6h")
    pieces = [f"{S.n_layers} layers x {layer:,} ({shape})"]
    if c.is_moe:
        moe_layer = sum(x.per_rank(c, t, lay.ep, lay.etp) for x in stage_parameters(c, s, False, False).moe_layer)
        pieces = [f"{S.n_layers - S.moe_layers} dense layers x {layer:,}" if S.n_layers > S.moe_layers else "",
                  f"{S.moe_layers} MoE layers x {moe_layer:,} (attention / tp, router, experts / (ep x etp))"]
        pieces = [x for x in pieces if x]
    if r == 0:
        learned = f", positions {positions(c, s)} x {h}" if c.position_embedding_type == "learned_absolute" else ""
        pieces.insert(0, f"word embedding {V}/{t} x {h} = {V // t * h:,}{learned}")
    if r == p - 1:
        copy = p > 1 and (not c.untie_embeddings_and_output_weights or c.mtp_num_layers)
        tied = f"{'tied ' if not c.untie_embeddings_and_output_weights else ''}word embedding copy {V // t * h:,}, " \
            if copy else ""
        mtp = (f"; {c.mtp_num_layers} MTP module{'s' if c.mtp_num_layers > 1 else ''} (enorm, hnorm, eh_proj 2h x h/tp, "
               f"one {'MoE ' if c.is_moe_layer(c.num_layers) else ''}layer, a final norm)" if c.mtp_num_layers else "")
        pieces.append(f"{tied}final norm{mtp}")
    out.append(f"  parameters   {st.numel:,} elements = {'; '.join(pieces)}")
    shard = f" / {_dp_label(lay)} (ZeRO-3: this rank's shard of every unit)" if lay.zero_stage == 3 else ""
    out.append(f"               x {ab} B (+ {st.padded_numel - st.numel:,} padding elements){shard} = "
               f"{_gib(st.param_buffer)} GiB")
    if lay.zero_stage >= 2:
        units = "units (one per layer, the rest, a tied copy)" if lay.zero_stage == 3 else \
            f"buckets of {run.ddp_bucket_size:,}"
        out.append(f"  gradients    {st.padded_numel:,} / {_dp_label(lay)} x {st.grad_bytes} B (ZeRO-{lay.zero_stage}: "
                   f"this rank's reduced shard; {units} padded to a multiple of 64*dp) = {_gib(st.grads)} GiB")
    else:
        out.append(f"  gradients    {st.padded_numel:,} x 4 B (fp32 buffers, buckets of {run.ddp_bucket_size:,} "
                   f"padded to a multiple of {_dp_label(lay)}: {st.grad_padding // 4:,} padding) = {_gib(st.grads)} GiB")
    master = 0 if run.dtype == "fp32" else 4
    who = (f"{st.owned_numel:,} owned (this dp rank's shard of every bucket)" if lay.distributed_optimizer
           else f"{st.owned_numel:,} (every parameter)")
    out.append(f"  optimizer    ({master} B fp32 master{' (none: fp32 parameters are their own)' if not master else ''}"
               f" + 8 B Adam exp_avg, exp_avg_sq) x {who} = {_gib(st.optimizer)} GiB")
    if st.experts is not None:
        out.append(_explain_expert_states(pred, st))
    if lay.zero_stage >= 2:
        out.append(_explain_transient(lay, run, st))
    keep = kept_activations(lay, run)
    per_layer = layer_activation_bytes(c, s, b, t, "full" if lay.recompute == "full" else keep,
                                       lay.sequence_parallel, run.attention_backend) * ab / 2
    formula = {"none": "s*b*h*(10 + 24/t + 5*a*s/(h*t))", "selective": "s*b*h*(10 + 24/t)"}[keep]
    if lay.sequence_parallel:
        formula = {"none": "s*b*h*(34 + 5*a*s/h)/t", "selective": "34*s*b*h/t"}[keep]
    if lay.recompute == "full":
        formula = "2*s*b*h" + ("/t" if lay.sequence_parallel else "") + " (layer inputs only)"
    sdpa_note = ", sdpa keeps no s^2 matrices" if keep != "none" and lay.recompute == "none" else ""
    if c.multi_latent_attention and lay.recompute != "full":
        formula = "MLA's terms (megalite.models.memory.mla_activation_bytes_per_layer)"
    elif c.num_query_groups or c.gated_linear_unit or c.qk_layernorm or c.position_embedding_type == "rope":
        formula += " with the Llama family's terms (megalite.models.memory)"
    chunks = f"{S.chunks_in_flight} chunks of {S.n_layers // v} layers"
    sched = ("1 (no pipeline)" if p == 1 else
             f"min(p, m) = {S.chunks_in_flight} (zb-h1)" if lay.schedule == "zb-h1" else
             f"2 min(p, m) = {chunks} (zb-v)" if lay.schedule == "zb-v" else
             f"2p + 1 = {chunks} (dualpipev)" if lay.schedule == "dualpipev" else
             f"min(p - r, m) = {S.chunks_in_flight}" if v == 1 else
             f"min(v*m, 2(p-1-r) + (v-1)p + 1) = {chunks}")
    out.append(f"  activations  {formula} = {per_layer / 2 ** 20:.1f} MiB per layer and micro-batch "
               f"(s={s} b={b} h={h} a={a} t={t}{sdpa_note})")
    if c.is_moe and lay.recompute != "full":
        out.append(_explain_moe_activations(pred))
    out.append(f"               x {S.n_layers // v} layers per chunk x in flight {sched}"
               + (f" + one layer recomputed in backward {S.transient / GIB:.2f} GiB" if S.transient else "")
               + f" = {_gib(S.activations)} GiB")
    if r == p - 1:
        out.append(f"  output layer final-norm and output-layer inputs 2*s*b*h*{ab} B + logits s*b*V/t x "
                   f"({ab} + 4{' + 4' if ab != 4 else ''}) B = {s}*{b}*{V // t} x {ab + 4 + (4 if ab != 4 else 0)} B "
                   f"... = {_gib(S.output - S.mtp)} GiB")
        if S.mtp:
            out.append(f"               + {c.mtp_num_layers} MTP module{'s' if c.mtp_num_layers > 1 else ''}: a layer, "
                       f"its norms', eh_proj's and the output layer's inputs, the fp32 softmax s*b*V/t x 4 B "
                       f"(tools.plan.memory.mtp_bytes) = {_gib(S.mtp)} GiB")
    out.append(f"  overhead     {cl.overhead_gib:g} GiB (CUDA context, workspaces, NCCL buffers)")
    out.append(f"  total        {_gib(pred.memory.total)} GiB of {cl.gpu_memory_gib:g} GiB; while building the "
               f"model: {_gib(pred.build_peak)} GiB (the fp32 model, each chunk's flat buffers allocated before "
               f"its fp32 parameters are released{', the fp32 masters cloned' if ab != 4 else ''}; plus overhead)")
    return out


def _explain_expert_states(pred: Prediction, st) -> str:
    """The expert weights' share of the states: their own buffers, reduced and sharded over EDP."""
    c, lay, run = pred.config, pred.layout, pred.run
    ex = st.experts
    per_expert = 3 if c.gated_linear_unit else 2
    sharded = f", optimizer sharded over edp={st.edp}" if lay.zero_stage >= 1 else ""
    grads = f" / edp={st.edp}" if lay.zero_stage >= 2 else ""
    layers = f"{pred.stages[pred.peak_stage].moe_layers} MoE layers"
    if pred.peak_stage == lay.pp - 1 and pred.costs.mtp_moe:
        layers += f" + {pred.costs.mtp_moe} of MTP"
    return (f"  experts      of the above: {ex.numel:,} elements = {layers} x "
            f"{c.num_moe_experts}/ep={lay.ep} experts x {per_expert}*h*ffn/etp ({c.hidden_size}*{c.moe_ffn_hidden_size}"
            f"/{lay.etp}), a buffer of their own per chunk{sharded}: params x {DTYPE_BYTES[run.dtype]} B + grads"
            f"{grads} x {ex.grad_bytes} B + optimizer {_gib(ex.optimizer)} GiB = "
            f"{_gib(ex.param_buffer + ex.grads + ex.optimizer)} GiB")


def _explain_moe_activations(pred: Prediction) -> str:
    """A MoE layer's activations against a dense layer's (experts.activation_terms)."""
    terms = activation_terms(pred.config, pred.layout, pred.run)
    k, T, R = pred.config.moe_router_topk, routed_tokens(pred.layout, pred.run), routed_rows(pred.config, pred.layout,
                                                                                             pred.run)
    parts = ", ".join(f"{name} {v / 2 ** 20:.1f}" for name, v in terms.items() if name != "dense_mlp" and v)
    extra = sum(v for name, v in terms.items() if name != "dense_mlp") - terms["dense_mlp"]
    return (f"               MoE layers: in place of the MLP's {terms['dense_mlp'] / 2 ** 20:.1f} MiB, {parts} MiB "
            f"(T={T} tokens routed per rank, R={R:g} rows = k={k} x T{' at the capacity factor' if R != k * T else ''}):"
            f" {extra / 2 ** 20:+.1f} MiB per MoE layer")


def _explain_transient(lay, run, st) -> str:
    gathered = ""
    if lay.zero_stage == 3:
        kept = not run.zero_reshard_after_forward or run.zero_keep_params_for_step
        gathered = (f" + gathered units {st.transient_gathered / GIB:.2f} GiB (embeddings / final norm and "
                    f"{'every layer' if kept else 'two layers'})")
    return (f"  transient    whole-bucket gradients while they reduce-scatter (<= {MAX_IN_FLIGHT} in flight + the "
            f"one filling) {st.transient_grads / GIB:.2f} GiB{gathered}: peak together {_gib(st.transient)} GiB")


def _explain_dispatch(pred: Prediction) -> str:
    """The token dispatch's bytes and seconds (experts.dispatch_bytes)."""
    c, lay, K, T = pred.config, pred.layout, pred.costs, pred.time
    S = pred.stages[pred.slow_stage]
    passes = 6 if lay.recompute == "full" else 4
    if c.moe_token_dispatcher_type == "allgather":
        how = (f"all-gather of T tokens + reduce-scatter over etp x ep = {lay.etp * lay.ep}: {passes} x (n-1) x T x h"
               f" x {K.act_bytes} B = {K.ep_bytes / 2 ** 20:.1f} MiB at {K.bw_ep / 1e9:g} GB/s")
    else:
        how = (f"all-to-all over ep={lay.ep}: {passes} x R x h x {K.act_bytes} B x (ep-1)/ep = "
               f"{K.ep_bytes / 2 ** 20:.1f} MiB at {K.bw_ep / 1e9:g} GB/s"
               + (f"; rows gathered over etp={lay.etp}: {passes} x (etp-1) x R x h x {K.act_bytes} B = "
                  f"{K.etp_bytes / 2 ** 20:.1f} MiB at {K.bw_etp / 1e9:g} GB/s" if lay.etp > 1 else ""))
    return (f"  ep comm      per MoE layer and micro-batch, dispatch and combine, forward and backward"
            f"{' and recomputed forward' if passes == 6 else ''}: {how} = {K.ep_time * 1e3:.3f} ms; x "
            f"{S.moe_layers + (K.mtp_moe if pred.slow_stage == lay.pp - 1 else 0)} MoE layers on stage "
            f"{pred.slow_stage} x {pred.micro_batches} micro-batches, "
            f"not overlapped = {T.ep_comm:.3f} s")


def _explain_time(pred: Prediction) -> list[str]:
    lay, cl, K, T = pred.layout, pred.cluster, pred.costs, pred.time
    t, p, v, m = lay.tp, lay.pp, lay.v, pred.micro_batches
    ab = DTYPE_BYTES[pred.run.dtype]
    out = []
    rc = {"none": "", "selective": " + 4*B*s^2*h*L (selective: attention core again)",
          "full": " + 24*B*s*L*h^2*(1 + s/6h) (full: the forward again)"}[lay.recompute]
    mtp = " + MTP's layer, eh_proj and head" if pred.config.mtp_num_layers else ""
    out.append(f"  compute      [72*B*s*L*h^2*(1 + s/6h) + 6*B*s*h*V{mtp}]{rc} = {pred.hardware_flops:.3e} FLOPs / "
               f"({lay.gpus} GPUs x {cl.peak_tflops:g} TFLOP/s x {cl.efficiency:g}) = {T.compute:.3f} s")
    if pred.config.is_moe:
        out.append("               (MoE layers: attention, router, top-k experts and shared expert only; with "
                   "balanced routing each rank runs 1/(tp x cp) of a micro-batch's expert work, whatever ep and etp)")
    out.append(f"  imbalance    slowest stage {pred.slow_stage} (the last also runs the output layer) over the mean: "
               f"{T.imbalance:.3f} s")
    if t > 1:
        Ss = pred.stages[pred.slow_stage]
        n_dense = Ss.n_layers - Ss.moe_layers
        extra = (Ss.tp_mb / K.ar_time) - n_dense * K.ar_per_layer - Ss.moe_layers * K.moe_ar_per_layer
        layers = f"{Ss.n_layers} layers x {K.ar_per_layer}"
        if Ss.moe_layers:
            dense_part = f"{n_dense} dense layers x {K.ar_per_layer} + " if n_dense else ""
            layers = f"{dense_part}{Ss.moe_layers} MoE layers x {K.moe_ar_per_layer}"
        heads = "embedding/output/MTP" if pred.config.mtp_num_layers else "embedding/output"
        out.append(f"  tp comm      ({layers} + {extra:.0f} {heads}) "
                   f"all-reduces of s*b*h*{ab} B = {K.ar_bytes / 2 ** 20:.1f} MiB per micro-batch on stage "
                   f"{pred.slow_stage}, 2(t-1)/t x bytes / {K.bw_tp / 1e9:g} GB/s = {K.ar_time * 1e3:.3f} ms "
                   f"each, x {m} micro-batches = {T.tp_comm:.3f} s")
    if p > 1:
        out.append(f"  pp comm      2 x v={v} exchanges of {K.msg / 2 ** 20:.1f} MiB per micro-batch at "
                   f"{K.bw_pp / 1e9:g} GB/s x {m} = {T.pp_comm:.3f} s")
        rate = {"zb-h1": f"(p-1)/(3m) = {p - 1}/(3*{m})", "dualpipev": f"(p-1)/(3m) = {p - 1}/(3*{m})",
                "zb-v": f"(p-1)/(6m) = {p - 1}/(6*{m})"}.get(lay.schedule, f"(p-1)/(v*m) = {p - 1}/({v}*{m})")
        out.append(f"  bubble       {rate} of the per-micro-batch time "
                   f"({lay.schedule} bubble {pred.bubble_fraction:.4f}) = {T.bubble:.3f} s")
    part = pred.dp_parts[pred.dp_stage]
    if pred.run.local_sgd_interval:
        run = pred.run
        h, f = run.local_sgd_interval, run.local_sgd_fragments
        sync = part.traffic["outer_all_reduce"] * h
        how = "hidden behind the next H inner steps (async)" if run.local_sgd_async else "exposed"
        out.append(f"  dp comm      local SGD: no per-step gradient reduction; every H={h} steps an all-reduce "
                   f"2(d-1)/d x params x {run.outer_grad_dtype} = {sync / 2 ** 20:,.1f} MiB"
                   + (f" ({f} fragments of 1/{f}, one every H/F={h // f} steps)" if f > 1 else "")
                   + f" at {K.bw_dp / 1e9:g} GB/s, {how}: {part.outer:.3f} s per step; tied embedding "
                   f"{part.embedding:.3f} s = {T.dp_comm:.3f} s")
    elif lay.zero_stage >= 2:
        sent = ", ".join(f"{k.replace('_', '-')} {v / 2 ** 20:,.1f} MiB" for k, v in part.traffic.items() if v)
        pattern = ("m reduce-scatters, one all-gather" if lay.zero_stage == 2 else
                   "per micro-batch: all-gather forward and backward, reduce-scatter")
        out.append(f"  dp comm      ZeRO-{lay.zero_stage}, per step: {sent} ((d-1)/d of each; {pattern}) "
                   f"at {K.bw_dp / 1e9:g} GB/s; what each backward waits for at its end {part.overlapped:.3f} s; "
                   f"gathers not hidden by the layers' compute {part.gathers:.3f} s; tied embedding "
                   f"{part.embedding:.3f} s; parameter all-gather {part.all_gather:.3f} s (stage {pred.dp_stage}) "
                   f"= {T.dp_comm:.3f} s")
    else:
        kind = "reduce-scatter (d-1)/d" if lay.distributed_optimizer else "all-reduce 2(d-1)/d"
        out.append(f"  dp comm      {kind} x fp32 grads / {K.bw_dp / 1e9:g} GB/s, minus what hides behind the last "
                   f"backward: {part.overlapped:.3f} s; tied embedding (after the schedule) {part.embedding:.3f} s; "
                   f"parameter all-gather {part.all_gather:.3f} s (stage {pred.dp_stage}) = {T.dp_comm:.3f} s")
    if pred.config.is_moe:
        out.append(_explain_dispatch(pred))
    if lay.cp > 1:
        Sc = pred.stages[pred.slow_stage]
        out.append(f"  cp comm      ring of cp={lay.cp}: {K.ring_bytes / 2 ** 20:.1f} MiB sent per layer and micro-batch "
                   f"(K/V blocks forward and backward, dK/dV in fp32) x {Sc.n_layers} layers / {K.bw_cp / 1e9:g} GB/s "
                   f"= {Sc.ring_mb * 1e3:.3f} ms per micro-batch, overlapped with its {Sc.compute_mb * 1e3:.3f} ms of "
                   f"compute: max(0, ring - compute) x {m} = {T.cp_comm:.3f} s")
    if pred.dp_parts[pred.dp_stage].traffic and pred.config.is_moe and pred.stages[pred.dp_stage].state.edp > 1:
        out.append(f"               (expert weights' buffers over edp={lay.edp} at {K.bw_edp / 1e9:g} GB/s, "
                   f"on the same stream)")
    out.append(f"  optimizer    {max(S.state.owned_numel for S in pred.stages.values()):,} elements x "
               f"{K.traffic} B / {cl.hbm_gbps:g} GB/s = {T.optimizer:.3f} s")
    out.append(f"  total        {T.total:.3f} s per step; {pred.tokens_per_s:,.0f} tokens/s; MFU "
               f"{100 * pred.mfu:.1f}% (model FLOPs {pred.model_flops:.3e} as megalite logs them)")
    return out
