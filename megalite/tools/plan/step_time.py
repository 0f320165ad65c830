"""Seconds per step: FLOPs over the sustained throughput, the pipeline bubble, tensor-parallel
collectives, pipeline messages, the data-parallel reduction that does not hide behind backward,
and the optimizer step. Here: the step's causes (`StepTime`), one layout's costs (`layout_costs`)
and the compute (a layer's, a MoE layer's and multi-token prediction's FLOPs); the links, the
context-parallel ring and data parallelism's exposed time in comm.py (importable from here too)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megalite.metrics import layer_forward_flops, mtp_forward_flops
from megalite.models.config import TransformerConfig
from megalite.parallel.layers import pad_vocab_size
from megalite.pipeline.partition import stage_layer_counts
from megalite.tools.plan.comm import (
    DataParallelTime,
    bandwidth,
    crosses_nodes,
    dp_exposed,
    dp_traffic,
    forward_gathers,
    local_sgd_exposed,
    outer_sync_bytes,
    ring_layer_bytes,
    ring_layer_parts,
    zero3_exposed,
)
from megalite.tools.plan.costs import OPTIMIZER_TRAFFIC, LayoutCosts
from megalite.tools.plan.experts import dispatch_bytes, dispatch_exchanges
from megalite.tools.plan.fp8 import fp8_rate
from megalite.tools.plan.inputs import DTYPE_BYTES, Cluster, Layout, Run

__all__ = [
    "OPTIMIZER_TRAFFIC",
    "DataParallelTime",
    "LayoutCosts",
    "StepTime",
    "bandwidth",
    "crosses_nodes",
    "dp_exposed",
    "dp_traffic",
    "forward_gathers",
    "layer_flops",
    "layout_costs",
    "local_sgd_exposed",
    "moe_costs",
    "mtp_flops",
    "outer_sync_bytes",
    "ring_layer_bytes",
    "zero3_exposed",
]


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
    cp_comm: float = 0.0  # context parallelism's ring traffic not hidden behind the compute (in total)
    ep_comm: float = 0.0  # MoE token dispatch (all-to-all over EP, gathers over ETP), all exposed (in total)


def layout_costs(config: TransformerConfig, layout: Layout, cluster: Cluster, run: Run, m: int) -> LayoutCosts:
    t, p, v, b = layout.tp, layout.pp, layout.v, layout.micro_batch_size
    s, h = run.seq_length, config.hidden_size
    local = s // layout.cp  # tokens of each sequence on one CP rank
    ab = DTYPE_BYTES[run.dtype]
    bw_tp, bw_pp = bandwidth(cluster, "tp", layout), bandwidth(cluster, "pp", layout)
    vocab = pad_vocab_size(config.vocab_size, t, config.make_vocab_size_divisible_by)
    fwd, bwd, core = layer_flops(config, s, b, layout.recompute)
    ar_bytes = local * b * h * ab
    stream = 4 if config.fp32_residual_connection else ab  # the stages' messages: fp32 under that flag
    msg = (local // t if layout.sequence_parallel else local) * b * h * stream
    moe = moe_costs(config, layout, cluster, run) if config.is_moe else {}
    mtp_fwd, mtp_bwd = mtp_flops(config, s, b, layout.recompute, vocab)
    depth = config.mtp_num_layers
    mtp_moe = sum(config.is_moe_layer(config.num_layers + k) for k in range(depth))
    per_layer = {"none": 4, "selective": 4, "full": 6}[layout.recompute]
    moe_per_layer = moe.get("moe_ar_per_layer", per_layer)
    lat = cluster.collective_latency_ms / 1e3  # every exchange's start-up (exposed.py)
    ring = ring_layer_parts(config, layout, s, ab) if layout.cp > 1 else {}
    costs = LayoutCosts(
        config=config, layout=layout, cluster=cluster, run=run, micro_batches=m,
        layer_counts=stage_layer_counts(config.num_layers, p, layout.vpp,
                                        list(run.pipeline_layers) if run.pipeline_layers else None),
        vocab=vocab, act_bytes=ab, bw_tp=bw_tp, bw_pp=bw_pp, bw_dp=bandwidth(cluster, "dp", layout),
        bw_emb=bandwidth(cluster, "emb", layout), rate=cluster.peak_tflops * 1e12 * cluster.efficiency,
        fwd=fwd, bwd=bwd, core=core, logits_fwd=2.0 * s * b * h * vocab, ar_bytes=ar_bytes,
        # an all-reduce, or under SP an all-gather and a reduce-scatter: one start-up each
        ar_time=(2 if layout.sequence_parallel else 1) * lat + 2.0 * (t - 1) / t * ar_bytes / bw_tp if t > 1 else 0.0,
        ar_per_layer=6 if layout.recompute == "full" else 4,  # the recomputed forward repeats its 2
        # per micro-batch and chunk: 1 forward + 1 backward exchange
        msg=msg, pp_mb=2.0 * v * (lat + msg / bw_pp) if p > 1 else 0.0,
        bw_cp=bandwidth(cluster, "cp", layout) if layout.cp > 1 else 0.0,
        ring_bytes=ring_layer_bytes(config, layout, s, ab) if layout.cp > 1 else 0.0,
        ring_step_bytes=(ring["forward"] / (layout.cp - 1), ring["backward"] / (layout.cp - 1)) if ring else (0.0, 0.0),
        **moe,
        mtp_fwd=mtp_fwd, mtp_bwd=mtp_bwd, mtp_moe=mtp_moe,
        # per depth: its layer's collectives, and the embedding lookup, eh_proj and output layer's
        mtp_ar=(depth - mtp_moe) * per_layer + mtp_moe * moe_per_layer + 3 * depth,
    )
    return dataclasses.replace(costs, rate=fp8_rate(costs)) if run.fp8_layers else costs


def mtp_flops(config: TransformerConfig, s: int, b: int, recompute: str, vocab: int) -> tuple[float, float]:
    """(forward, backward incl. recomputation) FLOPs of the multi-token prediction modules for one
    micro-batch, all TP ranks together (`megalite.metrics.mtp_forward_flops` with the padded
    vocabulary); recomputation repeats their layers' forward (full) or attention core (selective),
    not eh_proj or the output layer."""
    dense, core = mtp_forward_flops(config, s, b, vocab)
    fwd = dense + core
    bwd = 2.0 * fwd
    if recompute == "full":
        bwd += sum(sum(layer_forward_flops(config, s, b, moe=config.is_moe_layer(config.num_layers + k)))
                   for k in range(config.mtp_num_layers))
    elif recompute == "selective":
        bwd += core
    return fwd, bwd


def moe_costs(config: TransformerConfig, layout: Layout, cluster: Cluster, run: Run) -> dict:
    """LayoutCosts' MoE fields. A MoE layer's FLOPs count the router, the top-k experts and the
    shared expert (`layer_forward_flops(moe=True)`); with balanced routing a stage's expert work
    spreads evenly over its TP x CP x DP = ETP x EP x EDP ranks, so per micro-batch one rank does
    1/(tp x cp) of it whatever ep and etp, like the rest of the layer. Its TP collectives are the
    attention's, and the shared expert's; the dispatcher's bytes cross the EP and ETP groups."""
    fwd, bwd, _ = layer_flops(config, run.seq_length, layout.micro_batch_size, layout.recompute, moe=True)
    sent = dispatch_bytes(config, layout, run)
    over = "etp_ep" if config.moe_token_dispatcher_type == "allgather" else "ep"
    bw_ep, bw_etp = bandwidth(cluster, over, layout), bandwidth(cluster, "etp", layout)
    blocks = 2 if config.moe_shared_expert_intermediate_size else 1  # blocks with TP collectives
    exchanges = dispatch_exchanges(config, layout)
    return dict(moe_count=sum(config.moe_layer_freq), moe_fwd=fwd, moe_bwd=bwd,
                moe_ar_per_layer=blocks * (3 if layout.recompute == "full" else 2),
                ep_bytes=sent["ep"], etp_bytes=sent["etp"], ep_exchanges=exchanges,
                ep_time=exchanges * cluster.collective_latency_ms / 1e3 + sent["ep"] / bw_ep + sent["etp"] / bw_etp,
                bw_ep=bw_ep, bw_etp=bw_etp,
                bw_edp=bandwidth(cluster, "edp", layout))


def layer_flops(config: TransformerConfig, s: int, b: int, recompute: str,
                moe: bool = False) -> tuple[float, float, float]:
    """(forward, backward incl. recomputation, attention-core forward) FLOPs of one layer and one
    micro-batch, all TP ranks together (`megalite.metrics.layer_forward_flops`: 24*s*b*h^2 dense plus
    the attention core 4*b*s^2*h for GPT-2's shape; a MoE layer's active experts); backward twice the forward."""
    dense, core = layer_forward_flops(config, s, b, moe=moe)
    fwd = dense + core
    bwd = 2.0 * fwd
    if recompute == "full":
        bwd += fwd
    elif recompute == "selective":
        bwd += core
    return fwd, bwd, core
