"""`--overlap-param-gather` in the planner: the update's parameter all-gathers (ZeRO stages 1-2)
played against the next forward (megalite.optim.param_gather).

The model: every chunk's buckets are posted as the next step begins (time 0), buffer by buffer as the
optimizer publishes them (chunk by chunk, each chunk's dense buffer then its expert buffer), each
buffer's buckets in forward order, and they cross one stream one after another, each paying the
collective latency. A bucket is needed when the forward reaches the first part of a layer (its
norms, attention, MLP) that holds any of its parameters (megalite waits for all of a part's buckets
before the part): at overlap.needed_fractions of the chunk's layer forward, after the chunk's first
forward has begun, which on virtual stage s is s one-chunk forwards into the step (the pipeline's
fill). The forward waits for what is late; what the waits add is exposed: the largest lateness of
any bucket (each wait shifts the rest of the forward with it).

Not modelled: the first forward's other traffic on the same link (a pipeline's activations, MoE's
all-to-alls), and a stage's forwards of other micro-batches, which come after the first.
"""
from __future__ import annotations

from megalite.pipeline.partition import layers_of, virtual_stage
from megalite.tools.plan.costs import LayoutCosts
from megalite.tools.plan.experts import moe_layers
from megalite.tools.plan.inputs import DTYPE_BYTES
from megalite.tools.plan.states import StateBytes


def _chunk_forward_seconds(costs: LayoutCosts, c: int, r: int) -> float:
    """One micro-batch's forward through the layers of rank r's chunk c."""
    p, t = costs.layout.pp, costs.layout.tp
    vs = virtual_stage(p, r, c, costs.layout.v_shape)
    layers = costs.layer_counts[vs]
    n_moe = moe_layers(costs.config, layers_of(costs.layer_counts, vs)) if costs.moe_count else 0
    return ((layers - n_moe) * costs.fwd + n_moe * costs.moe_fwd) / t / costs.rate


def overlapped_gather_seconds(costs: LayoutCosts, state: StateBytes, r: int) -> float:
    """Seconds the next forward waits for the update's parameter gathers on pipeline rank r (see the
    module docstring); 0 where every bucket arrives before the layer that reads it."""
    layout = costs.layout
    d, edp, p = layout.dp_cp, state.edp, layout.pp
    pb = DTYPE_BYTES[costs.run.dtype]
    latency = costs.cluster.collective_latency_ms / 1e3
    lateness, clock = 0.0, 0.0
    for c in range(layout.v):
        forward = _chunk_forward_seconds(costs, c, r)
        begin = virtual_stage(p, r, c, layout.v_shape) * forward
        for buckets, needed, size, per_elem in (
                (state.buckets[c], state.bucket_needed[c], d, (d - 1) / d * pb / costs.bw_dp if d > 1 else 0.0),
                (state.expert_buckets[c], state.expert_needed[c], edp,
                 (edp - 1) / edp * pb / costs.bw_edp if edp > 1 else 0.0)):
            if size == 1 or not buckets:
                continue
            for bucket, at in reversed(list(zip(buckets, needed))):  # forward order: the layout's reverse
                clock += latency + (bucket.end - bucket.start) * per_elem
                lateness = max(lateness, clock - (begin + forward * at))
    return lateness
