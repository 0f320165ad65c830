"""Seconds per step: FLOPs over the sustained throughput, the pipeline bubble, tensor-parallel
collectives, pipeline messages, the data-parallel reduction that does not hide behind backward,
and the optimizer step."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from megalite.metrics import layer_forward_flops
from megalite.models.config import TransformerConfig
from megalite.optim.buffers import BucketLayout
from megalite.parallel.layers import pad_vocab_size
from megalite.pipeline.partition import stage_layer_counts
from megalite.tools.plan.inputs import DTYPE_BYTES, Cluster, Layout, Run

# Bytes of memory traffic per element the optimizer step updates (fused AdamW on the GPU): Adam
# reads master, gradient, exp_avg, exp_avg_sq (16) and writes master, exp_avg, exp_avg_sq (12); the
# global norm reads the gradient (4); clipping reads and writes it (8); publishing the new weights
# reads the master and writes the model-dtype parameter (4 + 2 for bf16/fp16, nothing for fp32,
# whose masters are the parameters). fp16 adds the unscaling pass (read + write, 8).
OPTIMIZER_TRAFFIC = {"bf16": 16 + 12 + 4 + 8 + 6, "fp16": 16 + 12 + 4 + 8 + 6 + 8, "fp32": 16 + 12 + 4 + 8}


@dataclass(frozen=True)
class StepTime:
    """Seconds per step, by cause."""
    compute: float
    imbalance: float
    tp_comm: float
    pp_comm: float
    bubble: float
    dp_comm: float
    optimizer: float
    total: float


@dataclass(frozen=True)
class LayoutCosts:
    """What one layout of one run costs per micro-batch and layer, whatever the pipeline rank."""
    config: TransformerConfig
    layout: Layout
    cluster: Cluster
    run: Run
    micro_batches: int  # m: per step and data-parallel rank
    layer_counts: list  # layers of each virtual stage
    vocab: int  # padded for tp
    act_bytes: int  # bytes of one activation element (model dtype)
    bw_tp: float  # bytes/s of the slowest link of each kind of group
    bw_pp: float
    bw_dp: float
    bw_emb: float
    rate: float  # sustained FLOP/s per GPU
    fwd: float  # FLOPs of one layer and micro-batch, all TP ranks together (see layer_flops)
    bwd: float
    core: float
    logits_fwd: float  # output layer forward, all TP ranks together
    ar_bytes: float  # one TP all-reduce (or all-gather + reduce-scatter under SP)
    ar_time: float
    ar_per_layer: int
    msg: float  # one pipeline message: megalite's p2p tensor_shape
    pp_mb: float  # pipeline exchanges per micro-batch (all chunks)

    @property
    def traffic(self) -> int:
        return OPTIMIZER_TRAFFIC[self.run.dtype]

    @property
    def hardware_flops(self) -> float:
        """FLOPs of one step, the whole model, recomputation included."""
        m, d, L = self.micro_batches, self.layout.dp, self.config.num_layers
        return m * d * (L * (self.fwd + self.bwd) + 3 * self.logits_fwd)


def layout_costs(config: TransformerConfig, layout: Layout, cluster: Cluster, run: Run, m: int) -> LayoutCosts:
    t, p, v, b = layout.tp, layout.pp, layout.v, layout.micro_batch_size
    s, h = run.seq_length, config.hidden_size
    ab = DTYPE_BYTES[run.dtype]
    bw_tp, bw_pp = bandwidth(cluster, "tp", layout), bandwidth(cluster, "pp", layout)
    vocab = pad_vocab_size(config.vocab_size, t, config.make_vocab_size_divisible_by)
    fwd, bwd, core = layer_flops(config, s, b, layout.recompute)
    ar_bytes = s * b * h * ab
    msg = (s // t if layout.sequence_parallel else s) * b * h * ab
    return LayoutCosts(
        config=config, layout=layout, cluster=cluster, run=run, micro_batches=m,
        layer_counts=stage_layer_counts(config.num_layers, p, layout.vpp,
                                        list(run.pipeline_layers) if run.pipeline_layers else None),
        vocab=vocab, act_bytes=ab, bw_tp=bw_tp, bw_pp=bw_pp, bw_dp=bandwidth(cluster, "dp", layout),
        bw_emb=bandwidth(cluster, "emb", layout), rate=cluster.peak_tflops * 1e12 * cluster.efficiency,
        fwd=fwd, bwd=bwd, core=core, logits_fwd=2.0 * s * b * h * vocab, ar_bytes=ar_bytes,
        ar_time=2.0 * (t - 1) / t * ar_bytes / bw_tp if t > 1 else 0.0,
        ar_per_layer=6 if layout.recompute == "full" else 4,  # the recomputed forward repeats its 2
        msg=msg, pp_mb=2.0 * v * msg / bw_pp if p > 1 else 0.0,  # per micro-batch and chunk: 1 forward + 1 backward
    )


def layer_flops(config: TransformerConfig, s: int, b: int, recompute: str) -> tuple[float, float, float]:
    """(forward, backward incl. recomputation, attention-core forward) FLOPs of one layer and one
    micro-batch, all TP ranks together (`megalite.metrics.layer_forward_flops`: 24*s*b*h^2 dense plus
    the attention core 4*b*s^2*h for GPT-2's shape); backward twice the forward."""
    dense, core = layer_forward_flops(config, s, b)
    fwd = dense + core
    bwd = 2.0 * fwd
    if recompute == "full":
        bwd += fwd
    elif recompute == "selective":
        bwd += core
    return fwd, bwd, core


# Placement: which links a group's ring crosses (rank = pp_rank * dp * tp + dp_rank * tp + tp_rank)
@functools.lru_cache(maxsize=4096)
def crosses_nodes(kind: str, tp: int, pp: int, dp: int, gpus_per_node: int) -> bool:
    """Whether any group of this kind (tp, dp, pp, embedding) spans more than one node."""
    g = gpus_per_node

    def spans(ranks) -> bool:
        return ranks[0] // g != ranks[-1] // g  # ranks increase along each group

    if kind == "tp":
        return any(spans([s, s + tp - 1]) for s in range(0, tp * pp * dp, tp))
    if kind == "dp":
        return any(spans([p * dp * tp + t, p * dp * tp + (dp - 1) * tp + t]) for p in range(pp) for t in range(tp))
    # pp or embedding (first and last stage of each pipeline)
    return any(spans([d * tp + t, (pp - 1) * dp * tp + d * tp + t]) for d in range(dp) for t in range(tp))


def bandwidth(cluster: Cluster, kind: str, layout: Layout) -> float:
    """Bytes/s of the slowest link a group of this kind uses."""
    inter = crosses_nodes(kind, layout.tp, layout.pp, layout.dp, cluster.gpus_per_node)
    return (cluster.inter_node_gbps if inter else cluster.intra_node_gbps) * 1e9


@dataclass
class DataParallelTime:
    """Data-parallel seconds on one pipeline rank that do not hide behind backward."""
    overlapped: float = 0.0  # bucket reductions finishing after the schedule
    embedding: float = 0.0  # the tied embedding, reduced after the schedule
    all_gather: float = 0.0  # the distributed optimizer's parameter all-gather
    total: float = 0.0
    windows: list = field(default_factory=list)  # per chunk: (chunk, backward start, end, reduce, last bucket)


def dp_exposed(costs: LayoutCosts, buckets: list[list[BucketLayout]], param_buffer: int, r: int) -> DataParallelTime:
    """Data-parallel time on pipeline rank r that does not hide behind backward.

    Buckets start reducing during each chunk's last backward of the step (one stream, in order):
    chunk c's last backward ends c*p backward passes (of one chunk) before the schedule does, so
    with interleaving the later chunks' buckets have more time. A bucket cannot finish before its
    last gradient (the chunk's last bucket: its first-defined parameters) is ready, at the end of
    that backward. The tied embedding (pp > 1) is reduced after the schedule: over the embedding
    group, then over dp like the other buckets. The distributed optimizer all-gathers the updated
    parameters after the step."""
    layout = costs.layout
    t, p, v, d = layout.tp, layout.pp, layout.v, layout.dp
    out = DataParallelTime()
    if d == 1 and not (p > 1 and r in (0, p - 1)):
        return out
    ring = (d - 1) / d
    reduce_factor = ring if layout.distributed_optimizer else 2 * ring  # reduce-scatter vs all-reduce
    last_vs = p * v - 1
    free = -math.inf
    for c in reversed(range(v)):  # chunk v-1's last backward comes first
        layers = costs.layer_counts[c * p + r]
        tb = (layers * costs.bwd + (2 * costs.logits_fwd if c * p + r == last_vs else 0.0)) / t / costs.rate
        end = -c * p * tb
        normal = [b.end - b.start for b in buckets[c] if not b.deferred]
        if not normal or d == 1:
            continue
        total_c = sum(normal) * 4 * reduce_factor / costs.bw_dp
        last_bucket = normal[-1] * 4 * reduce_factor / costs.bw_dp
        start = max(free, end - tb)
        free = max(start + total_c, end + last_bucket)
        out.windows.append((c, end - tb, end, total_c, last_bucket))
    out.overlapped = max(0.0, free) if out.windows else 0.0
    deferred = [b.end - b.start for chunk in buckets for b in chunk if b.deferred]
    if deferred:
        n = sum(deferred)
        out.embedding = n * 4 / costs.bw_emb + (n * 4 * reduce_factor / costs.bw_dp if d > 1 else 0.0)
    if layout.distributed_optimizer and d > 1:
        out.all_gather = ring * param_buffer / costs.bw_dp
    out.total = out.overlapped + out.embedding + out.all_gather
    return out
