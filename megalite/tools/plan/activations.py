"""Activation bytes per GPU: what a micro-batch's layers keep for backward (Korthikanti et al.'s
per-layer formula, a MoE layer's experts in place of the MLP), the chunks the schedule holds in
flight, the output layer's and cross-entropy's on the last stage, and multi-token prediction's."""
from __future__ import annotations

import functools
import math

from megalite.models.config import TransformerConfig
from megalite.models.memory import layer_activation_bytes
from megalite.pipeline.schedules import build_program, peak_in_flight
from megalite.tools.plan.experts import moe_layer_extra_bytes
from megalite.tools.plan.inputs import DTYPE_BYTES, Layout, Run


@functools.lru_cache(maxsize=4096)
def in_flight_chunks(p: int, r: int, m: int, vpp: int | None, schedule: str = "1f1b", extra_warmup: int = 0) -> int:
    """Micro-batches (of one model chunk each) whose activations pipeline rank r holds at its peak,
    read off the schedule program megalite runs (zb-h1: forwarded and not yet through W)."""
    return peak_in_flight(build_program(p, r, m, vpp, schedule, extra_warmup=extra_warmup))


def stored_activations(config: TransformerConfig, layout: Layout, run: Run, layers: int,
                       act_scale: float, moe_layers: float = 0.0) -> tuple[float, float]:
    """(bytes stored for backward by `layers` layers of one micro-batch, of which `moe_layers` are
    MoE layers, transient working set during the backward of recomputed layers), from Korthikanti
    et al.'s per-layer formula, a MoE layer's experts in place of the MLP (experts.activation_terms)."""
    s, b = run.seq_length, layout.micro_batch_size

    def per_layer(recompute: str) -> float:
        return layer_activation_bytes(config, s, b, layout.tp, recompute, layout.sequence_parallel,
                                      run.attention_backend, cp=layout.cp, cp_comm_type="p2p") * act_scale

    full_layer = per_layer(kept_activations(layout, run))
    moe_layer = full_layer + moe_layer_extra_bytes(config, layout, run, "none") if moe_layers else full_layer
    if layout.recompute != "full":
        return (layers - moe_layers) * full_layer + moe_layers * moe_layer, 0.0
    inp = per_layer("full")
    widest = max(full_layer, moe_layer)  # what a recomputed layer holds during its backward
    if run.recompute_method == "block":
        k = layers if run.recompute_num_layers is None else min(run.recompute_num_layers, layers)
        return k * inp + (layers - k) * widest, (widest if k else 0.0)
    k = run.recompute_num_layers or 1
    return math.ceil(layers / k) * inp, min(k, layers) * widest


def kept_activations(layout: Layout, run: Run) -> str:
    """What a layer that is not fully recomputed keeps for backward: fused SDPA (flash /
    memory-efficient) keeps no s^2 attention matrices, like selective recomputation."""
    if run.attention_backend == "sdpa" or layout.recompute == "selective":
        return "selective"
    return "none"


def output_layer_bytes(config: TransformerConfig, layout: Layout, run: Run, vocab: int) -> float:
    """The last stage's extra: the final LayerNorm input (the stream: fp32 under --fp32-residual-connection)
    and the (sequence-gathered) output-layer input, in the model dtype; the cross-entropy's peak: the
    model-dtype logits, their fp32 copy and the fp32 softmax kept for backward (a copy only when the
    model is not fp32)."""
    s, b, h, t = run.seq_length // layout.cp, layout.micro_batch_size, config.hidden_size, layout.tp
    ab = DTYPE_BYTES[run.dtype]
    sbh = s * b * h * ab
    stream = s * b * h * (4 if config.fp32_residual_connection else ab)
    output = (stream / t if layout.sequence_parallel else stream) + sbh
    output += s * b * (vocab // t) * (ab + 4 + (4 if ab != 4 else 0))
    return output


def mtp_bytes(config: TransformerConfig, layout: Layout, run: Run, vocab: int) -> float:
    """What the multi-token prediction modules (megalite.models.mtp) keep on the last stage for one
    micro-batch, besides the main head's `output_layer_bytes`. Per depth: its transformer layer (of
    the last layer's kind, under the layout's recomputation), the inputs of enorm and hnorm and of
    its final norm (2h each, /t under SP), eh_proj's input ([embedding; hidden], 4h, kept gathered
    under SP) and the output layer's (2h, gathered), and the fp32 softmax its cross-entropy keeps for
    backward (4 B x vocab/t); the logits' transient peak is the main head's, counted once."""
    depth = config.mtp_num_layers
    if not depth:
        return 0.0
    s, b, h, t = run.seq_length // layout.cp, layout.micro_batch_size, config.hidden_size, layout.tp
    ab = DTYPE_BYTES[run.dtype]
    moe = 1.0 if config.is_moe_layer(config.num_layers) else 0.0
    layer, _ = stored_activations(config, layout, run, 1, ab / 2.0, moe)
    sharded = 3 * s * b * h * ab / (t if layout.sequence_parallel else 1)  # enorm, hnorm, final norm inputs
    whole = s * b * (2 * h + h) * ab  # eh_proj's and the output layer's inputs
    return depth * (layer + sharded + whole + s * b * (vocab // t) * 4.0)
