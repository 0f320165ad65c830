"""What the planner prints for people: the table of layouts, the rejections, the formulas with
their numbers (--explain) and the note when a ZeRO stage is what makes a layout fit. The
pretrain_gpt.py command is command.py's, the JSON forms json_forms.py's (importable from here too)."""
from __future__ import annotations

from megalite.models.memory import layer_activation_bytes
from megalite.optim.zero import MAX_IN_FLIGHT
from megalite.tools.plan.activations import kept_activations
from megalite.tools.plan.command import ARCH_FLAGS, MOE_FLAGS, SHAPE_FIELDS, _preset_of, launch_command, model_flags
from megalite.tools.plan.experts import activation_terms, routed_rows, routed_tokens
from megalite.tools.plan.inputs import DTYPE_BYTES, GIB, layer_numels, positions, stage_parameters
from megalite.tools.plan.json_forms import by_count, config_json, prediction_json, rejected_json
from megalite.tools.plan.muon import muon_seconds, muon_state_saving
from megalite.tools.plan.predict import Prediction, predict, stage_that_makes_it_fit, with_zero_stage
from megalite.tools.plan.search import PlanResult
from megalite.tools.plan.step_time import StepTime

__all__ = [  # with the names that moved to command.py and json_forms.py
    "ARCH_FLAGS",
    "MOE_FLAGS",
    "SHAPE_FIELDS",
    "_preset_of",
    "config_json",
    "explain",
    "format_rejections",
    "format_table",
    "launch_command",
    "model_flags",
    "prediction_json",
    "rejected_json",
    "zero_stage_note",
]


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
    for kind, r in by_count(result):
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
    none = ' (none: fp32 parameters are their own)' if not master else ''
    moments = run.adam_moment_bytes
    adam = f"{moments} B Adam exp_avg, exp_avg_sq{'' if moments == 8 else ' (bf16 stored)'}"
    if run.muon_tp_mode:  # Muon's matrices keep one fp32 moment
        matrices = muon_state_saving(pred.costs, pred.peak_stage) // 4
        out.append(f"  optimizer    ({master} B fp32 master{none} + 4 B Muon momentum) x {matrices:,} matrix elements "
                   f"+ ({master} B + {adam}) x {st.owned_numel - matrices:,} others = {_gib(st.optimizer)} GiB")
    else:
        out.append(f"  optimizer    ({master} B fp32 master{none} + {adam}) x {who} = {_gib(st.optimizer)} GiB")
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
    if c.fp32_residual_connection:
        formula += " + the fp32 stream's " + ("2" if lay.recompute == "full" else "4") + "*s*b*h" + (
            "/t" if lay.sequence_parallel else "") + " (widened_stream_bytes)"
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
            f"{pred.slow_stage} x {pred.micro_batches} micro-batches ({K.ep_exchanges} exchanges a layer, "
            f"{K.cluster.collective_latency_ms:g} ms each included), "
            + ("in pairs, each behind the other pass's next compute (exposed.ep_exposure)" if pred.run.overlap_moe_ep_comm
               else "not overlapped") + f" = {T.ep_comm:.3f} s")


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
        sizes = [b.end - b.start for c in pred.stages[pred.dp_stage].state.buckets for b in c if not b.deferred]
        out.append(f"  dp comm      {kind} x fp32 grads / {K.bw_dp / 1e9:g} GB/s, in {len(sizes)} buckets "
                   f"(first {sizes[0] if sizes else 0:,} elements; {K.cluster.collective_latency_ms:g} ms start-up "
                   f"each), each once backward has produced it, minus what hides behind the last "
                   f"backward: {part.overlapped:.3f} s; tied embedding (after the schedule) {part.embedding:.3f} s; "
                   f"parameter all-gather {part.all_gather:.3f} s (stage {pred.dp_stage}) = {T.dp_comm:.3f} s")
    if pred.config.is_moe:
        out.append(_explain_dispatch(pred))
    if lay.cp > 1:
        Sc = pred.stages[pred.slow_stage]
        out.append(f"  cp comm      ring of cp={lay.cp}: {K.ring_bytes / 2 ** 20:.1f} MiB sent per layer and micro-batch "
                   f"(K/V blocks forward and backward, dK/dV in fp32) x {Sc.n_layers} layers / {K.bw_cp / 1e9:g} GB/s "
                   f"+ {K.cluster.collective_latency_ms:g} ms a ring step = {Sc.ring_mb * 1e3:.3f} ms per micro-batch, "
                   f"each transfer behind one attention block"
                   f"{' and then the other pass of a pair' if pred.run.overlap_moe_ep_comm else ''} "
                   f"(exposed.cp_exposure), x {m}: {T.cp_comm:.3f} s")
    if pred.dp_parts[pred.dp_stage].traffic and pred.config.is_moe and pred.stages[pred.dp_stage].state.edp > 1:
        out.append(f"               (expert weights' buffers over edp={lay.edp} at {K.bw_edp / 1e9:g} GB/s, "
                   f"on the same stream)")
    ns = ""
    if pred.run.muon_tp_mode:
        seconds = max(muon_seconds(K, r) for r in pred.stages)
        ns = (f" + Muon's Newton-Schulz ({pred.run.muon_ns_steps} steps, --muon-tp-mode {pred.run.muon_tp_mode}) "
              f"{seconds * K.rate:.3e} FLOPs / {K.rate / 1e12:.0f} TFLOP/s = {seconds:.3f} s")
    out.append(f"  optimizer    {max(S.state.owned_numel for S in pred.stages.values()):,} elements x "
               f"{K.traffic} B / {cl.hbm_gbps:g} GB/s{ns} = {T.optimizer:.3f} s")
    out.append(f"  total        {T.total:.3f} s per step; {pred.tokens_per_s:,.0f} tokens/s; MFU "
               f"{100 * pred.mfu:.1f}% (model FLOPs {pred.model_flops:.3e} as megalite logs them)")
    return out
