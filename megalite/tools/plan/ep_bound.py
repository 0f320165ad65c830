"""The least communication any schedule of an expert-parallel step's passes can leave exposed, from
the planner's own costs: a bound to set beside the measured hidden share and the planner's play of
megalite's pairs (pair_play.py), for a run at pp 1 with --overlap-moe-expert-parallel-comm.

Three facts bound it, whatever the order of the work:
- a pair of passes (one micro-batch's forward beside another's backward) takes at least as long as
  the best order of its two lanes' items (`best_pair_seconds`): the two lanes' compute items and
  exchanges interleaved in every way that keeps each lane's own order (an exchange needs its lane's
  compute before it, and the lane's next compute needs the exchange), one CPU computing one item
  at a time, one link carrying one exchange at a time in launch order, a launch never holding the
  CPU, and each compute item splittable in two so the other lane may run in between. It is found
  exactly (a search over the interleavings, keeping only the states no other state beats in every
  clock, and dropping any whose least possible end passes the lanes' own play). The longest of the
  CPU's work, the link's and each lane's chain is a lower bound of it, and where the items do not
  fit into each other's gaps (the forward's short attention segment against the backward's
  longer exchange, say) it lies well below;
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

from megalite.tools.plan.pair_play import Items, played_pair


def _cpu(items: Items) -> float:
    return sum(item[0] for item in items)


def _link(items: Items) -> float:
    return sum(item[1] for item in items)


def _halves(items: Items) -> list[tuple[float, float]]:
    """(compute, exchange) segments, each compute item split in two (the other lane may run between)."""
    out = []
    for compute, exchange, *_ in items:
        out += [(compute / 2, 0.0), (compute / 2, exchange)] if compute > 0 else [(0.0, exchange)]
    return out


def best_pair_seconds(forward: Items, backward: Items) -> float:
    """The shortest the pair takes in any order of its items (see the module docstring). An
    exchange run in place (the counts') counts as an ordinary one: that only allows more orders."""
    lanes = (_halves(forward), _halves(backward))
    rest = []  # per lane, the compute and the link seconds from item i on
    for seq in lanes:
        cpu, link = [0.0] * (len(seq) + 1), [0.0] * (len(seq) + 1)
        for i in range(len(seq) - 1, -1, -1):
            cpu[i], link[i] = cpu[i + 1] + seq[i][0], link[i + 1] + seq[i][1]
        rest.append((cpu, link))
    (cf, lf), (cb, lb) = rest
    best = played_pair(forward, backward) * (1 + 1e-12)  # megalite's own order: a schedule, so an upper bound
    # states (CPU free, link free, forward lane ready, backward lane ready) by items done in each lane
    front = {(0, 0): [(0.0, 0.0, 0.0, 0.0)]}
    nf, nb = len(lanes[0]), len(lanes[1])
    for done in range(nf + nb):
        for i in range(max(0, done - nb), min(done, nf) + 1):
            at = (i, done - i)
            for state in front.pop(at, ()):
                for lane in (0, 1):
                    k = at[lane]
                    if k == len(lanes[lane]):
                        continue
                    compute, exchange = lanes[lane][k]
                    cpu, link = state[0], state[1]
                    end = max(cpu, state[2 + lane]) + compute
                    link, ready = (max(end, link) + exchange,) * 2 if exchange > 0 else (link, end)
                    new = (end, link, ready, state[3]) if lane == 0 else (end, link, state[2], ready)
                    ni, nj = (i + 1, done - i) if lane == 0 else (i, done - i + 1)
                    least = max(end + cf[ni] + cb[nj], link + lf[ni] + lb[nj], new[2] + cf[ni] + lf[ni],
                                new[3] + cb[nj] + lb[nj])
                    if least >= best:
                        continue
                    if ni == nf and nj == nb:
                        best = least
                        continue
                    cell = front.setdefault((ni, nj), [])
                    if any(all(a <= b for a, b in zip(other, new)) for other in cell):
                        continue
                    cell[:] = [other for other in cell if not all(b <= a for a, b in zip(other, new))] + [new]
    return best


def pair_bound(forward: Items, backward: Items, wgrad: float = 0.0) -> float:
    """The least a pair of these passes can expose: its best order beyond both lanes' compute.
    `wgrad` (--delay-wgrad-compute): that share of the backward's compute may run anywhere in the
    pair, so the bound is the longest of the CPU's work, the link's and each lane's chain without
    it (a lower bound, not the best order: the search above keeps each item whole in its lane)."""
    cpu = _cpu(forward) + _cpu(backward)
    if wgrad <= 0:
        return best_pair_seconds(forward, backward) - cpu
    chain_f = _cpu(forward) + _link(forward)
    chain_b = _cpu(backward) * (1 - wgrad) + _link(backward)
    return max(cpu, _link(forward) + _link(backward), chain_f, chain_b) - cpu


def alone_phase_bound(items: Items, reduction: float) -> float:
    """The least a pass run alone exposes when the link also carries `reduction` seconds that must
    end with it (the data-parallel reduction or gathers of its phase)."""
    return max(_cpu(items) + _link(items), _link(items) + reduction) - _cpu(items)


def ep_step_bound(pairs: int, forward: Items, backward: Items, reduce_s: float, gather_s: float,
                  wgrad: float = 0.0) -> dict:
    """Seconds at least exposed in a pp-1 step of `pairs` pairs, one forward and one backward alone:
    {"pairs", "first_forward", "last_backward", "exposed"}. `reduce_s`: the DP reduction's seconds
    on the link in the last backward's phase; `gather_s`: the gathers' in the first forward's (0
    unless they were moved there)."""
    out = {"pairs": pairs * pair_bound(forward, backward, wgrad),
           "first_forward": alone_phase_bound(forward, gather_s),
           "last_backward": alone_phase_bound(backward, reduce_s)}
    out["exposed"] = sum(out.values())
    return out


def ep_bound_of(pred) -> dict | None:
    """`ep_step_bound` for a prediction of a pp-1 run with overlapped pairs at ZeRO stage 0 or 1 (None
    for other layouts): its pairs' items (exposed.pair_items), and its data-parallel bytes at the
    link's rate with a latency a bucket. Stage 1 without --overlap-param-gather adds the gathers
    after the update, which nothing can hide. A link with a token bucket (`Cluster.link_burst_kib`):
    every exchange as short as the bucket could make it."""
    from megalite.tools.plan.exposed import link_bucket, pair_items, pass_counts, wgrad_share

    costs, layout = pred.costs, pred.layout
    if layout.pp != 1 or not costs.run.overlap_moe_ep_comm or layout.zero_stage > 1:
        return None
    stage = pred.stages[0]
    counts = pass_counts(costs, 0) if stage.ep_layers else None
    if counts is None:
        return None
    forward, backward = pair_items(costs, stage)
    part, latency = pred.dp_parts[0], costs.cluster.collective_latency_ms / 1e3
    burst = link_bucket(costs).burst
    if burst:  # a link's bucket saves at most its burst on an exchange: each at its fastest
        forward, backward = ([(c, x - min(burst, max(0.0, x - latency)), *rest) for c, x, *rest in items]
                             for items in (forward, backward))
    buckets = sum(len(chunk) for chunk in stage.state.buckets) if layout.dp_cp > 1 else 0
    traffic = part.traffic or {}
    reduce_s = (traffic.get("all_reduce", 0.0) + traffic.get("reduce_scatter", 0.0)) / costs.bw_dp + buckets * latency
    gather_s = traffic.get("all_gather", 0.0) / costs.bw_dp + buckets * latency if traffic.get("all_gather") else 0.0
    overlapped = costs.run.overlap_param_gather
    out = ep_step_bound(counts[0], forward, backward, reduce_s, gather_s if overlapped else 0.0,
                        wgrad_share(costs))
    if gather_s and not overlapped:
        out["after_update"] = gather_s
        out["exposed"] += gather_s
    return out
