"""One layout's prediction: memory and step time of each pipeline rank that can be the fullest or
the slowest, and the step as a whole; and whether its ZeRO stage is what makes it fit (the same
layout predicted at the stages below)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from megalite.metrics import model_flops_per_iteration
from megalite.models.config import TransformerConfig
from megalite.pipeline.partition import layers_of, virtual_stage
from megalite.pipeline.schedules import bubble_fraction
from megalite.tools.plan.activations import in_flight_chunks, mtp_bytes, output_layer_bytes, stored_activations
from megalite.tools.plan.comm import dp_exposed
from megalite.tools.plan.command import launch_command
from megalite.tools.plan.costs import LayoutCosts
from megalite.tools.plan.experts import moe_layers
from megalite.tools.plan.exposed import Exposure, cp_exposure, ep_exposure, exposed_comm, ring_transfers, tp_exposure
from megalite.tools.plan.inputs import GIB, Cluster, Layout, Run, check_gpt, extra_warmup_of
from megalite.tools.plan.json_forms import prediction_json
from megalite.tools.plan.memory import Memory, over
from megalite.tools.plan.muon import muon_seconds, with_optimizer_choices
from megalite.tools.plan.states import StateBytes, rank_state_bytes
from megalite.tools.plan.step_time import StepTime, layout_costs


@dataclass(frozen=True)
class StageResult:
    """One pipeline rank: what it holds and how long one micro-batch takes on it."""
    state: StateBytes
    n_layers: int
    chunk_layers: list  # layers of each of its model chunks
    flops_mb: float  # FLOPs per micro-batch on one GPU of this rank
    tp_mb: float  # seconds of TP collectives per micro-batch
    compute_mb: float
    t_mb: float  # seconds per micro-batch: compute, TP and pipeline communication
    chunks_in_flight: int
    stored_chunk: float  # activation bytes one in-flight chunk keeps
    transient: float  # working set of a recomputed layer's backward
    activations: float
    output: float  # output layer and cross-entropy (last stage)
    total: float  # bytes held at the peak of the step
    build: float  # bytes while the model is built, plus overhead
    ring_mb: float = 0.0  # seconds of context-parallel ring traffic per micro-batch, overlapped with compute_mb
    moe_layers: int = 0  # of n_layers, the MoE ones
    ep_mb: float = 0.0  # seconds of MoE token dispatch per micro-batch (in t_mb)
    mtp: float = 0.0  # of output: the multi-token prediction modules' activations (last stage)
    tp_collectives: int = 0  # TP collectives per micro-batch (an all-reduce, or SP's gather + scatter pair)
    tp_edge_collectives: int = 0  # of those, the embedding's, output layer's and MTP's (outside the layers)
    ep_layers: int = 0  # layers whose token dispatch this rank runs (MTP's on the last stage included)


@dataclass
class Prediction:
    layout: Layout
    config: TransformerConfig
    cluster: Cluster
    run: Run
    fits: bool
    memory: Memory  # on the fullest stage
    peak_stage: int  # the pipeline rank of that stage
    build_peak: float  # bytes while the model is built (plus overhead)
    time: StepTime
    micro_batches: int
    bubble_fraction: float
    model_flops: float  # per iteration, as megalite's log counts them
    hardware_flops: float  # per iteration, with recomputation
    reason: str | None = None  # why it does not fit
    costs: LayoutCosts | None = None  # intermediate numbers for --explain
    stages: dict = field(default_factory=dict)  # pipeline rank -> StageResult (the ranks that can be extreme)
    dp_parts: dict = field(default_factory=dict)  # pipeline rank -> DataParallelTime
    slow_stage: int = 0  # the rank with the longest micro-batch
    dp_stage: int = 0  # the rank with the most exposed data-parallel time

    @property
    def step_time(self) -> float:
        return self.time.total

    @property
    def peak_bytes(self) -> float:
        return max(self.memory.total, self.build_peak)

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_time * self.cluster.gpus * self.cluster.peak_tflops * 1e12)

    @property
    def tokens_per_s(self) -> float:
        return self.run.global_batch_size * self.run.seq_length / self.step_time

    def command(self, model_flags: list[str] | None = None) -> str:
        return launch_command(self, model_flags)

    @property
    def exposed(self) -> dict[str, Exposure]:
        """Per dimension: its exchanges, bytes, communication time and the part of it exposed (exposed.py)."""
        return exposed_comm(self)

    def to_dict(self, model_flags: list[str] | None = None) -> dict:
        return prediction_json(self, model_flags, stage_that_makes_it_fit(self) is not None)


def _check_layout_fits_model(config: TransformerConfig, layout: Layout, run: Run) -> int:
    """The micro-batches per step, or a ValueError when megalite would refuse the layout."""
    t, p, d, b = layout.tp, layout.pp, layout.dp, layout.micro_batch_size
    s, B = run.seq_length, run.global_batch_size
    if B % (b * d):
        raise ValueError(f"global batch {B} is not divisible by micro-batch {b} x dp {d}")
    m = B // (b * d)
    for what, n in (("heads", config.num_attention_heads), ("ffn hidden size", config.ffn_hidden_size)):
        if n % t:
            raise ValueError(f"{what} {n} not divisible by tp {t}")
    if layout.schedule == "dualpipev" and m < 2 * p:
        raise ValueError(f"dualpipev needs at least 2 x pp = {2 * p} micro-batches per step, got {m}")
    if layout.vpp and (p == 1 or m % p and not layout.v_shape):  # a V takes any m
        raise ValueError(f"vpp {layout.vpp} needs pp > 1 and the micro-batches per step ({m}) a multiple of pp {p}")
    if run.local_sgd_interval and layout.zero_stage:
        raise ValueError(f"local SGD keeps each replica's optimizer whole: ZeRO stage {layout.zero_stage} is refused")
    if run.muon_tp_mode and layout.zero_stage:
        raise ValueError(f"Muon orthogonalizes whole matrices: ZeRO stage {layout.zero_stage} is refused")
    groups = config.num_query_groups
    if run.muon_tp_mode == "blockwise" and groups is not None and t > groups:
        raise ValueError(f"Muon's blockwise mode takes whole key groups: tp {t} is above the {groups} query groups")
    if layout.sequence_parallel and (t == 1 or s % t):
        raise ValueError(f"sequence parallelism needs tp > 1 and seq length {s} divisible by tp {t}")
    reason = context_parallel_refusal(layout.cp, t, s, layout.sequence_parallel) or expert_refusal(config, layout, run)
    if reason:
        raise ValueError(reason)
    return m


def expert_refusal(config: TransformerConfig, layout: Layout, run: Run) -> str | None:
    """Why megalite refuses this expert layout (config.layout._check_experts, training.build), or None."""
    ep, etp = layout.ep, layout.etp
    if not config.is_moe:
        return None if ep == 1 else f"ep {ep} is for mixture-of-experts models only: this model has no experts"
    if config.num_moe_experts % ep:
        return f"the number of experts ({config.num_moe_experts}) is not divisible by ep {ep}"
    if config.moe_ffn_hidden_size % etp:
        return f"the expert width ({config.moe_ffn_hidden_size}) is not divisible by etp {etp}"
    if config.add_bias_linear and etp > 1:
        return f"experts with biases run at etp 1 (etp {etp})"
    if layout.tp > 1 and not layout.sequence_parallel:
        return f"mixture-of-experts layers at tp {layout.tp} need sequence parallelism"
    if run.local_sgd_interval and (layout.tp * layout.cp) % (ep * etp):
        return (f"local SGD keeps expert parallelism inside a replica: etp {etp} x ep {ep} must divide tp x cp = "
                f"{layout.tp * layout.cp}")
    return None


def context_parallel_refusal(cp: int, t: int, s: int, sequence_parallel: bool) -> str | None:
    """Why megalite refuses --cp `cp` here (config.layout._check_context_parallel), or None."""
    if cp == 1:
        return None
    if s % (2 * cp):
        return f"cp {cp} cuts each sequence into {2 * cp} chunks: seq length {s} is not divisible by {2 * cp}"
    if sequence_parallel and (s // cp) % t:
        return f"sequence parallelism with cp {cp} needs each rank's {s // cp} tokens divisible by tp {t}"
    return None


def stage_result(costs: LayoutCosts, r: int) -> StageResult:
    """Memory and per-micro-batch time of pipeline rank r."""
    config, layout, run = costs.config, costs.layout, costs.run
    t, p, v = layout.tp, layout.pp, layout.v
    stages = [virtual_stage(p, r, c, layout.v_shape) for c in range(v)]
    chunk_layers = [costs.layer_counts[vs] for vs in stages]
    n_layers = sum(chunk_layers)
    n_moe = _rank_moe_layers(costs, r)
    first, last = 0 in stages, p * v - 1 in stages  # in a V rank 0 holds both
    # CP ranks share each sequence's work evenly (causal load balancing)
    head = costs.head_flops if last else 0.0  # output layer and MTP
    flops_mb = (costs.layers_flops(n_layers, n_moe) + head) / t / layout.cp
    edges = first + last + (costs.mtp_ar if last else 0)
    collectives = (n_layers - n_moe) * costs.ar_per_layer + n_moe * costs.moe_ar_per_layer + edges if t > 1 else 0
    tp_mb = collectives * costs.ar_time
    ep_layers = n_moe + (costs.mtp_moe if last else 0)
    ep_mb = ep_layers * costs.ep_time  # the token dispatch (exposed.ep_exposure: what of it is exposed)
    local_sgd = run.local_sgd_interval > 0  # gradients reduced inside a replica only (over CP)
    st = rank_state_bytes(config, tp=t, pp=p, dp=layout.cp if local_sgd else layout.dp_cp, vpp=layout.vpp,
                          pp_rank=r, dp_rank=0, dtype=run.dtype,
                          zero_stage=layout.zero_stage, grad_dtype=run.grad_reduce_dtype, seq_length=run.seq_length,
                          ddp_bucket_size=run.ddp_bucket_size, pipeline_layers=run.pipeline_layers,
                          reshard_after_forward=run.zero_reshard_after_forward,
                          keep_params_for_step=run.zero_keep_params_for_step, ep=layout.ep, etp=layout.etp,
                          v_shape=layout.v_shape)
    if local_sgd:  # the outer parameters and their momentum, fp32 (megalite.optim.local_sgd)
        st = replace(st, optimizer=st.optimizer + 8 * st.numel)
    st = with_optimizer_choices(costs, r, st)  # Muon's matrices keep one moment, bf16 moments 2 bytes
    # Activations: in-flight chunks of this rank times the layers of an average chunk.
    chunks_in_flight = in_flight_chunks(p, r, costs.micro_batches, layout.vpp, layout.schedule,
                                        extra_warmup_of(layout, run))
    per_chunk = n_layers / v
    layers = round(per_chunk) or 1
    stored_chunk, transient = stored_activations(config, layout, run, layers, costs.act_bytes / 2.0,  # 16-bit formula
                                                 layers * n_moe / n_layers if n_moe else 0.0)
    if run.pipeline_layers is None:
        activations = chunks_in_flight * stored_chunk + transient
    else:
        activations = chunks_in_flight * stored_chunk * per_chunk / (round(per_chunk) or 1) + transient
    mtp = mtp_bytes(config, layout, run, costs.vocab) if last else 0.0
    output = output_layer_bytes(config, layout, run, costs.vocab) + mtp if last else 0.0
    overhead = costs.cluster.overhead_gib * GIB
    compute_mb = flops_mb / costs.rate
    steps = ring_transfers(costs)  # each with its start-up
    ring_mb = n_layers * (costs.ring_bytes / costs.bw_cp + steps * costs.cluster.collective_latency_ms / 1e3) \
        if layout.cp > 1 else 0.0
    return StageResult(
        state=st, n_layers=n_layers, chunk_layers=chunk_layers, flops_mb=flops_mb, tp_mb=tp_mb,
        compute_mb=compute_mb, t_mb=max(compute_mb, ring_mb) + tp_mb + costs.pp_mb + ep_mb, ring_mb=ring_mb,
        chunks_in_flight=chunks_in_flight,
        stored_chunk=stored_chunk, transient=transient, activations=activations, output=output,
        total=st.param_buffer + st.grads + st.optimizer + st.transient + activations + output + overhead,
        build=st.build_peak + overhead, moe_layers=n_moe, ep_mb=ep_mb, mtp=mtp, tp_collectives=collectives,
        tp_edge_collectives=edges if t > 1 else 0, ep_layers=ep_layers)


def _rank_moe_layers(costs: LayoutCosts, r: int) -> int:
    """MoE layers held by pipeline rank r (all its chunks)."""
    if not costs.moe_count:
        return 0
    p, v_shape = costs.layout.pp, costs.layout.v_shape
    return sum(moe_layers(costs.config, layers_of(costs.layer_counts, virtual_stage(p, r, c, v_shape)))
               for c in range(costs.layout.v))


def _extreme_ranks(costs: LayoutCosts) -> list[int]:
    """The pipeline ranks that can be the fullest or the slowest: with an even split the first, the
    second (the most in flight after the first), the last and, for a MoE model, the first with the
    most MoE layers; every rank otherwise."""
    p, run = costs.layout.pp, costs.run
    if run.pipeline_layers is None:
        ranks = {0, p - 1} | ({1} if p > 2 else set())
        if costs.moe_count:
            ranks.add(max(range(p), key=lambda r: _rank_moe_layers(costs, r)))
        return sorted(ranks)
    return list(range(p))


def predict(config: TransformerConfig, layout: Layout, cluster: Cluster, global_batch_size: int | None = None,
            seq_length: int | None = None, *, run: Run | None = None, dtype: str = "bf16",
            ddp_bucket_size: int = 40_000_000, attention_backend: str = "sdpa") -> Prediction:
    """Memory and step time of one layout (which must be valid: sizes dividing as megalite requires)."""
    if run is None:
        run = Run(global_batch_size, seq_length or config.max_position_embeddings, dtype, ddp_bucket_size,
                  attention_backend)
    check_gpt(config)
    m = _check_layout_fits_model(config, layout, run)
    costs = layout_costs(config, layout, cluster, run, m)
    stages = {r: stage_result(costs, r) for r in _extreme_ranks(costs)}
    dp_parts = {r: dp_exposed(costs, S.state, r) for r, S in stages.items()}
    time, slow, dp_stage = _step_time(costs, stages, dp_parts)
    peak_r = max(stages, key=lambda r: stages[r].total)
    memory = _memory(stages[peak_r], cluster)
    build_peak = max(S.build for S in stages.values())
    fits = memory.total <= cluster.memory_bytes and build_peak <= cluster.memory_bytes
    B, s = run.global_batch_size, run.seq_length
    return Prediction(
        layout=layout, config=config, cluster=cluster, run=run, fits=fits, memory=memory, peak_stage=peak_r,
        build_peak=build_peak, time=time, micro_batches=m,
        bubble_fraction=schedule_bubble(layout, m),
        model_flops=model_flops_per_iteration(config, B, s),
        hardware_flops=costs.hardware_flops, reason=None if fits else _why_not(memory, build_peak, cluster, peak_r),
        costs=costs, stages=stages, dp_parts=dp_parts, slow_stage=slow, dp_stage=dp_stage)


def schedule_bubble(layout: Layout, m: int) -> float:
    """The idle fraction of the layout's schedule by the papers' formulas, with a forward, an
    input-gradient and a weight-gradient pass of equal cost (the backward twice the forward):
    1F1B's (p-1)/(m+p-1), interleaved (p-1)/(vm+p-1), ZB-H1 a third of 1F1B's idle time."""
    return bubble_fraction(layout.schedule, layout.pp, m, 1.0, 1.0, 1.0, layout.vpp)


def _step_time(costs: LayoutCosts, stages: dict, dp_parts: dict) -> tuple[StepTime, int, int]:
    """(the step's time, the slowest rank, the rank with the most exposed data-parallel time)."""
    layout, m = costs.layout, costs.micro_batches
    compute = costs.hardware_flops / layout.gpus / costs.rate
    slow = max(stages, key=lambda r: stages[r].t_mb)
    T = stages[slow]
    bubble_frac = schedule_bubble(layout, m)
    bubble = bubble_frac / (1.0 - bubble_frac) * m * T.t_mb
    imbalance = max(0.0, m * T.compute_mb - compute)
    dp_stage = max(dp_parts, key=lambda r: dp_parts[r].total)
    optimizer = (max(S.state.owned_numel for S in stages.values()) * costs.traffic
                 / (costs.cluster.hbm_gbps * 1e9))
    if costs.run.muon_tp_mode:  # the Newton-Schulz GEMMs of the slowest stage
        optimizer += max(muon_seconds(costs, r) for r in stages)
    pp_comm, dp_comm = m * costs.pp_mb, dp_parts[dp_stage].total
    # what megalite overlaps, and what of it the compute hides (exposed.py)
    tp_comm, cp_comm = tp_exposure(costs, T).exposed, cp_exposure(costs, T, slow).exposed
    ep_comm = ep_exposure(costs, T, slow).exposed
    total = compute + imbalance + tp_comm + pp_comm + bubble + dp_comm + optimizer + cp_comm + ep_comm
    return (StepTime(compute, imbalance, tp_comm, pp_comm, bubble, dp_comm, optimizer, total, cp_comm, ep_comm), slow,
            dp_stage)


def _memory(stage: StageResult, cluster: Cluster) -> Memory:
    st = stage.state
    experts = st.experts.param_buffer + st.experts.grads + st.experts.optimizer if st.experts else 0.0
    return Memory(parameters=st.param_buffer, gradients=st.grads, optimizer=st.optimizer,
                  activations=stage.activations, output_layer=stage.output, overhead=cluster.overhead_gib * GIB,
                  total=stage.total, zero_transient=st.transient, experts=experts, mtp=stage.mtp)


def _why_not(memory: Memory, build_peak: float, cluster: Cluster, peak_r: int) -> str:
    capacity = cluster.memory_bytes
    if memory.total >= build_peak:
        out_part = f", output layer {memory.output_layer / GIB:.1f}" if memory.output_layer else ""
        zero_part = f", ZeRO transient {memory.zero_transient / GIB:.1f}" if memory.zero_transient else ""
        return (f"does not fit: {over(memory.total, capacity)} GiB > {cluster.gpu_memory_gib:g} GiB "
                f"(activations {memory.activations / GIB:.1f}{out_part}, parameters + gradients + "
                f"optimizer {memory.states / GIB:.1f}{zero_part} GiB, stage {peak_r})")
    return (f"does not fit while the model is built: {over(build_peak, capacity)} GiB > "
            f"{cluster.gpu_memory_gib:g} GiB (fp32 model + buffers)")


def with_zero_stage(layout: Layout, stage: int) -> Layout:
    """The same layout at another ZeRO stage."""
    return replace(layout, distributed_optimizer=stage >= 1, zero_stage=stage)


def stage_that_makes_it_fit(pred: Prediction) -> int | None:
    """For a fitting layout at ZeRO stage 2 or 3: its stage, when the same layout at every lower
    stage does not fit (the stage is what makes it fit); else None."""
    stage = pred.layout.zero_stage
    if not pred.fits or stage < 2:
        return None
    for lower in range(stage):
        if predict(pred.config, with_zero_stage(pred.layout, lower), pred.cluster, run=pred.run).fits:
            return None
    return stage
