"""Context parallelism's ring as the planner plays it (exposed.cp_exposure): its
steps per layer, each transfer's seconds and the attention block it hides behind, and one
micro-batch's passes as pair_play.py items (megalite.parallel.context_parallel's order)."""
from __future__ import annotations

from typing import Any

from megalite.tools.plan.costs import LayoutCosts

StageResult = Any  # a predict.StageResult (predict imports exposed.py, which imports this module)


def ring_steps(costs: LayoutCosts) -> tuple[int, int]:
    """Context parallelism's ring steps per attention layer and micro-batch: (forward, backward);
    full recomputation runs the forward's again."""
    steps = costs.layout.cp - 1
    return steps * (2 if costs.layout.recompute == "full" else 1), steps


def ring_transfers(costs: LayoutCosts) -> int:
    """Transfers of context parallelism's ring per attention layer and micro-batch: one a forward
    step (K/V), two a backward step (K/V, then dK/dV)."""
    fwd_steps, bwd_steps = ring_steps(costs)
    return fwd_steps + 2 * bwd_steps


def ring_step_seconds(costs: LayoutCosts) -> tuple[tuple[float, float], float, tuple[float, float]]:
    """((one attention block's compute: this rank's queries against one of the cp blocks of keys,
    forward, and a backward piece's: twice its FLOPs over half its rows), a forward ring transfer
    (K/V), the backward's two (K/V, dK/dV)), in seconds, latency included. A block takes its FLOPs
    at the cluster's attention speeds (Cluster.attention_speed: the core runs slower per FLOP than
    the layer's average)."""
    layout, cluster, lat = costs.layout, costs.cluster, costs.cluster.collective_latency_ms / 1e3
    fwd_bytes, bwd_bytes = costs.ring_step_bytes
    block = costs.core / (layout.tp * layout.cp * layout.cp) / costs.rate
    backward_speed = cluster.attention_backward_speed or cluster.attention_speed
    f_step = lat + fwd_bytes / costs.bw_cp
    return ((block / cluster.attention_speed, block / backward_speed), f_step,
            (f_step, lat + (bwd_bytes - fwd_bytes) / costs.bw_cp))


def ring_pair_items(costs: LayoutCosts, stage: StageResult, blocks: tuple[float, float], f_step: float,
                    bwd_step: tuple[float, float]) -> tuple[list, list]:
    """One micro-batch's forward and backward on `stage` as pair_play.py items for the ring. A ring
    transfer starts before its attention block (`blocks`: forward, backward piece) and is waited for
    after it, which plays as the block's compute and then the rest of the transfer; per layer the
    rest of the layer's compute (projections, MLP, the last block, its share of the output layer)
    comes before the first of its transfers, the forward's recomputed steps (full recomputation,
    behind forward blocks) before the backward's."""
    n, (fwd_steps, bwd_steps) = stage.n_layers, ring_steps(costs)
    f = stage.compute_mb / n * costs.fwd / (costs.fwd + costs.bwd)
    b = stage.compute_mb / n - f
    recomputed = fwd_steps - (costs.layout.cp - 1)
    forward_block, backward_block = blocks

    def layer(compute: float, transfers: list[tuple[float, float]]) -> list:
        items = [(block, max(0.0, x - block)) for block, x in transfers]
        rest = max(0.0, compute - sum(block for block, _ in items))
        return [(rest + items[0][0], items[0][1])] + items[1:]

    forward = layer(f, [(forward_block, f_step)] * (costs.layout.cp - 1))
    backward = layer(b, [(forward_block, f_step)] * recomputed
                     + [(backward_block, x) for x in bwd_step] * bwd_steps)
    return forward * n + [(0.0, 0.0)], backward * n + [(0.0, 0.0)]
