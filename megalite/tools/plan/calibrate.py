"""The planner's exposed communication for a run on a machine whose figures were measured
(scripts/slow_links.py --suite hidden): what a throttled link adds to a step against bare links,
predicted from the links' measured rate and per-exchange latency and the compute the bare run took.

Every group is taken to cross the link (one rank a host: `gpus_per_node=1`). The compute rate is
fitted so that the planner's step at the bare links is the bare run's measured step (its compute,
bubble included, plus what the bare links expose), then the same layout is predicted at each link;
the link's cost is the difference of the two exposures (exposed.py), dimension by dimension."""
from __future__ import annotations

from dataclasses import dataclass

from megalite.models.config import TransformerConfig
from megalite.tools.plan.ep_bound import ep_bound_of
from megalite.tools.plan.inputs import Cluster, Layout, Run
from megalite.tools.plan.predict import Prediction, predict


@dataclass(frozen=True)
class MeasuredLink:
    bytes_per_s: float  # one transfer's rate (the suite's one-TCP-stream figure)
    latency_s: float  # what one small exchange costs (the suite's small all-reduce)
    burst_bytes: float = 0.0  # the link's token bucket (tc-tbf's burst: Cluster.link_burst_kib)


def _cluster(layout: Layout, link: MeasuredLink, tflops: float) -> Cluster:
    gbps = link.bytes_per_s / 1e9
    return Cluster(gpus=layout.gpus, gpus_per_node=1, gpu_memory_gib=1e6, intra_node_gbps=gbps, inter_node_gbps=gbps,
                   peak_tflops=tflops, efficiency=1.0, hbm_gbps=1e9, collective_latency_ms=link.latency_s * 1e3,
                   link_burst_kib=link.burst_bytes / 1024)


def _exposed(pred: Prediction) -> float:
    return sum(x.exposed for x in pred.exposed.values())


def predicted_link_cost(config: TransformerConfig, layout: Layout, run: Run, link: MeasuredLink,
                        bare: MeasuredLink, step_bare_s: float) -> dict:
    """What the link adds to a step of `layout` against the bare links, predicted: {"exposed_ms":
    the difference of the two exposures, "tflops": the fitted rate, "dimensions": per dimension
    its exposed ms across and bare, communication ms across, exchanges}. The rate: the compute
    part of the planner's step (free links: compute, imbalance, bubble) at 1 TFLOP/s, over the bare
    step less what the bare links expose (twice, the second time with the first fit's exposure)."""
    free = predict(config, layout, _cluster(layout, MeasuredLink(1e18, 0.0), 1.0), run=run).time
    compute_at_1 = free.compute + free.imbalance + free.bubble  # seconds at 1 TFLOP/s
    tflops = compute_at_1 / step_bare_s
    for _ in range(2):
        on_bare = predict(config, layout, _cluster(layout, bare, tflops), run=run)
        tflops = compute_at_1 / max(step_bare_s - _exposed(on_bare), 0.1 * step_bare_s)
    on_bare = predict(config, layout, _cluster(layout, bare, tflops), run=run)
    across = predict(config, layout, _cluster(layout, link, tflops), run=run)
    a, b = across.exposed, on_bare.exposed
    dims = {dim: {"exposed_across_ms": x.exposed * 1e3, "exposed_bare_ms": b[dim].exposed * 1e3 if dim in b else 0.0,
                  "comm_ms": x.comm * 1e3, "exchanges": x.exchanges, "bytes": x.bytes}
            for dim, x in a.items()}
    out = {"exposed_ms": (_exposed(across) - _exposed(on_bare)) * 1e3, "tflops": tflops,
           "compute_ms": compute_at_1 / tflops * 1e3, "dimensions": dims}
    bound = ep_bound_of(across)  # the least any schedule of the step's passes exposes (ep_bound.py)
    if bound is not None:
        out["bound_exposed_ms"] = {k: v * 1e3 for k, v in bound.items()}
    return out
