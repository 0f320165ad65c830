"""The least communication any schedule of an expert-parallel step's passes can leave exposed, from
the planner's own costs: a bound to set beside the measured hidden share and the planner's play of
megalite's pairs (pair_play.py), for a run at pp 1 with --overlap-moe-expert-parallel-comm.

Three facts bound it, whatever the order of the work:
- a pair of passes (one micro-batch's forward beside another's backward) takes at least the
  longest of the CPU's work (both lanes' compute: one device computes one thing at a time), the
  link's (both lanes' exchanges: one link), and each lane's own chain (a lane's compute and
  exchanges one after another: each exchange needs what came before it, and what follows needs
  it);
- a pass that runs alone (the step's first forward, its last backward) waits for every exchange
  of its own;
- the data-parallel reduction of the accumulated gradients can start only in the last backward
  and must end before the update: that phase takes at least the longer of the backward's chain and
  the link's bytes (its exchanges and the reduction's). With the distributed optimizer and
  --overlap-param-gather the gathers' half goes to the next step's first forward instead, whose
  phase is bounded the same way.

What is exposed is what those phases take beyond the compute in them.
"""
from __future__ import annotations

from megalite.tools.plan.pair_play import Items


def _cpu(items: Items) -> float:
    return sum(item[0] for item in items)


def _link(items: Items) -> float:
    return sum(item[1] for item in items)


def pair_bound(forward: Items, backward: Items) -> float:
    """The least a pair of these passes can expose (see the module docstring)."""
    cpu = _cpu(forward) + _cpu(backward)
    chains = (_cpu(forward) + _link(forward), _cpu(backward) + _link(backward))
    return max(cpu, _link(forward) + _link(backward), *chains) - cpu


def alone_phase_bound(items: Items, reduction: float) -> float:
    """The least a pass run alone exposes when the link also carries `reduction` seconds that must
    end with it (the data-parallel reduction or gathers of its phase)."""
    return max(_cpu(items) + _link(items), _link(items) + reduction) - _cpu(items)


def ep_step_bound(pairs: int, forward: Items, backward: Items, reduce_s: float, gather_s: float) -> dict:
    """Seconds at least exposed in a pp-1 step of `pairs` pairs, one forward and one backward alone:
    {"pairs", "first_forward", "last_backward", "exposed"}. `reduce_s`: the DP reduction's seconds
    on the link in the last backward's phase; `gather_s`: the gathers' in the first forward's (0
    unless they were moved there)."""
    out = {"pairs": pairs * pair_bound(forward, backward),
           "first_forward": alone_phase_bound(forward, gather_s),
           "last_backward": alone_phase_bound(backward, reduce_s)}
    out["exposed"] = sum(out.values())
    return out


def ep_bound_of(pred) -> dict | None:
    """`ep_step_bound` for a prediction of a pp-1 run with overlapped pairs at ZeRO stage 0 or 1 (None
    for other layouts): its pairs' items (exposed.pair_items), and its data-parallel bytes at the
    link's rate with a latency a bucket. Stage 1 without --overlap-param-gather adds the gathers
    after the update, which nothing can hide."""
    from megalite.tools.plan.exposed import pair_items, pass_counts

    costs, layout = pred.costs, pred.layout
    if layout.pp != 1 or not costs.run.overlap_moe_ep_comm or layout.zero_stage > 1:
        return None
    stage = pred.stages[0]
    counts = pass_counts(costs, 0) if stage.ep_layers else None
    if counts is None:
        return None
    forward, backward = pair_items(costs, stage)
    part, latency = pred.dp_parts[0], costs.cluster.collective_latency_ms / 1e3
    buckets = sum(len(chunk) for chunk in stage.state.buckets) if layout.dp_cp > 1 else 0
    traffic = part.traffic or {}
    reduce_s = (traffic.get("all_reduce", 0.0) + traffic.get("reduce_scatter", 0.0)) / costs.bw_dp + buckets * latency
    gather_s = traffic.get("all_gather", 0.0) / costs.bw_dp + buckets * latency if traffic.get("all_gather") else 0.0
    overlapped = costs.run.overlap_param_gather
    out = ep_step_bound(counts[0], forward, backward, reduce_s, gather_s if overlapped else 0.0)
    if gather_s and not overlapped:
        out["after_update"] = gather_s
        out["exposed"] += gather_s
    return out
