"""Exposed communication per parallel dimension: the exchanges a step makes on one rank, what they
cost, and how much of that the compute megalite overlaps them with leaves on the step.

Every exchange (a collective, an all-to-all, one batch of point-to-point sends) costs the cluster's
`collective_latency_ms` plus its bytes over the slowest link its group spans: the latency is what a
small exchange costs beyond its bytes (tens of microseconds on NVLink / InfiniBand; 3-4 ms on
docs/slow-links.md's emulated link). Compute per pass is the planner's (FLOPs over the sustained
rate). What megalite overlaps, and so each dimension's formula (docs/planner.md, "Exposed
communication"):
- tp: all exposed, except with --tp-comm-overlap under sequence parallelism, where each layer
  collective is a ring of t-1 shard transfers, each behind one shard GEMM (tp_overlap.py);
- cp: each ring step behind one attention block (backward: twice the block's forward);
- ep: all exposed (the dispatcher waits for its all-to-alls), or with the
  --overlap-moe-expert-parallel-comm option a MoE layer's all-to-alls of one micro-batch behind
  another micro-batch's backward of that layer, the first micro-batch having no partner;
- pp: the schedule played with each boundary transfer (pipeline_play.py): what lies on its path;
- dp: the gradient buckets during backward, ZeRO-3's gathers prefetched behind the layer before
  (comm.py's model, which `dp_exposed` works out for the step time)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megalite.tools.plan.costs import LayoutCosts
from megalite.tools.plan.pipeline_play import exposed_transfers

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

    @property
    def hidden(self) -> float | None:
        return 1.0 - self.exposed / self.comm if self.comm > 0 else None


def _latency(costs: LayoutCosts) -> float:
    return costs.cluster.collective_latency_ms / 1e3


def tp_exposure(costs: LayoutCosts, stage: StageResult) -> Exposure:
    """Tensor parallelism on `stage` over the step's m micro-batches. A collective is an all-reduce
    (one exchange, 2(t-1)/t of s*b*h sent) or, with SP, an all-gather and a reduce-scatter ((t-1)/t
    each). With --tp-comm-overlap (SP only) each layer exchange is t-1 ring steps of a 1/t shard, each
    behind the GEMM of one shard of its linear: an average linear of the layer, a quarter of its
    dense FLOPs over t ranks, over t shards."""
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
    shard_gemm = (costs.fwd - costs.core) / 4 / t / t / costs.rate
    step = lat + costs.ar_bytes / t / costs.bw_tp
    overlapped = layer_colls * 2 * (t - 1) * max(0.0, step - shard_gemm)
    exposed = m * (overlapped + stage.tp_edge_collectives * costs.ar_time)
    comm = m * (layer_colls * 2 * (t - 1) * step + stage.tp_edge_collectives * costs.ar_time)
    return Exposure(m * (layer_colls * 2 * (t - 1) + stage.tp_edge_collectives * per), sent, comm, exposed,
                    f"each shard transfer behind one shard GEMM ({shard_gemm * 1e3:.3f} ms)")


def ring_steps(costs: LayoutCosts) -> tuple[int, int]:
    """Context parallelism's ring steps per attention layer and micro-batch: (forward, backward);
    full recomputation runs the forward's again."""
    steps = costs.layout.cp - 1
    return steps * (2 if costs.layout.recompute == "full" else 1), steps


def cp_exposure(costs: LayoutCosts, stage: StageResult) -> Exposure:
    """The ring on `stage`: a forward step sends a K/V block, a backward step K/V and dK/dV as one
    batch; each step's transfer hides behind one attention block, the attention core of this rank's
    queries against one of the cp blocks of keys (forward), twice that in backward."""
    layout, m = costs.layout, costs.micro_batches
    if layout.cp == 1:
        return Exposure(0, 0.0, 0.0, 0.0, "")
    lat, fwd_steps, bwd_steps = _latency(costs), *ring_steps(costs)
    fwd_bytes, bwd_bytes = costs.ring_step_bytes
    block = costs.core / (layout.tp * layout.cp * layout.cp) / costs.rate
    f_step, b_step = lat + fwd_bytes / costs.bw_cp, lat + bwd_bytes / costs.bw_cp
    per_layer = fwd_steps * f_step + bwd_steps * b_step
    exposed_layer = fwd_steps * max(0.0, f_step - block) + bwd_steps * max(0.0, b_step - 2 * block)
    layers = stage.n_layers
    return Exposure(m * layers * (fwd_steps + bwd_steps), m * layers * costs.ring_bytes, m * layers * per_layer,
                    m * layers * exposed_layer, f"each step behind one attention block ({block * 1e3:.3f} ms forward)")


def ep_exposure(costs: LayoutCosts, stage: StageResult) -> Exposure:
    """The token dispatch on `stage`: per MoE layer and micro-batch `costs.ep_exchanges` exchanges
    (dispatch and combine forward and backward, the counts' all-gather) taking `costs.ep_time`. All
    exposed; with the overlap option, per MoE layer (m-1) x max(0, ep_time - the layer's backward)
    + one ep_time: each micro-batch's all-to-alls but the first's behind another's backward."""
    m, layers = costs.micro_batches, stage.ep_layers
    if not layers or not costs.ep_exchanges:
        return Exposure(0, 0.0, 0.0, 0.0, "")
    comm = m * layers * costs.ep_time
    sent = m * layers * (costs.ep_bytes + costs.etp_bytes)
    if not costs.run.overlap_moe_ep_comm:
        return Exposure(m * layers * costs.ep_exchanges, sent, comm, comm, "nothing (megalite waits for each)")
    backward = costs.moe_bwd / (costs.layout.tp * costs.layout.cp) / costs.rate
    exposed = layers * ((m - 1) * max(0.0, costs.ep_time - backward) + costs.ep_time)
    return Exposure(m * layers * costs.ep_exchanges, sent, comm, exposed,
                    f"another micro-batch's backward of the layer ({backward * 1e3:.3f} ms)")


def pp_exposure(costs: LayoutCosts, stage: StageResult) -> Exposure:
    """Pipeline boundary transfers: per micro-batch and chunk one activation forward and one
    gradient backward, each latency + message / bandwidth; exposed: the schedule played with them
    (pipeline_play.py) at the slowest stage's passes, a chunk's forward its share of the layers'
    forward FLOPs (split backwards: the rest halved between B and W)."""
    layout, m, p, v = costs.layout, costs.micro_batches, costs.layout.pp, costs.layout.v
    if p == 1:
        return Exposure(0, 0.0, 0.0, 0.0, "")
    transfer = _latency(costs) + costs.msg / costs.bw_pp
    chunk = stage.compute_mb / v
    f = chunk * costs.fwd / (costs.fwd + costs.bwd)
    split = layout.schedule in ("zb-h1", "zb-v", "dualpipev")
    b, w = ((chunk - f) / 2, (chunk - f) / 2) if split else (chunk - f, 0.0)
    exposed = exposed_transfers(p, m, layout.vpp, layout.schedule, f, b, w, transfer)
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
    if pred.run.local_sgd_interval:
        behind = "the next inner steps (async)" if pred.run.local_sgd_async else "nothing (the outer all-reduce)"
    elif layout.dp_cp == 1 and state.edp == 1:
        behind = "nothing (the tied embedding's reduction, after the schedule)"
    return Exposure(n, sent + emb, comm, part.total, behind)


def dp_exchanges(pred: Prediction) -> int:
    """Data-parallel collectives a step on the dp stage: per bucket (stage 3: unit) an all-reduce
    (stage 0), a reduce-scatter and an all-gather (1), a reduce-scatter per backward and one
    all-gather (2), per gathering forward and re-gathering backward an all-gather and per backward a
    reduce-scatter (3); the tied embedding's two all-reduces after the schedule (pp > 1)."""
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
    return per_step


def exposed_comm(pred: Prediction) -> dict[str, Exposure]:
    """Every dimension's exposure in one step of `pred` (those with no exchanges left out; tp, cp,
    ep and pp on its slowest stage, dp on the stage with the most exposed data-parallel time)."""
    costs, slow = pred.costs, pred.stages[pred.slow_stage]
    out = {"tp": tp_exposure(costs, slow), "cp": cp_exposure(costs, slow), "ep": ep_exposure(costs, slow),
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
