"""When the gradient buckets' reductions run, given the bucket plan (megalite.optim.bucket_plan):
how far into a chunk's backward each bucket is complete, and the one stream of collectives that
reduces them in turn. What runs past the end of backward is the exposed data-parallel time.

The model: backward first spends `head` seconds on the output layer (the logits' gradient GEMMs, and
multi-token prediction's, on the last stage), then runs the layers last to first, each taking time in
proportion to its parameters' elements (a weight's GEMM FLOPs are 6 x tokens x its elements; the
attention core, the same in every layer, adds the same share to each). A bucket is complete when the
layer work of every parameter in it and before it, in backward order (the buckets' order), is done:
the final norm and an untied output layer right after `head`, the embeddings at the very end.
Collectives run one after another, each `latency + bytes x ring factor / bandwidth`, a bucket's as
soon as it is complete and the link is free (megalite launches each the moment its last gradient
arrives; NCCL runs a communicator's collectives in order)."""
from __future__ import annotations

import math

from megalite.optim.bucket_plan import BucketLayout


def ready_fractions(buckets: list[BucketLayout], numels: list[int], layer_of: list[int | None]) -> list[float]:
    """Per bucket, the fraction of its chunk's layer backward done when its last gradient arrives:
    layer parameters weigh their elements, the others (embeddings, norms and output layer outside
    the layers) nothing. `numels` and `layer_of` are per parameter, in definition order, as
    `plan_layout` and `inputs.rank_parameter_layers` take them."""
    weight = [n if layer is not None else 0 for n, layer in zip(numels, layer_of, strict=True)]
    total = sum(weight)
    out, done = [], 0
    for bucket in buckets:
        done += sum(weight[k] for k in bucket.members)
        out.append(done / total if total else 1.0)
    return out


def needed_fractions(buckets: list[BucketLayout], numels: list[int], layer_of: list[int | None],
                     part_of: list[int | None] | None = None) -> list[float]:
    """Per bucket, the fraction of its chunk's layer forward done when the forward first needs it:
    at the start of the first part of a layer (in forward order: a layer's norms, attention and MLP,
    `part_of`; without it, the whole layer) that holds any of its parameters, since
    megalite.optim.param_gather waits for each part's buckets, all of them, before the part runs.
    Parameters outside the layers are needed before the first layer if defined before it (the
    embeddings: 0), else after the last (the final norm, the output layer: 1). Weights as in
    `ready_fractions`."""
    parts = part_of if part_of is not None else [0 if layer is not None else None for layer in layer_of]
    weight: dict = {}
    for n, layer, part in zip(numels, layer_of, parts, strict=True):
        if layer is not None:
            weight[(layer, part)] = weight.get((layer, part), 0) + n
    total = sum(weight.values())
    before, done = {}, 0  # (layer, part) -> its start, as a fraction of the chunk's layer forward
    for key in sorted(weight):
        before[key] = done / total if total else 0.0
        done += weight[key]
    first_layer_param = next((k for k, layer in enumerate(layer_of) if layer is not None), len(layer_of))
    out = []
    for bucket in buckets:
        at = [before[(layer_of[k], parts[k])] if layer_of[k] is not None else (0.0 if k < first_layer_param else 1.0)
              for k in bucket.members]
        out.append(min(at) if at else 1.0)
    return out


def ready_times(fractions: list[float], begin: float, head: float, layers: float) -> list[float]:
    """Seconds at which each bucket is complete, for a backward starting at `begin` that spends
    `head` seconds before the layers and `layers` seconds on them."""
    return [begin + head + layers * f for f in fractions]


def link_schedule(jobs: list[tuple[float, float]], latency: float) -> float:
    """When the last of `jobs` (ready time, seconds of transfer) finishes on one stream that takes
    them in order of readiness (ties: in the order given), each paying `latency` first. -inf: none."""
    free = -math.inf
    for ready, seconds in sorted(jobs, key=lambda job: job[0]):
        free = max(free, ready) + latency + seconds
    return free
