"""Bytes per GPU: parameters, gradient buffers and optimizer states exactly as megalite allocates
them, activations held by the schedule, the output layer, and the transient peak of the build."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from megalite.models.config import TransformerConfig
from megalite.models.memory import layer_activation_bytes
from megalite.optim.buffers import BucketLayout, plan_layout
from megalite.pipeline.schedules import build_program, peak_in_flight
from megalite.tools.plan.inputs import DTYPE_BYTES, GIB, Layout, Run, positions, rank_parameters


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU on the fullest pipeline stage."""
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    output_layer: float
    overhead: float
    total: float

    @property
    def states(self) -> float:
        """Parameters, gradients and optimizer states: what no micro-batch size changes."""
        return self.parameters + self.gradients + self.optimizer


@dataclass
class StateBytes:
    """What one rank holds for the model and the optimizer, in bytes (and elements)."""
    numel: int  # parameter elements held (real)
    padded_numel: int  # elements of the parameter / gradient buffers (with bucket padding)
    owned_numel: int  # elements this rank's optimizer updates
    params: int  # sum of p.numel() * p.element_size(): the parameters themselves
    param_buffer: int  # the flat parameter buffers, padding included (what is allocated)
    grads: int  # fp32 gradient buffers, padding included: grad_data.numel() * 4
    grad_padding: int  # of which padding
    optimizer: int  # MegaliteOptimizer.state_bytes(): fp32 master copies + Adam exp_avg, exp_avg_sq
    build_peak: int  # transient while the model is built and laid out (before any activation)
    buckets: list[list[BucketLayout]] = field(default_factory=list)  # per chunk, as plan_layout lays them out

    @property
    def steady(self) -> int:
        return self.param_buffer + self.grads + self.optimizer


def rank_state_bytes(config: TransformerConfig, *, tp: int = 1, pp: int = 1, dp: int = 1, vpp: int | None = None,
                     pp_rank: int = 0, dp_rank: int = 0, dtype: str = "bf16", distributed_optimizer: bool = False,
                     seq_length: int | None = None, ddp_bucket_size: int = 40_000_000,
                     pipeline_layers=None) -> StateBytes:
    """Bytes of parameters, gradient buffers and optimizer states on rank (pp_rank, dp_rank, any
    tp rank), exactly as megalite allocates them (see megalite.optim.buffers / optimizer)."""
    seq_length = seq_length or config.max_position_embeddings
    explicit = tuple(pipeline_layers) if pipeline_layers is not None else None
    buckets = _rank_buckets(config, tp, pp, vpp, pp_rank, seq_length, explicit, ddp_bucket_size, dp)
    pb = DTYPE_BYTES[dtype]
    reals = [sum(b.real_numel for b in chunk) for chunk in buckets]
    pads = [sum(b.end - b.start for b in chunk) for chunk in buckets]
    real, padded = sum(reals), sum(pads)
    owned = (sum(b.owned_numel(dp, dp_rank) for chunk in buckets for b in chunk) if distributed_optimizer
             else real)
    # _master: fp32 and unsharded -> the parameter itself; fp32 sharded -> the parameter buffer,
    # updated in place; bf16/fp16 -> an fp32 copy (4 bytes). Adam: exp_avg + exp_avg_sq, fp32.
    master = 0 if dtype == "fp32" else 4
    optimizer = owned * (master + 8)
    # Transient peak while megalite builds the rank (training.build_model_chunks, build_optimizer):
    # every chunk is built in fp32 (4 B); then, chunk by chunk, its flat buffers are allocated -- the
    # parameter buffer (model dtype), the fp32 gradients (4) and, below fp32, the fp32 initial values
    # kept for the masters (4) -- before its fp32 parameters are released. Below fp32 the optimizer
    # then clones its masters (4 B per owned element) before those initial values are freed.
    per_elem = 8 if dtype == "fp32" else pb + 8
    build = max(per_elem * sum(pads[:c + 1]) + 4 * sum(reals[c:]) for c in range(len(buckets)))
    if dtype != "fp32":
        build = max(build, per_elem * padded + 4 * owned)
    return StateBytes(numel=real, padded_numel=padded, owned_numel=owned, params=real * pb,
                      param_buffer=padded * pb, grads=padded * 4, grad_padding=(padded - real) * 4,
                      optimizer=optimizer, build_peak=build, buckets=buckets)


_BUCKET_CACHE: dict = {}


def _rank_buckets(config, tp, pp, vpp, pp_rank, seq_length, explicit, bucket_numel, dp) -> list:
    """plan_layout of every chunk of one rank, cached (the planner asks for the same ones often)."""
    key = (repr(config), positions(config, seq_length), tp, pp, vpp, pp_rank, explicit, bucket_numel, dp)
    if key not in _BUCKET_CACHE:
        if len(_BUCKET_CACHE) > 4096:
            _BUCKET_CACHE.clear()
        chunks = rank_parameters(config, tp, pp, vpp, pp_rank, seq_length, explicit)
        _BUCKET_CACHE[key] = [plan_layout(c, bucket_numel, dp) for c in chunks]
    return _BUCKET_CACHE[key]


@functools.lru_cache(maxsize=4096)
def in_flight_chunks(p: int, r: int, m: int, vpp: int | None) -> int:
    """Micro-batches (of one model chunk each) whose activations pipeline rank r holds at its peak,
    read off the schedule program megalite runs."""
    return peak_in_flight(build_program(p, r, m, vpp))


def stored_activations(config: TransformerConfig, layout: Layout, run: Run, layers: int,
                       act_scale: float) -> tuple[float, float]:
    """(bytes stored for backward by `layers` layers of one micro-batch, transient working set during
    the backward of recomputed layers), from Korthikanti et al.'s per-layer formula."""
    s, b = run.seq_length, layout.micro_batch_size

    def per_layer(recompute: str) -> float:
        return layer_activation_bytes(config, s, b, layout.tp, recompute, layout.sequence_parallel,
                                      run.attention_backend) * act_scale

    full_layer = per_layer(kept_activations(layout, run))
    if layout.recompute != "full":
        return layers * full_layer, 0.0
    inp = per_layer("full")
    if run.recompute_method == "block":
        k = layers if run.recompute_num_layers is None else min(run.recompute_num_layers, layers)
        return k * inp + (layers - k) * full_layer, (full_layer if k else 0.0)
    k = run.recompute_num_layers or 1
    return math.ceil(layers / k) * inp, min(k, layers) * full_layer


def kept_activations(layout: Layout, run: Run) -> str:
    """What a layer that is not fully recomputed keeps for backward: fused SDPA (flash /
    memory-efficient) keeps no s^2 attention matrices, like selective recomputation."""
    if run.attention_backend == "sdpa" or layout.recompute == "selective":
        return "selective"
    return "none"


def output_layer_bytes(config: TransformerConfig, layout: Layout, run: Run, vocab: int) -> float:
    """The last stage's extra: the final LayerNorm input and the (sequence-gathered) output-layer
    input, in the model dtype; the cross-entropy's peak: the model-dtype logits, their fp32 copy and
    the fp32 softmax kept for backward (a copy only when the model is not fp32)."""
    s, b, h, t = run.seq_length, layout.micro_batch_size, config.hidden_size, layout.tp
    ab = DTYPE_BYTES[run.dtype]
    sbh = s * b * h * ab
    output = (sbh / t if layout.sequence_parallel else sbh) + sbh
    output += s * b * (vocab // t) * (ab + 4 + (4 if ab != 4 else 0))
    return output


def over(need: float, capacity: float) -> str:
    """GiB with enough digits to show that it exceeds the capacity."""
    for digits in (1, 2, 3):
        text = f"{need / GIB:.{digits}f}"
        if float(text) > capacity / GIB:
            return text
    return f"{need / GIB:.4f}"
