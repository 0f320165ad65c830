"""The planner's exposed communication for a run on a machine whose figures were measured
(scripts/slow_links.py --suite hidden): what a throttled link adds to a step against bare links,
predicted from the links' measured rate and per-exchange latency and the compute the bare run took.

Every group is taken to cross the link (one rank a host: `gpus_per_node=1`). The compute rate is
fitted so that the planner's step at the bare links is the bare run's measured step (its compute,
bubble included, plus what the bare links expose), then the same layout is predicted at each link;
the link's cost is the difference of the two exposures (exposed.py), dimension by dimension.

A layout's exchanges can cost its ranks time of their own besides the link's: tp's pieces
(--tp-comm-overlap-splits k) run k GEMMs of a k-th of the rows each and post k times the messages,
and gloo's reductions, ZeRO-3's gathers and releases take the rank's own core. Fitted to the bare
step, that time would count as compute that covers transfers; it covers none (docs/slow-links.md (f),
"tp's gap"). A `Reference` run without that cost (tp at one piece; dp and ZeRO-3 on one rank with the
same work a rank) fits the rate instead.

Where a transfer hides behind one kind of compute, the compute's own speed counts, not the step's
average: context parallelism's ring hides behind attention blocks, whose measured seconds
(`attention_block_s`: a forward block and a backward piece, scripts/slow_links_probe.py) give the
cluster's attention speeds (Cluster.attention_speed) at the fitted rate."""
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


@dataclass(frozen=True)
class Reference:
    """The run the compute rate is fitted to, where it is not the bare run itself: its layout and run
    (the same model), its measured step and the link it ran on."""
    layout: Layout
    run: Run
    step_s: float
    link: MeasuredLink


def _cluster(layout: Layout, link: MeasuredLink, tflops: float, **speeds) -> Cluster:
    gbps = link.bytes_per_s / 1e9
    return Cluster(gpus=layout.gpus, gpus_per_node=1, gpu_memory_gib=1e6, intra_node_gbps=gbps, inter_node_gbps=gbps,
                   peak_tflops=tflops, efficiency=1.0, hbm_gbps=1e9, collective_latency_ms=link.latency_s * 1e3,
                   link_burst_kib=link.burst_bytes / 1024, **speeds)


def attention_speeds(pred: Prediction, block_s: tuple[float, float]) -> dict:
    """Cluster's attention speeds where one attention block of `pred`'s layout (a forward block, a
    backward piece: ring_items.ring_step_seconds) was measured to take `block_s` seconds: the block's
    time at the layout's average rate over the measured."""
    costs = pred.costs
    at_rate = costs.core / (costs.layout.tp * costs.layout.cp * costs.layout.cp) / costs.rate
    return {"attention_speed": at_rate / block_s[0], "attention_backward_speed": at_rate / block_s[1]}


def _exposed(pred: Prediction) -> float:
    return sum(x.exposed for x in pred.exposed.values())


def _compute_at_1(config: TransformerConfig, layout: Layout, run: Run) -> float:
    """The compute part of the planner's step of `layout` (free links: compute, imbalance, bubble),
    in seconds at 1 TFLOP/s."""
    free = predict(config, layout, _cluster(layout, MeasuredLink(1e18, 0.0), 1.0), run=run).time
    return free.compute + free.imbalance + free.bubble


def _fitted_tflops(config: TransformerConfig, layout: Layout, run: Run, link: MeasuredLink, step_s: float,
                   compute_at_1: float) -> float:
    """The compute rate at which the planner's step of `layout` on `link` is `step_s`: its compute at
    1 TFLOP/s over the step less what `link` exposes (twice, the second time with the first fit's
    exposure)."""
    tflops = compute_at_1 / step_s
    for _ in range(2):
        exposed = _exposed(predict(config, layout, _cluster(layout, link, tflops), run=run))
        tflops = compute_at_1 / max(step_s - exposed, 0.1 * step_s)
    return tflops


def predicted_link_cost(config: TransformerConfig, layout: Layout, run: Run, link: MeasuredLink,
                        bare: MeasuredLink, step_bare_s: float, reference: Reference | None = None,
                        attention_block_s: tuple[float, float] | None = None) -> dict:
    """What the link adds to a step of `layout` against the bare links, predicted: {"exposed_ms":
    the difference of the two exposures, "tflops": the fitted rate, "compute_ms": the layout's compute
    at it, "dimensions": per dimension its exposed ms across and bare, communication ms across,
    exchanges, and where it plays a paired program its "phases_ms" across less bare}. The rate is
    fitted to the bare step (_fitted_tflops), or to `reference`'s step; then "own_ms" is what the
    bare step took beyond the planner's at that rate: the exchanges' own cost, which covers no
    transfer. `attention_block_s` (context parallelism): an attention block's measured seconds
    (forward, backward piece), which set the cluster's attention speeds ("attention_speed")."""
    compute_at_1 = _compute_at_1(config, layout, run)
    if reference is None:
        tflops = _fitted_tflops(config, layout, run, bare, step_bare_s, compute_at_1)
    else:
        ref = reference
        tflops = _fitted_tflops(config, ref.layout, ref.run, ref.link, ref.step_s,
                                _compute_at_1(config, ref.layout, ref.run))
    on_bare = predict(config, layout, _cluster(layout, bare, tflops), run=run)
    speeds = attention_speeds(on_bare, attention_block_s) if attention_block_s and layout.cp > 1 else {}
    if speeds:  # (the layer's compute is unchanged: the fitted rate holds)
        on_bare = predict(config, layout, _cluster(layout, bare, tflops, **speeds), run=run)
    across = predict(config, layout, _cluster(layout, link, tflops, **speeds), run=run)
    a, b = across.exposed, on_bare.exposed
    dims = {dim: {"exposed_across_ms": x.exposed * 1e3, "exposed_bare_ms": b[dim].exposed * 1e3 if dim in b else 0.0,
                  "comm_ms": x.comm * 1e3, "exchanges": x.exchanges, "bytes": x.bytes}
            for dim, x in a.items()}
    for dim, x in a.items():  # a paired program's phases, across less bare (Exposure.phases)
        if x.phases and dim in b:
            dims[dim]["phases_ms"] = {k: (v - b[dim].phases.get(k, 0.0)) * 1e3 for k, v in x.phases.items()}
    out = {"exposed_ms": (_exposed(across) - _exposed(on_bare)) * 1e3, "tflops": tflops,
           "compute_ms": compute_at_1 / tflops * 1e3, "dimensions": dims}
    if speeds:
        out["attention_speed"] = [speeds["attention_speed"], speeds["attention_backward_speed"]]
    if reference is not None:
        out["own_ms"] = (step_bare_s - compute_at_1 / tflops - _exposed(on_bare)) * 1e3
    bound = ep_bound_of(across)  # the least any schedule of the step's passes exposes (ep_bound.py)
    if bound is not None:
        out["bound_exposed_ms"] = {k: v * 1e3 for k, v in bound.items()}
    return out
