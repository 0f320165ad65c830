"""Communication: which links each kind of group crosses and at what bandwidth, the bytes the
context-parallel ring sends, and data parallelism's bytes per step and the seconds of them that do
not hide behind backward (stages 0-3, local SGD)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from megalite.models.config import TransformerConfig
from megalite.pipeline.partition import layers_of, virtual_stage
from megalite.pipeline.schedules import build_program
from megalite.tools.plan.costs import LayoutCosts
from megalite.tools.plan.experts import expert_group_crosses_nodes, moe_layers
from megalite.tools.plan.gather_play import overlapped_gather_seconds
from megalite.tools.plan.inputs import DTYPE_BYTES, Cluster, Layout
from megalite.tools.plan.overlap import link_schedule, ready_times
from megalite.tools.plan.states import StateBytes


def ring_layer_parts(config: TransformerConfig, layout: Layout, s: int, act_bytes: int) -> dict[str, int]:
    """Bytes one rank sends around the context-parallel ring for one layer and micro-batch, by pass
    (`megalite.parallel.context_parallel.ring_bytes_per_layer`: K/V blocks of this TP rank's KV
    groups in the model dtype, dK/dV in fp32)."""
    from megalite.parallel.context_parallel import ring_bytes_per_layer

    groups = max(1, (config.num_query_groups or config.num_attention_heads) // layout.tp)
    # MLA: every head's key and (padded to its width) value go around, d_n + d_r wide
    width = config.qk_head_dim + config.qk_pos_emb_head_dim if config.multi_latent_attention else config.head_dim
    return ring_bytes_per_layer(layout.micro_batch_size, groups, s // layout.cp, width, layout.cp, act_bytes, 4)


def ring_layer_bytes(config: TransformerConfig, layout: Layout, s: int, act_bytes: int) -> float:
    """All of `ring_layer_parts`; full recomputation runs the forward's ring again."""
    ring = ring_layer_parts(config, layout, s, act_bytes)
    return ring["total"] + (ring["forward"] if layout.recompute == "full" else 0)


# Placement: which links a group's ring crosses (rank = pp_rank * dp * tp + dp_rank * tp + tp_rank)
@functools.lru_cache(maxsize=4096)
def crosses_nodes(kind: str, tp: int, pp: int, dp: int, gpus_per_node: int, cp: int = 1) -> bool:
    """Whether any group of this kind (tp, cp, dp, pp, embedding) spans more than one node. Rank
    order: tensor fastest, then context, data, pipeline; the gradients' "dp" group is DP x CP."""
    g, stage = gpus_per_node, tp * cp * dp  # ranks of one pipeline stage

    def spans(ranks) -> bool:
        return ranks[0] // g != ranks[-1] // g  # ranks increase along each group

    if kind == "tp":
        return any(spans([s, s + tp - 1]) for s in range(0, tp * cp * pp * dp, tp))
    if kind == "cp":
        return any(spans([p * stage + d * cp * tp + t, p * stage + d * cp * tp + (cp - 1) * tp + t])
                   for p in range(pp) for d in range(dp) for t in range(tp))
    if kind == "dp":
        return any(spans([p * stage + t, p * stage + (dp * cp - 1) * tp + t]) for p in range(pp) for t in range(tp))
    # pp or embedding (first and last stage of each pipeline)
    return any(spans([k * tp + t, (pp - 1) * stage + k * tp + t]) for k in range(dp * cp) for t in range(tp))


def bandwidth(cluster: Cluster, kind: str, layout: Layout) -> float:
    """Bytes/s of the slowest link a group of this kind uses (expert groups: "ep", "etp", "etp_ep", "edp")."""
    if kind in ("ep", "etp", "etp_ep", "edp"):
        inter = expert_group_crosses_nodes(kind, layout.tp * layout.cp * layout.dp, layout.pp, layout.ep, layout.etp,
                                           cluster.gpus_per_node)
    else:
        inter = crosses_nodes(kind, layout.tp, layout.pp, layout.dp, cluster.gpus_per_node, layout.cp)
    return (cluster.inter_node_gbps if inter else cluster.intra_node_gbps) * 1e9


@dataclass
class DataParallelTime:
    """Data-parallel seconds on one pipeline rank that do not hide behind backward."""
    overlapped: float = 0.0  # gradient reductions finishing after the backward that waits for them
    embedding: float = 0.0  # the tied embedding, reduced after the schedule
    all_gather: float = 0.0  # stages 1-2: the updated parameters' all-gather after the step
    gathers: float = 0.0  # stage 3: the units' all-gathers that layer compute does not hide
    outer: float = 0.0  # local SGD: the outer all-reduce's seconds, averaged over the H steps of a round
    total: float = 0.0
    windows: list = field(default_factory=list)  # per chunk: (chunk, backward start, end, reduce, last bucket)
    traffic: dict = field(default_factory=dict)  # bytes this rank sends per step, by collective (dp_traffic)


def dp_traffic(stage: int, padded: int, dp: int, micro_batches: int, param_bytes: int, comm_bytes: int,
               reshard_after_forward: bool = True, keep_params_for_step: bool = False,
               forward_gathers: int | None = None, turn_kept: int = 0) -> dict[str, float]:
    """Bytes one rank sends per step over data parallelism (ring volumes: (n-1)/n of each
    reduce-scatter's input and all-gather's output, twice that for an all-reduce), for a rank whose
    buffers hold `padded` elements and run m micro-batches. Stage 0: one all-reduce of the
    gradients; 1: a reduce-scatter and, after the step, an all-gather of the parameters; 2: a
    reduce-scatter per backward (m) and the all-gather; 3: per micro-batch an all-gather before
    forward, another before backward (not when the forward keeps them) and a reduce-scatter, no
    all-gather after the step (one gather per step when kept for the step). Kept from forward to
    backward, a unit is gathered by a forward only when none of its forwards awaits its backward:
    `forward_gathers` times a step (`forward_gathers`; m without a pipeline, fewer in 1F1B's).
    `turn_kept`: elements the step's turns keep whole rather than gather again (`turn_kept`)."""
    ring = (dp - 1) / dp
    grads, params = ring * padded * comm_bytes, ring * padded * param_bytes
    m = micro_batches
    if stage == 0:
        return {"all_reduce": 2 * grads, "reduce_scatter": 0.0, "all_gather": 0.0}
    if stage in (1, 2):
        return {"all_reduce": 0.0, "reduce_scatter": (m if stage == 2 else 1) * grads, "all_gather": params}
    if keep_params_for_step:
        gathers = 1
    elif reshard_after_forward:
        gathers = 2 * m
    else:
        gathers = m if forward_gathers is None else forward_gathers
    return {"all_reduce": 0.0, "reduce_scatter": m * grads,
            "all_gather": gathers * params - ring * turn_kept * param_bytes}


def turn_kept(kinds: str, sizes: list[int], layers: set[int], pre: bool) -> tuple[int, int]:
    """Stage 3 with one chunk a rank (megalite.optim.zero3's turns): (elements, units) a step's
    passes `kinds` ("F"/"B" in program order) find whole because the pass before ended with them.
    Units are layers last first, then the others (`sizes`, `layers` the layers' indices). A forward
    ends with the last layer and the others, a backward with the first layer and, on the chunk with
    the embeddings (`pre`), the others; a forward begins with the others and the first layer, a
    backward with the others and the last layer."""
    if not layers:
        return 0, 0
    rest = set(range(len(sizes))) - layers
    last, first = min(layers), max(layers)
    ends = {"F": rest | {last}, "B": {first} | (rest if pre else set())}
    begins = {"F": rest | {first}, "B": rest | {last}}
    kept = [ends[a] & begins[b] for a, b in zip(kinds, kinds[1:])]
    return sum(sizes[i] for units in kept for i in units), sum(len(units) for units in kept)


def _turns(costs: LayoutCosts, r: int) -> str:
    """Rank r's forwards and backwards in a step, in order, where stage 3 keeps units at turns (one
    chunk a rank, resharding after forward), else ""."""
    layout, run = costs.layout, costs.run
    if layout.zero_stage != 3 or (layout.vpp or 1) != 1 or layout.v_shape or not run.zero_reshard_after_forward \
            or run.zero_keep_params_for_step:
        return ""
    return _pass_kinds(layout.pp, r, costs.micro_batches, layout.schedule)


@functools.lru_cache(maxsize=4096)
def _pass_kinds(p: int, r: int, m: int, schedule: str) -> str:
    """The F and B ops of rank r's one-chunk program, in order (the planner's search asks often)."""
    return "".join(op.kind for op in build_program(p, r, m, None, schedule) if op.kind in "FB")


def dp_exposed(costs: LayoutCosts, state: StateBytes, r: int) -> DataParallelTime:
    """Data-parallel time on pipeline rank r that does not hide behind compute, and its bytes.

    Stages 0-1: buckets reduce during each chunk's last backward of the step (one stream, in
    order): chunk c's last backward ends c*p backward passes (of one chunk) before the schedule
    does, so with interleaving the later chunks' buckets have more time. Each bucket starts once
    backward has completed it and the stream is free, and pays the cluster's collective latency
    (overlap.py: the small first buckets of megalite.optim.bucket_plan start early). The tied embedding (pp > 1) is reduced after the schedule: over the
    embedding group, then over dp like the other buckets. Stages 1-2 all-gather the updated
    parameters after the step (with --overlap-param-gather, behind the next forward: gather_play.py).
    Stages 2-3 reduce-scatter in every backward, which waits for them at its end; stage 3 also
    all-gathers each unit before it is used (see zero3_exposed)."""
    layout, run = costs.layout, costs.run
    if run.local_sgd_interval:
        return local_sgd_exposed(costs, state, r)
    p, d, stage = layout.pp, layout.dp_cp, layout.zero_stage
    pb = DTYPE_BYTES[run.dtype]
    out = DataParallelTime()
    gathers = forward_gathers(p, r, costs.micro_batches, layout.vpp, layout.schedule)
    kinds, pre = _turns(costs, r), virtual_stage(p, r, 0, layout.v_shape) == 0
    sizes = [[b.end - b.start for b in chunk] for chunk in state.buckets]
    kept = [turn_kept(kinds, s, state.layer_buckets[c], pre) if kinds else (0, 0) for c, s in enumerate(sizes)]
    per_chunk = [dp_traffic(stage, sum(s), d, costs.micro_batches, pb, state.comm_bytes,
                            run.zero_reshard_after_forward, run.zero_keep_params_for_step, gathers[c], kept[c][0])
                 for c, s in enumerate(sizes)]
    edp = state.edp  # expert weights: their own buffers, over the expert-data-parallel group
    for c, chunk in enumerate(state.expert_buckets):
        if chunk and edp > 1:
            s = [b.end - b.start for b in chunk]
            experts_kept = turn_kept(kinds, s, state.experts.layer_buckets[c], False)[0] if kinds else 0
            per_chunk.append(dp_traffic(stage, sum(s), edp, costs.micro_batches, pb, state.comm_bytes,
                                        turn_kept=experts_kept))
    if d > 1:  # what the turns keep is not gathered: the exposed gathers at each pass's start (zero3_exposed)
        out.gathers -= sum(n * costs.cluster.collective_latency_ms / 1e3 + (d - 1) / d * numel * pb / costs.bw_dp
                           for numel, n in kept)
    out.traffic = {k: sum(x[k] for x in per_chunk) for k in per_chunk[0]}
    if d == 1 and edp == 1 and not (p > 1 and r in (0, p - 1)):
        return out
    if stage >= 2:
        _sharded_grads_exposed(costs, state, r, out)
    else:
        _bucket_reduction_exposed(costs, state, r, out)
    expert_padded = sum(b.end - b.start for chunk in state.expert_buckets for b in chunk)
    latency = costs.cluster.collective_latency_ms / 1e3  # one per bucket's all-gather
    if 1 <= stage <= 2 and run.overlap_param_gather:  # behind the next forward (gather_play.py)
        out.all_gather = overlapped_gather_seconds(costs, state, r)
    elif 1 <= stage <= 2:
        if d > 1:
            out.all_gather = (d - 1) / d * (state.padded_numel - expert_padded) * pb / costs.bw_dp \
                + latency * sum(len(chunk) for chunk in state.buckets)  # (the tied copy's bucket too)
        if edp > 1:
            out.all_gather += (edp - 1) / edp * expert_padded * pb / costs.bw_edp \
                + latency * sum(len(chunk) for chunk in state.expert_buckets)
    out.total = out.overlapped + out.embedding + out.all_gather + out.gathers
    return out


def outer_sync_bytes(numel: int, dp: int, outer_bytes: int) -> float:
    """Bytes one rank sends in one outer synchronization of local SGD (all its fragments): a ring
    all-reduce of its parameters' pseudo-gradients, 2 (n-1)/n x elements x bytes."""
    return 2 * (dp - 1) / dp * numel * outer_bytes


def local_sgd_exposed(costs: LayoutCosts, state: StateBytes, r: int) -> DataParallelTime:
    """Local SGD (--local-sgd-interval H): no per-step gradient reduction across replicas (CP
    ranks, inside a replica, are not modelled); the outer all-reduce of the pseudo-gradients, once
    per H steps (1/F of it every H/F steps with F fragments: the same bytes per step), is exposed
    when synchronous and hidden behind the next inner steps when async (assumed to fit in them).
    The tied embedding (pp > 1) is still summed over its two stages every step, and an expert's
    copies inside a replica (etp x ep below tp x cp) all-reduce their gradients every step, exposed,
    on the tensor-parallel link."""
    layout, run = costs.layout, costs.run
    h, d = run.local_sgd_interval, layout.dp
    out = DataParallelTime()
    per_sync = outer_sync_bytes(state.numel, d, DTYPE_BYTES[run.outer_grad_dtype])
    out.traffic = {"outer_all_reduce": per_sync / h}
    copies = layout.tp * layout.cp // (layout.ep * layout.etp)  # an expert's copies inside a replica
    expert_padded = sum(b.end - b.start for chunk in state.expert_buckets for b in chunk)
    if copies > 1 and expert_padded:
        expert_bytes = 2 * (copies - 1) / copies * expert_padded * state.comm_bytes  # a ring all-reduce
        out.traffic["all_reduce"] = expert_bytes
        out.overlapped = expert_bytes / costs.bw_tp
    if d > 1 and not run.local_sgd_async:
        out.outer = per_sync / costs.bw_dp / h
    deferred = [b.end - b.start for chunk in state.buckets for b in chunk if b.deferred]
    if deferred and layout.pp > 1 and r in (0, layout.pp - 1) and not layout.v_shape:
        out.embedding = sum(deferred) * 4 / costs.bw_emb
    out.total = out.outer + out.embedding + out.overlapped
    return out


def _chunk_backward_parts(costs: LayoutCosts, c: int, r: int) -> tuple[float, float]:
    """One micro-batch's backward of rank r's chunk c: (the output layer's part, on the last stage,
    which comes first; the layers' part)."""
    p, v, t = costs.layout.pp, costs.layout.v, costs.layout.tp
    vs = virtual_stage(p, r, c, costs.layout.v_shape)
    layers = costs.layer_counts[vs]
    n_moe = moe_layers(costs.config, layers_of(costs.layer_counts, vs)) if costs.moe_count else 0
    backward = (layers - n_moe) * costs.bwd + n_moe * costs.moe_bwd
    post = vs == p * v - 1
    return (2 * costs.logits_fwd + costs.mtp_bwd if post else 0.0) / t / costs.rate, backward / t / costs.rate


def _chunk_backward_seconds(costs: LayoutCosts, c: int, r: int) -> float:
    """One micro-batch's backward of rank r's chunk c (with the output layer's on the last stage)."""
    return sum(_chunk_backward_parts(costs, c, r))


def _bucket_jobs(costs: LayoutCosts, state: StateBytes, c: int, r: int, begin: float,
                 factor: float, expert_factor: float, deferred: bool = False) -> list[tuple[float, float]]:
    """(ready time, seconds of transfer) of chunk c's buckets, dense over DP and expert over EDP,
    for a backward starting at `begin` (overlap.py's model); the deferred ones too if `deferred`."""
    head, layers = _chunk_backward_parts(costs, c, r)
    cb, edp = state.comm_bytes, state.edp
    jobs = []
    for buckets, ready, per_elem in ((state.buckets[c], state.bucket_ready[c], factor * cb / costs.bw_dp),
                                     (state.expert_buckets[c], state.expert_ready[c],
                                      expert_factor * cb / costs.bw_edp if edp > 1 else 0.0)):
        if per_elem == 0.0:
            continue
        at = ready_times(ready, begin, head, layers)
        jobs += [(t, (b.end - b.start) * per_elem) for b, t in zip(buckets, at) if deferred or not b.deferred]
    return jobs


def _bucket_reduction_exposed(costs: LayoutCosts, state: StateBytes, r: int, out: DataParallelTime) -> None:
    """Stages 0-1: the step's one reduction, during each chunk's last backward: each bucket is
    reduced once complete and the stream is free (overlap.py), a MoE chunk's expert buckets over
    EDP on the same stream; what runs past the schedule's end (time 0) is exposed."""
    layout = costs.layout
    p, v, d, edp = layout.pp, layout.v, layout.dp_cp, state.edp
    reduce_factor = (1 if layout.distributed_optimizer else 2) * (d - 1) / d  # reduce-scatter vs all-reduce
    expert_factor = (1 if layout.distributed_optimizer else 2) * (edp - 1) / edp
    latency = costs.cluster.collective_latency_ms / 1e3
    jobs = []
    for c in reversed(range(v)):  # chunk v-1's last backward comes first
        tb = _chunk_backward_seconds(costs, c, r)
        end = -c * p * tb  # chunk c's last backward ends c*p chunk-backwards before the schedule
        chunk_jobs = _bucket_jobs(costs, state, c, r, end - tb, reduce_factor if d > 1 else 0.0, expert_factor)
        if chunk_jobs:
            jobs += chunk_jobs
            out.windows.append((c, end - tb, end, sum(s for _, s in chunk_jobs), chunk_jobs[-1][1]))
    out.overlapped = max(0.0, link_schedule(jobs, latency)) if jobs else 0.0
    deferred = [b.end - b.start for chunk in state.buckets for b in chunk if b.deferred]
    if deferred:  # in a V both copies are on rank 0: summed there, no embedding-group traffic
        n, cb = sum(deferred), state.comm_bytes
        across = 0.0 if layout.v_shape else latency + n * 4 / costs.bw_emb
        out.embedding = across + (latency + n * cb * reduce_factor / costs.bw_dp if d > 1 else 0.0)


def _sharded_grads_exposed(costs: LayoutCosts, state: StateBytes, r: int, out: DataParallelTime) -> None:
    """Stages 2-3: every backward of every chunk reduce-scatters its buckets as they fill (the
    deferred tied copy among them) and waits for them when it ends: per backward, what runs past
    it (overlap.py's stream; stage 3: the last unit's and a layer's, and its gathers). The tied
    embedding's shard is summed over the embedding group after the schedule."""
    layout = costs.layout
    p, v, d, m = layout.pp, layout.v, layout.dp_cp, costs.micro_batches
    rs = (d - 1) / d * state.comm_bytes / costs.bw_dp  # seconds per element reduce-scattered
    edp = state.edp
    rs_experts = (edp - 1) / edp * state.comm_bytes / costs.bw_edp if edp > 1 else 0.0
    for c in range(v):
        tb = _chunk_backward_seconds(costs, c, r)
        sizes = [b.end - b.start for b in state.buckets[c]]
        experts = sum(b.end - b.start for b in state.expert_buckets[c]) * rs_experts  # MoE: over EDP too
        if (d > 1 and sizes) or experts:
            dense = sum(sizes) * rs if d > 1 else 0.0
            last = sizes[-1] * rs if d > 1 and sizes else (state.expert_buckets[c][-1].end - state.expert_buckets[c][-1].start) * rs_experts
            if layout.zero_stage == 3:  # units' reductions overlap the layers' backward (zero3_exposed):
                forward, backward = zero3_exposed(costs, state, c, r)  # the last two stay in flight at its end
                out.gathers += _gathering_forwards(costs, r, c) * forward + m * backward
                layer = max((sizes[i] for i in state.layer_buckets[c]), default=0)
                wait = (sizes[-1] + layer) * rs + 2 * costs.cluster.collective_latency_ms / 1e3
            else:  # each bucket once complete and the stream free; the backward's end (0) waits
                jobs = _bucket_jobs(costs, state, c, r, -tb, 1.0 - 1 / d, 1.0 - 1 / edp, deferred=True)
                wait = max(0.0, link_schedule(jobs, costs.cluster.collective_latency_ms / 1e3))
            out.windows.append((c, -tb, 0.0, dense + experts, last))
            out.overlapped += m * wait
    deferred = [b.end - b.start for chunk in state.buckets for b in chunk if b.deferred]
    if deferred and p > 1 and not layout.v_shape:  # a V sums its two copies on rank 0
        out.embedding = costs.cluster.collective_latency_ms / 1e3 + sum(deferred) // d * state.grad_bytes / costs.bw_emb


@functools.lru_cache(maxsize=4096)
def forward_gathers(p: int, r: int, m: int, vpp: int | None, schedule: str = "1f1b") -> tuple[int, ...]:
    """Per model chunk of pipeline rank r: the forwards of a step that find none of the chunk's
    earlier forwards awaiting its backward (read off the schedule program): what gathers a ZeRO-3
    unit kept from forward to backward (`--zero-reshard-after-forward false`)."""
    live, count = [0] * (vpp or 1), [0] * (vpp or 1)
    program = build_program(p, r, m, vpp, schedule)
    done = "W" if any(op.kind == "W" for op in program) else "B"  # a unit is held until its gradients are in
    for op in program:
        if op.kind == "F":
            count[op.chunk] += live[op.chunk] == 0
            live[op.chunk] += 1
        elif op.kind == done:
            live[op.chunk] -= 1
    return tuple(count)


def zero3_exposed(costs: LayoutCosts, state: StateBytes, c: int, r: int) -> tuple[float, float]:
    """Stage 3, chunk c: (seconds of a gathering forward, of a backward) that compute does not hide
    (a forward that finds its units gathered exposes nothing: _gathering_forwards). The chunk's other
    units (embeddings, final norm, output layer) are gathered and waited for before its forward and
    again before its backward, and the first layer with them; every later layer's gather is
    prefetched while the layer before it computes (forward), or while the layer after it runs its
    backward, whose own reduce-scatter shares the link (backward). Each gather and reduce-scatter
    pays the collective latency."""
    layout, run = costs.layout, costs.run
    d, t = layout.dp_cp, layout.tp
    pb = DTYPE_BYTES[run.dtype]
    ring = (d - 1) / d / costs.bw_dp
    layers = [b.end - b.start for i, b in enumerate(state.buckets[c]) if i in state.layer_buckets[c]]
    others = sum(b.end - b.start for i, b in enumerate(state.buckets[c]) if i not in state.layer_buckets[c])
    layer = max(layers, default=0)
    lat = costs.cluster.collective_latency_ms / 1e3 if d > 1 else 0.0  # each unit's gather and reduce-scatter
    n_others = len(state.buckets[c]) - len(layers)
    g_layer, g_other = lat + ring * layer * pb, n_others * lat + ring * others * pb
    rs_layer = lat + ring * layer * state.comm_bytes
    f, b = costs.fwd / t / costs.rate, costs.bwd / t / costs.rate
    n = len(layers)
    forward = g_other + (g_layer + (n - 1) * max(0.0, g_layer - f) if n else 0.0)
    regather = run.zero_reshard_after_forward and not run.zero_keep_params_for_step
    backward = (g_other + g_layer if regather and n else g_other if regather else 0.0)
    if n > 1:
        backward += (n - 1) * max(0.0, (g_layer if regather else 0.0) + rs_layer - b)
    return forward, backward


def _gathering_forwards(costs: LayoutCosts, r: int, c: int) -> int:
    """Forwards of chunk c in a step that gather its units (stage 3)."""
    layout, run, m = costs.layout, costs.run, costs.micro_batches
    if run.zero_keep_params_for_step:
        return 1
    if run.zero_reshard_after_forward:
        return m
    return forward_gathers(layout.pp, r, m, layout.vpp, layout.schedule)[c]
