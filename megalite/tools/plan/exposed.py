"""Exposed communication per parallel dimension: the exchanges a step makes on one rank, what they
cost, and how much of that the compute megalite overlaps them with leaves on the step.

Every exchange (a collective, an all-to-all, one batch of point-to-point sends) costs the cluster's
`collective_latency_ms` plus its bytes over the slowest link its group spans: the latency is what a
small exchange costs beyond its bytes (tens of microseconds on NVLink / InfiniBand; 3-4 ms on
docs/slow-links.md's emulated link). Compute per pass is the planner's (FLOPs over the sustained
rate). What megalite overlaps, and so each dimension's formula (docs/planner.md, "Exposed
communication"):
- tp: all exposed, except with --tp-comm-overlap under sequence parallelism, where each layer
  collective is a ring of t-1 shard transfers, each behind one shard GEMM, or with
  --tp-comm-overlap-splits k in k pieces, each piece multiplied as it arrives (tp_overlap.py);
- cp: each ring transfer behind one attention block (backward: the K/V block and the dK/dV block
  each behind one block's backward, half the own block's at the ends; context_parallel.py); with
  --overlap-moe-expert-parallel-comm, what is left also behind the other pass of a pair;
- ep: all exposed (the dispatcher waits for its all-to-alls), or with the
  --overlap-moe-expert-parallel-comm option the pairs of megalite.parallel.lanes played
  (pair_play.py): each exchange behind the other pass's compute up to its next exchange, the first
  forward and the last backward alone; with --moe-dispatch-chunks a pass alone played with its
  layers' experts in groups (chunk_play.py);
- pp: the schedule played with each boundary transfer (pipeline_play.py), a message moving once
  its receive is posted where the executor's plan posts it: what lies on its path;
- dp: the gradient buckets during backward, ZeRO-3's gathers prefetched behind the layer before
  (comm.py's model, which `dp_exposed` works out for the step time)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megalite.metrics import layer_forward_flops
from megalite.tools.plan.costs import LayoutCosts
from megalite.pipeline.partition import layers_of
from megalite.pipeline.programs import PAIRED_SCHEDULES, build_program
from megalite.tools.plan.experts import moe_layers
from megalite.tools.plan.inputs import extra_warmup_of
from megalite.tools.plan.chunk_play import chunked_alone_exposed
from megalite.tools.plan.pair_play import Bucket, alone_exposed, pair_exposed
from megalite.tools.plan.pipeline_play import exposed_transfers
from megalite.tools.plan.ring_items import ring_pair_items, ring_step_seconds, ring_steps, ring_transfers
from megalite.tools.plan.tp_linears import linear_shares, per_exchange

# predict imports this module, so its types are named here, not imported: a stage is a
# predict.StageResult, a prediction a predict.Prediction.
StageResult = Prediction = Any

DIMENSIONS = ("tp", "cp", "ep", "pp", "dp")


@dataclass(frozen=True)
class Exposure:
    """One dimension's communication in one step, on the rank where it is longest."""
    exchanges: int  # collectives / all-to-alls / batches of sends a step
    bytes: float  # sent per step
    comm: float  # seconds: exchanges x latency + bytes over the link
    exposed: float  # seconds of it the step waits for
    behind: str  # what megalite overlaps it with
    # seconds of `exposed` by phase of a paired program (ep, cp: "forwards alone", "backwards alone",
    # "pairs"; `_played`), where the dimension plays one
    phases: dict = field(default_factory=dict)

    @property
    def hidden(self) -> float | None:
        return 1.0 - self.exposed / self.comm if self.comm > 0 else None


def _splits_backward(layout) -> bool:
    """A zero-bubble schedule: weight gradients in W passes of their own, not in the backward."""
    return layout.pp > 1 and layout.schedule in ("zb-h1", "zb-v", "dualpipev")


def _latency(costs: LayoutCosts) -> float:
    return costs.cluster.collective_latency_ms / 1e3


def tp_exposure(costs: LayoutCosts, stage: StageResult) -> Exposure:
    """Tensor parallelism on `stage` over the step's m micro-batches. A collective is an all-reduce
    (one exchange, 2(t-1)/t of s*b*h sent) or, with SP, an all-gather and a reduce-scatter ((t-1)/t
    each). With --tp-comm-overlap (SP only) each layer exchange is t-1 ring steps of a 1/t shard, each
    behind the GEMM of one shard of its own linear (G: the linear's FLOPs over t ranks, over t
    shards; each linear's exposure apart: tp_linears.py). With --tp-comm-overlap-splits k each shard travels and
    is multiplied in k pieces, a piece passed on and multiplied as soon as it arrives: the t shard
    GEMMs (t G) then end at the latest when the last piece has arrived, (t-1) shard transfers after
    the start (T each, k exchanges' latency in it), plus one piece's GEMM (G / k). So a layer exchange
    exposes max(0, (t-1) T + G / k - t G); at k = 1 that is (t-1) (T - G), one step's rest each.
    A column layer's backward (QKV's, and fc1's in a dense layer) also runs its weight's GEMM (t G)
    while its last sums travel (tp_overlap.reduce_scatter_rows' `meanwhile`), unless a zero-bubble
    schedule defers it to a W pass: that exchange exposes t G less."""
    layout, m, t = costs.layout, costs.micro_batches, costs.layout.tp
    if t == 1:
        return Exposure(0, 0.0, 0.0, 0.0, "")
    sp, lat = layout.sequence_parallel, _latency(costs)
    per = 2 if sp else 1  # exchanges per collective
    n = stage.tp_collectives
    sent = m * n * 2 * (t - 1) / t * costs.ar_bytes
    comm = m * n * costs.ar_time
    if not (sp and costs.run.tp_comm_overlap):
        return Exposure(m * n * per, sent, comm, comm, "nothing (megalite waits for each)")
    layer_colls = stage.tp_collectives - stage.tp_edge_collectives
    k = costs.run.tp_comm_overlap_splits
    gemms = [share * (costs.fwd - costs.core) / t / t / costs.rate for share in linear_shares(costs.config)]
    shard_gemm = sum(gemms) / 4
    step = k * lat + costs.ar_bytes / t / costs.bw_tp  # one shard's transfer, in k pieces
    forward, row, column, beside = per_exchange(lambda g: (t - 1) * step + g / k - t * g, gemms, t)
    split = _splits_backward(layout)
    beside_weight = 0 if split else 2 * (stage.n_layers - stage.moe_layers) + stage.moe_layers
    overlapped = (layer_colls * (forward + row / 2) + max(0.0, layer_colls / 2 - beside_weight) * column
                  + beside_weight * beside)
    exposed = m * (overlapped + stage.tp_edge_collectives * costs.ar_time)
    comm = m * (layer_colls * 2 * (t - 1) * step + stage.tp_edge_collectives * costs.ar_time)
    behind = f"each shard transfer behind one shard GEMM ({shard_gemm * 1e3:.3f} ms)"
    if k > 1:
        behind = f"each shard's {k} pieces behind the shard GEMMs, each piece multiplied as it arrives"
    return Exposure(m * (layer_colls * 2 * (t - 1) * k + stage.tp_edge_collectives * per), sent, comm, exposed,
                    behind)


def cp_exposure(costs: LayoutCosts, stage: StageResult, rank: int = 0) -> Exposure:
    """The ring on `stage` (pipeline rank `rank`): a forward step sends a K/V block behind one
    attention block, the attention core of this rank's queries against one of the cp blocks of
    keys. A backward step sends the K/V block again and then the held block's dK/dV, each behind one
    block's backward (twice the block's forward over half its rows: the other blocks, and the own
    block cut in two halves, one at each end of the ring: megalite.parallel.context_parallel). With
    --overlap-moe-expert-parallel-comm each ring wait hands the turn to the other pass of a pair as
    an all-to-all's does: the pairs played (pair_play.py) with `ring_items.ring_pair_items`, as
    ep_exposure's."""
    layout, m = costs.layout, costs.micro_batches
    if layout.cp == 1:
        return Exposure(0, 0.0, 0.0, 0.0, "")
    fwd_steps, bwd_steps = ring_steps(costs)
    blocks, f_step, (kv_step, dkv_step) = ring_step_seconds(costs)
    block, piece = blocks
    per_layer = fwd_steps * f_step + bwd_steps * (kv_step + dkv_step)
    exposed_layer = (fwd_steps * max(0.0, f_step - block)
                     + bwd_steps * (max(0.0, kv_step - piece) + max(0.0, dkv_step - piece)))
    layers = stage.n_layers
    exposed = m * layers * exposed_layer
    behind = f"each transfer behind one attention block ({block * 1e3:.3f} ms forward, {piece * 1e3:.3f} backward)"
    counts = pass_counts(costs, rank) if costs.run.overlap_moe_ep_comm else None
    phases: dict = {}
    if counts is not None:
        forward, backward = ring_pair_items(costs, stage, blocks, f_step, (kv_step, dkv_step))
        exposed, phases = _played(counts, forward, backward, layout.v)
        behind += ", then the other pass's compute up to its next exchange (pairs)"
    return Exposure(m * layers * ring_transfers(costs), m * layers * costs.ring_bytes, m * layers * per_layer,
                    exposed, behind, phases)


def ep_exposure(costs: LayoutCosts, stage: StageResult, rank: int = 0) -> Exposure:
    """The token dispatch on `stage` (pipeline rank `rank`): per MoE layer and micro-batch
    `costs.ep_exchanges` exchanges (dispatch and combine forward and backward, the counts'
    all-gather) taking `costs.ep_time`. All exposed; with the overlap option, the rank's paired
    program (`pass_counts`) runs some forwards beside backwards, each such pair played by
    pair_play.py with the items of `pair_items`, the other passes' exchanges exposed. A pass runs
    one of the rank's v chunks: 1/v of the stage's items."""
    m, layers = costs.micro_batches, stage.ep_layers
    if not layers or not costs.ep_exchanges:
        return Exposure(0, 0.0, 0.0, 0.0, "")
    comm = m * layers * costs.ep_time
    sent = m * layers * (costs.ep_bytes + costs.etp_bytes)
    groups = dispatch_groups(costs)
    counts = pass_counts(costs, rank) if costs.run.overlap_moe_ep_comm else None
    if groups > 1:  # each group's exchange pays the latency (the passes in pairs excepted: they go whole)
        e = ep_parts(costs, stage)
        # micro-batches sent in groups: all, or those whose forward runs alone (a pass: 1/v of the layers)
        chunked = m if counts is None else counts[1] / costs.layout.v
        extra = round(chunked * layers * 2 * (e.half_f + e.half_b) * (groups - 1))
        comm, exchanges = comm + extra * e.lat, m * layers * costs.ep_exchanges + extra
        if counts is None:
            exposed = m * (chunked_alone_exposed(e, groups, "F") + chunked_alone_exposed(e, groups, "B"))
            return Exposure(exchanges, sent, comm, exposed, "each group's experts beside the next group's exchange")
    else:
        exchanges = m * layers * costs.ep_exchanges
    wgrad = wgrad_share(costs) if groups == 1 else 0.0  # (weight gradients beside groups: not played)
    bucket, v = link_bucket(costs), costs.layout.v
    if not costs.run.overlap_moe_ep_comm or counts is None:
        why = "megalite waits for each" if not costs.run.overlap_moe_ep_comm else "this schedule has no pairs"
        if not wgrad and not bucket.burst:
            return Exposure(exchanges, sent, comm, comm, f"nothing ({why})")
        # every pass alone: each backward but each chunk's last fills its waits with its own W; a
        # bucket shortens the exchanges after compute
        exposed, phases = _played((0, m * v, m * v), *pair_items(costs, stage), v, wgrad, bucket)
        behind = "the backward's own weight gradients" if wgrad else f"nothing ({why})"
        return Exposure(exchanges, sent, comm, exposed, behind, phases)
    forward, backward = pair_items(costs, stage)
    exposed, phases = _played(counts, forward, backward, v, wgrad, bucket)
    if groups > 1:  # a forward alone goes in groups (its backward, in a pair, is played whole)
        grouped = counts[1] * (chunked_alone_exposed(e, groups, "F") - alone_exposed(forward, 0.0, bucket)) / v
        exposed += grouped
        phases["forwards alone"] += grouped
    return Exposure(exchanges, sent, comm, exposed,
                    "the other lane's compute up to its next exchange (a forward beside a backward)", phases)


def dispatch_groups(costs: LayoutCosts) -> int:
    """The groups a MoE layer's exchanges go in (--moe-dispatch-chunks, as the dispatcher takes it)."""
    config, layout = costs.config, costs.layout
    if layout.ep == 1 or config.moe_token_dispatcher_type == "allgather":
        return 1
    return max(1, min(costs.run.moe_dispatch_chunks, config.num_moe_experts // layout.ep))


def _played(counts: tuple[int, int, int], forward: list, backward: list, v: int, wgrad: float = 0.0,
            bucket: Bucket = Bucket()) -> tuple[float, dict]:
    """Exposed seconds of a rank's paired program (`pass_counts`): the lone passes wait for all of
    their exchanges, each pair is played (pair_play.py); a pass runs one of the rank's v chunks.
    `wgrad` (`wgrad_share`): the pairs' backwards, and the lone ones but each chunk's last (whose
    buckets reduce as their gradients come), lend their weight gradients to the waits; `bucket`: the
    link's token bucket (`link_bucket`). Returns the exposed seconds and them by phase (Exposure.phases)."""
    pairs, lone_f, lone_b = counts
    filled = max(0, lone_b - v) if wgrad else 0
    phases = {"forwards alone": lone_f * alone_exposed(forward, 0.0, bucket) / v,
              "backwards alone": ((lone_b - filled) * alone_exposed(backward, 0.0, bucket)
                                  + filled * alone_exposed(backward, wgrad, bucket)) / v,
              "pairs": pairs * pair_exposed(forward, backward, wgrad, bucket) / v}
    return sum(phases.values()), phases


def link_bucket(costs: LayoutCosts) -> Bucket:
    """The links' token bucket (`Cluster.link_burst_kib`) in seconds of the EP group's rate."""
    kib = costs.cluster.link_burst_kib
    return Bucket(kib * 1024 / costs.bw_ep, _latency(costs)) if kib > 0 and costs.bw_ep > 0 else Bucket()


def wgrad_share(costs: LayoutCosts) -> float:
    """--delay-wgrad-compute: the share of a backward's compute that is weight-gradient work lent to
    the waits: each weight GEMM's gradient is as large as its forward, so a MoE layer's GEMM FLOPs
    forward (`layer_forward_flops`' dense part) over its backward's. 0 without the flag, or at ZeRO
    stages 2-3, where megalite refuses it."""
    if not costs.run.delay_wgrad_compute or costs.layout.zero_stage >= 2 or not costs.moe_bwd:
        return 0.0
    dense, _ = layer_forward_flops(costs.config, costs.run.seq_length, costs.layout.micro_batch_size, moe=True)
    return min(0.5, dense / costs.moe_bwd)


def pass_counts(costs: LayoutCosts, rank: int) -> tuple[int, int, int] | None:
    """(pairs, forwards alone, backwards alone) in pipeline rank `rank`'s program under
    --overlap-moe-expert-parallel-comm (megalite.pipeline.programs: 1F1B and interleaved paired,
    DualPipeV's own pairs); at pp 1, m - 1 pairs and one of each alone. None: no pairs."""
    layout = costs.layout
    kind = "interleaved" if layout.vpp and layout.vpp > 1 and layout.schedule == "1f1b" else layout.schedule
    if kind not in PAIRED_SCHEDULES:
        return None
    try:
        program = build_program(layout.pp, rank, costs.micro_batches, layout.vpp, kind, paired=kind != "dualpipev")
    except ValueError:  # a program this layout cannot run (the layout's own checks say why)
        return None
    pairs = sum(op.kind == "O" for op in program)
    return (pairs, sum(op.kind == "F" for op in program) - pairs, sum(op.kind == "B" for op in program) - pairs)


@dataclass(frozen=True)
class EpParts:
    """A MoE layer's work on one rank, per micro-batch (seconds): its forward's attention and router
    (and its share of the stage's other layers) `pre_f` and experts `e_f`, the backward's `pre_b` and
    `e_b`; `x` an exchange that carries rows, `lat` the counts' (latency only), `counts` the counts'
    exchanges a layer (forward, and the recomputed forward's), `half_f` / `half_b` the forward's /
    backward's exchanges each way (dispatch side, combine side); `layers` on the stage."""
    layers: int
    lat: float
    x: float
    counts: int
    pre_f: float
    e_f: float
    pre_b: float
    e_b: float
    half_f: int
    half_b: int


def ep_parts(costs: LayoutCosts, stage: StageResult) -> EpParts:
    """The stage's dense layers and output layer are spread evenly over its MoE layers. Every
    exchange pays the latency, the bytes (costs.ep_time's) spread evenly over those that carry rows
    (full recomputation: the recomputed forward's with the backward's)."""
    config, layout, n = costs.config, costs.layout, stage.ep_layers
    lat, per_rank = _latency(costs), layout.tp * layout.cp * costs.rate
    passes = 6 if layout.recompute == "full" else 4
    allgather = config.moe_token_dispatcher_type == "allgather"
    counts = 0 if allgather or config.moe_pad_expert_input_to_capacity else passes // 2 - 1
    carrying = costs.ep_exchanges - counts
    x = lat + (costs.ep_time - costs.ep_exchanges * lat) / carrying
    s, b = costs.run.seq_length, layout.micro_batch_size
    width = 3 if config.gated_linear_unit else 2
    experts = 2.0 * s * b * h_rows(config) * width / per_rank  # seconds of a MoE layer's expert matmuls
    moe_f, moe_b = costs.moe_fwd / per_rank, costs.moe_bwd / per_rank
    other = max(0.0, stage.flops_mb / costs.rate - n * (moe_f + moe_b)) / n  # dense layers, output layer
    other_f = other * costs.fwd / (costs.fwd + costs.bwd)
    half_f = carrying * 2 // passes // 2  # the forward's dispatch (or combine) exchanges
    return EpParts(n, lat, x, counts, moe_f - experts + other_f, experts,
                   (moe_f - experts) * moe_b / moe_f + other - other_f, experts * moe_b / moe_f,
                   half_f, (carrying - 2 * half_f) // 2)


def pair_items(costs: LayoutCosts, stage: StageResult) -> tuple[list, list]:
    """One micro-batch's forward and backward on `stage` as pair_play.py items (compute seconds on
    one rank, then an exchange's seconds; `ep_parts`). Per MoE layer the forward computes its
    attention and router, all-gathers the counts (in place, the turn kept), dispatches, runs the
    experts, combines; the backward runs the combine's exchanges, the experts' backward, the
    dispatch's, then the attention's backward."""
    e = ep_parts(costs, stage)
    x, half_f, half_b = e.x, e.half_f, e.half_b
    # the counts' all-gather runs in place (lanes.collective(hand_over=False))
    layer_f = ([(e.pre_f, e.lat, False)] if e.counts else []) + [(0.0 if e.counts else e.pre_f, x)] \
        + [(0.0, x)] * (half_f - 1) + [(e.e_f, x)] + [(0.0, x)] * (half_f - 1)
    extra = [(0.0, e.lat, False)] * (e.counts - 1)  # the recomputed forward's counts
    layer_b = [(e.pre_b, x)] + extra + [(0.0, x)] * (half_b - 1) + [(e.e_b, x)] + [(0.0, x)] * (half_b - 1)
    # per layer the backward's attention (and its share of the rest) is computed before the layer's
    # first exchange, not after its last: the same compute, the pattern shifted by one segment
    return layer_f * e.layers + [(0.0, 0.0)], layer_b * e.layers + [(0.0, 0.0)]


def h_rows(config) -> float:
    """Multiply-adds per token of a MoE layer's experts (top-k routed and shared), over width."""
    shared = config.moe_shared_expert_intermediate_size or 0
    return config.hidden_size * (config.moe_router_topk * config.moe_ffn_hidden_size + shared)


def pp_exposure(costs: LayoutCosts, stage: StageResult) -> Exposure:
    """Pipeline boundary transfers: per micro-batch and chunk one activation forward and one
    gradient backward, each latency + message / bandwidth; exposed: the schedule played with them
    (pipeline_play.py), each virtual stage at its own passes: its layers' forward FLOPs and the
    rest backward (split backwards: the rest halved between B and W), the last stage's with the
    output layer's. So the stages before the last have its output layer's time as slack, which
    hides a transfer as the idle time of a uniform pipeline would not (`stage` is unused: kept for
    the other exposures' signature)."""
    layout, m, p, v = costs.layout, costs.micro_batches, costs.layout.pp, costs.layout.v
    if p == 1:
        return Exposure(0, 0.0, 0.0, 0.0, "")
    transfer = _latency(costs) + costs.msg / costs.bw_pp
    split = _splits_backward(layout)
    f, b, w = [], [], []
    for vs, n in enumerate(costs.layer_counts):
        head = costs.head_flops if vs == len(costs.layer_counts) - 1 else 0.0
        chunk = (costs.layers_flops(n, moe_layers(costs.config, layers_of(costs.layer_counts, vs))) + head) \
            / layout.tp / layout.cp / costs.rate
        f.append(chunk * costs.fwd / (costs.fwd + costs.bwd))
        rest = chunk - f[-1]
        b.append(rest / 2 if split else rest)
        w.append(rest / 2 if split else 0.0)
    ahead = extra_warmup_of(layout, costs.run)
    exposed = exposed_transfers(p, m, layout.vpp, layout.schedule, f, b, w, transfer, ahead)
    return Exposure(2 * v * m, 2 * v * m * costs.msg, m * costs.pp_mb, max(0.0, exposed),
                    "the other stages' passes (non-blocking sends; what lies on the schedule's path)")


def dp_exposure(pred: Prediction) -> Exposure:
    """Data parallelism on the rank with the most exposed: comm.py's DataParallelTime, its bytes
    (dp_traffic and the tied embedding's) and its exchanges (dp_exchanges)."""
    part, costs = pred.dp_parts[pred.dp_stage], pred.costs
    state, layout = pred.stages[pred.dp_stage].state, pred.layout
    if not part.traffic or (layout.dp_cp == 1 and state.edp == 1 and not part.embedding):
        return Exposure(0, 0.0, 0.0, part.total, "")
    n = dp_exchanges(pred)
    sent = sum(part.traffic.values())
    deferred = sum(b.end - b.start for chunk in state.buckets for b in chunk if b.deferred)
    emb = deferred * 4 if layout.pp > 1 and not layout.v_shape and not pred.run.local_sgd_interval else 0.0
    bw = costs.bw_dp if layout.dp_cp > 1 or state.edp == 1 else costs.bw_edp
    comm = n * _latency(costs) + sent / bw + (emb / costs.bw_emb if emb else 0.0)
    behind = {0: "backward (buckets as they fill)", 1: "backward (buckets as they fill)",
              2: "each backward (buckets as they fill)",
              3: "the neighbouring layer's compute (prefetched gathers)"}[layout.zero_stage]
    if 1 <= layout.zero_stage <= 2 and pred.run.overlap_param_gather:
        behind += "; the next forward (parameter gathers)"
    if pred.run.local_sgd_interval:
        behind = "the next inner steps (async)" if pred.run.local_sgd_async else "nothing (the outer all-reduce)"
    elif layout.dp_cp == 1 and state.edp == 1:
        behind = "nothing (the tied embedding's reduction, after the schedule)"
    return Exposure(n, sent + emb, comm, part.total, behind)


def dp_exchanges(pred: Prediction) -> int:
    """Data-parallel collectives a step on the dp stage: per bucket (stage 3: unit) an all-reduce
    (stage 0), a reduce-scatter and an all-gather (1), a reduce-scatter per backward and one
    all-gather (2), per gathering forward and re-gathering backward an all-gather and per backward a
    reduce-scatter (3); the tied embedding's two all-reduces after the schedule (pp > 1), and at
    stages 1-2 the all-gather of its updated shard."""
    layout, run, m = pred.layout, pred.run, pred.micro_batches
    state = pred.stages[pred.dp_stage].state
    if run.local_sgd_interval:
        return 1
    n = sum(1 for chunk in state.buckets for b in chunk if not b.deferred) if layout.dp_cp > 1 else 0
    n += sum(len(chunk) for chunk in state.expert_buckets) if state.edp > 1 else 0
    per_step = {0: n, 1: 2 * n, 2: m * n + n}.get(layout.zero_stage)
    if per_step is None:  # stage 3: gathers before forward, again before backward, reduce-scatters
        regather = run.zero_reshard_after_forward and not run.zero_keep_params_for_step
        per_step = n * (m + (m if regather else 0) + m)
    deferred = any(b.deferred for chunk in state.buckets for b in chunk)
    if deferred and layout.pp > 1 and not layout.v_shape:
        per_step += 1 + (layout.dp_cp > 1)
    if deferred and layout.zero_stage in (1, 2) and layout.dp_cp > 1:  # its shard is gathered with the others
        per_step += 1
    return per_step


def exposed_comm(pred: Prediction) -> dict[str, Exposure]:
    """Every dimension's exposure in one step of `pred` (those with no exchanges left out; tp, cp,
    ep and pp on its slowest stage, dp on the stage with the most exposed data-parallel time)."""
    costs, slow = pred.costs, pred.stages[pred.slow_stage]
    out = {"tp": tp_exposure(costs, slow), "cp": cp_exposure(costs, slow, pred.slow_stage),
           "ep": ep_exposure(costs, slow, pred.slow_stage),
           "pp": pp_exposure(costs, slow), "dp": dp_exposure(pred)}
    return {k: x for k, x in out.items() if x.exchanges or x.exposed}


def format_exposed(pred: Prediction) -> str:
    """The exposed-communication section of the planner's output, for one layout."""
    rows = exposed_comm(pred)
    lat = pred.cluster.collective_latency_ms
    head = (f"exposed communication per step ({pred.layout.short()}; each exchange {lat:g} ms + bytes / link):\n"
            f"  {'dim':<4} {'exchanges':>9} {'MB sent':>9} {'comm ms':>9} {'exposed ms':>10} {'hidden':>7}  behind")
    if not rows:
        return head + "\n  (no communication)"
    lines = [head]
    for dim, x in rows.items():
        hidden = "-" if x.hidden is None else f"{round(100 * x.hidden):d}%"  # (no "-0%")
        lines.append(f"  {dim:<4} {x.exchanges:>9,} {x.bytes / 1e6:>9.2f} {x.comm * 1e3:>9.2f} "
                     f"{x.exposed * 1e3:>10.2f} {hidden:>7}  {x.behind}")
    every = rows.values()
    lines.append(f"  all  {sum(x.exchanges for x in every):>9,} {sum(x.bytes for x in every) / 1e6:>9.2f} "
                 f"{sum(x.comm for x in every) * 1e3:>9.2f} {sum(x.exposed for x in every) * 1e3:>10.2f}")
    return "\n".join(lines)
