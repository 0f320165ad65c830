"""Parallel layout planner: which (tp, pp, dp, vpp, micro-batch, recompute, sequence parallel,
distributed optimizer) to train a GPT with, on how many GPUs, and what it costs.

    python -m megalite.tools.plan --model gpt-175b --gpus 1024 --gpu-memory-gib 80 \\
        --global-batch-size 1536 --seq-length 2048 [--explain] [--json]

    from megalite.tools.plan import Cluster, Layout, plan, predict, check_layout, check_args
    result = plan(preset("gpt-175b"), Cluster(gpus=1024), global_batch_size=1536, seq_length=2048)
    best = result[0]                       # a Prediction: .memory, .time, .fits, .command()
    fits, pred = check_layout(config, tp=8, pp=16, dp=8, micro_batch_size=1, global_batch_size=1536,
                              seq_length=2048, gpu_memory_bytes=80 * 2**30)

Every layout megalite accepts is enumerated and, for each, the planner predicts:

- memory per GPU on the fullest pipeline stage, itemised: parameters, fp32 gradient buffers and
  optimizer states counted the way megalite lays them out (`megalite.optim.buffers`: reverse
  definition order, buckets padded to a multiple of dp; `MegaliteOptimizer._master`), activations
  from `megalite.models.activation_bytes_per_layer` (Korthikanti et al. 2022) times the layers held
  in flight by the 1F1B / interleaved schedule, the output layer and cross-entropy buffers on the
  last stage, and a fixed framework overhead; plus the transient peak while the model is built;
- step time: model FLOPs (`megalite.metrics.gpt_flops_per_iteration`, plus what recomputation runs
  again) over the cluster's sustained throughput, the pipeline bubble
  (`megalite.pipeline.schedules.theoretical_bubble`), tensor-parallel collectives, pipeline
  point-to-point messages, the data-parallel gradient reduction that cannot hide behind the last
  backward pass, and the optimizer step.

docs/planner.md states every formula and assumption.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace

from megalite.metrics import gpt_flops_per_iteration
from megalite.models.config import PRESETS, TransformerConfig
from megalite.models.memory import activation_bytes_per_layer
from megalite.optim.buffers import plan_layout
from megalite.parallel.layers import pad_vocab_size
from megalite.pipeline.partition import stage_layer_counts
from megalite.pipeline.schedules import theoretical_bubble

GIB = 1024 ** 3
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
RECOMPUTE = ("none", "selective", "full")
GPT_PRESETS = tuple(name for name in PRESETS if name.startswith("gpt"))

# Bytes of memory traffic per element the optimizer step updates (fused AdamW on the GPU): Adam
# reads master, gradient, exp_avg, exp_avg_sq (16) and writes master, exp_avg, exp_avg_sq (12); the
# global norm reads the gradient (4); clipping reads and writes it (8); publishing the new weights
# reads the master and writes the model-dtype parameter (4 + 2 for bf16/fp16, nothing for fp32,
# whose masters are the parameters). fp16 adds the unscaling pass (read + write, 8).
_OPTIMIZER_TRAFFIC = {"bf16": 16 + 12 + 4 + 8 + 6, "fp16": 16 + 12 + 4 + 8 + 6 + 8, "fp32": 16 + 12 + 4 + 8}


# -------------------------------------------------------------------------------------------------
# Inputs
# -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cluster:
    """The machine. Bandwidths are per GPU and per direction, in GB/s (10^9 bytes), as NCCL's
    "bus bandwidth": an all-reduce of X bytes over n GPUs takes 2 (n-1)/n X / bandwidth."""
    gpus: int
    gpu_memory_gib: float = 80.0
    gpus_per_node: int = 8
    intra_node_gbps: float = 450.0  # H100 SXM NVLink 4: 900 GB/s both directions
    inter_node_gbps: float = 50.0  # one 400 Gb/s NIC per GPU
    peak_tflops: float = 989.0  # H100 SXM dense bf16
    efficiency: float = 0.5  # fraction of peak the transformer's matmuls sustain
    hbm_gbps: float = 3350.0  # H100 SXM HBM3, for the (memory-bound) optimizer step
    overhead_gib: float = 2.0  # CUDA context, cuBLAS workspaces, NCCL buffers

    def __post_init__(self):
        for name in ("gpus", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("gpu_memory_gib", "intra_node_gbps", "inter_node_gbps", "peak_tflops", "efficiency",
                     "hbm_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.efficiency > 1:
            raise ValueError(f"efficiency is a fraction of peak (0-1], got {self.efficiency}")
        if self.overhead_gib < 0:
            raise ValueError(f"overhead_gib must be >= 0, got {self.overhead_gib}")

    @property
    def memory_bytes(self) -> float:
        return self.gpu_memory_gib * GIB


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int | None = None  # model chunks per pipeline rank (interleaved 1F1B); None = 1
    micro_batch_size: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    distributed_optimizer: bool = False

    def __post_init__(self):
        if self.vpp is not None and self.vpp <= 1:
            object.__setattr__(self, "vpp", None)  # one chunk per rank: the plain 1F1B schedule
        for name in ("tp", "pp", "dp", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def v(self) -> int:
        return self.vpp or 1

    def short(self) -> str:
        parts = [f"tp {self.tp}", f"pp {self.pp}", f"dp {self.dp}"]
        if self.vpp:
            parts.append(f"vpp {self.vpp}")
        parts += [f"mb {self.micro_batch_size}", f"recompute {self.recompute}"]
        if self.sequence_parallel:
            parts.append("sp")
        if self.distributed_optimizer:
            parts.append("dist-opt")
        return " ".join(parts)


@dataclass(frozen=True)
class Run:
    """What one training run asks for besides the model shape and the layout."""
    global_batch_size: int
    seq_length: int
    dtype: str = "bf16"  # bf16 | fp16 | fp32: the model dtype (masters are always fp32)
    ddp_bucket_size: int = 40_000_000  # --ddp-bucket-size
    # sdpa: fused attention stores no s^2 matrices; torch and fused (softmax kernel) store them
    attention_backend: str = "sdpa"
    pipeline_layers: tuple | None = None  # --pipeline-layers, explicit layer count per virtual stage
    recompute_method: str = "uniform"
    recompute_num_layers: int | None = None

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.attention_backend not in ("sdpa", "fused", "torch"):
            raise ValueError(f"attention_backend must be sdpa, fused or torch, got {self.attention_backend!r}")
        for name in ("global_batch_size", "seq_length", "ddp_bucket_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


# -------------------------------------------------------------------------------------------------
# Parameters, gradient buffers and optimizer states: exactly what megalite allocates
# -------------------------------------------------------------------------------------------------
def _check_gpt(config: TransformerConfig) -> None:
    if config.layernorm_position != "pre":
        raise ValueError("the planner models megalite's GPT (pre-LayerNorm, tied embeddings); "
                         f"this config has layernorm_position={config.layernorm_position!r}")


def positions(config: TransformerConfig, seq_length: int) -> int:
    """Rows of the position embedding: the preset's, grown to the sequence length as
    `megalite.arguments.model_config` does."""
    return max(config.max_position_embeddings, seq_length)


def layer_parameter_numels(h: int, ffn: int, tp: int) -> list[int]:
    """One pre-LN transformer layer's parameters on one TP rank, in definition order: input norm
    (w, b), QKV (column-parallel w, b), projection (row-parallel w, replicated b), post-attention
    norm (w, b), fc1 (column-parallel w, b), fc2 (row-parallel w, replicated b)."""
    return [h, h, 3 * h * h // tp, 3 * h // tp, h * h // tp, h, h, h, ffn * h // tp, ffn // tp, h * ffn // tp, h]


def rank_parameters(config: TransformerConfig, tp: int, pp: int, vpp: int | None, pp_rank: int,
                    seq_length: int, pipeline_layers=None) -> list[list[tuple[int, bool]]]:
    """(numel, deferred) of every parameter one rank holds, per model chunk, in definition order,
    as `megalite.models.GPTModel` builds them. deferred: the tied word embedding when pp > 1,
    which the gradient buffer keeps in a bucket of its own."""
    _check_gpt(config)
    v = vpp or 1
    counts = stage_layer_counts(config.num_layers, pp, vpp,
                                list(pipeline_layers) if pipeline_layers is not None else None)
    h, ffn = config.hidden_size, config.ffn_hidden_size
    vocab = pad_vocab_size(config.vocab_size, tp, config.make_vocab_size_divisible_by)
    layer = layer_parameter_numels(h, ffn, tp)
    chunks = []
    for c in range(v):
        vs = c * pp + pp_rank
        pre, post = vs == 0, vs == pp * v - 1
        params = []
        if pre or post:
            params.append((vocab // tp * h, pp > 1))
        if pre:
            params.append((positions(config, seq_length) * h, False))
        params += [(n, False) for n in layer] * counts[vs]
        if post:
            params += [(h, False), (h, False)]
        chunks.append(params)
    return chunks


def buffer_buckets(params: list[tuple[int, bool]], bucket_numel: int, dp: int) -> list[tuple[int, int, bool]]:
    """(real elements, padded elements, deferred) of each bucket of one chunk's gradient buffer, as
    `ParamAndGradBuffer` lays it out (megalite.optim.buffers.plan_layout: reverse order, a bucket
    closes once it reaches bucket_numel, deferred parameters alone, every parameter starting at a
    multiple of 64 elements, each bucket padded to a multiple of 64 * dp)."""
    return [(b.real_numel, b.end - b.start, b.deferred) for b in plan_layout(params, bucket_numel, dp)]


def owned_elements(chunks: list[list[tuple[int, bool]]], bucket_numel: int, dp: int, dp_rank: int) -> int:
    """Parameter elements in DP rank `dp_rank`'s shards of every bucket of these chunks (alignment
    padding sits between parameters, so ranks own different amounts)."""
    return sum(b.owned_numel(dp, dp_rank) for c in chunks for b in plan_layout(c, bucket_numel, dp))


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
    buckets: list = field(default_factory=list)  # per chunk: [(real, padded, deferred), ...]

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
    real = sum(r for chunk in buckets for r, _, _ in chunk)
    padded = sum(p for chunk in buckets for _, p, _ in chunk)
    owned = (owned_elements(rank_parameters(config, tp, pp, vpp, pp_rank, seq_length, explicit), ddp_bucket_size,
                            dp, dp_rank) if distributed_optimizer else real)
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
    reals = [sum(r for r, _, _ in chunk) for chunk in buckets]
    pads = [sum(p for _, p, _ in chunk) for chunk in buckets]
    build = max(per_elem * sum(pads[:c + 1]) + 4 * sum(reals[c:]) for c in range(len(buckets)))
    if dtype != "fp32":
        build = max(build, per_elem * padded + 4 * owned)
    return StateBytes(numel=real, padded_numel=padded, owned_numel=owned, params=real * pb,
                      param_buffer=padded * pb, grads=padded * 4, grad_padding=(padded - real) * 4,
                      optimizer=optimizer, build_peak=build, buckets=buckets)


_BUCKET_CACHE: dict = {}


def _rank_buckets(config, tp, pp, vpp, pp_rank, seq_length, explicit, bucket_numel, dp) -> list:
    """buffer_buckets of every chunk of one rank, cached (the planner asks for the same ones often)."""
    key = (config.num_layers, config.hidden_size, config.ffn_hidden_size, config.vocab_size,
           config.make_vocab_size_divisible_by, positions(config, seq_length), tp, pp, vpp, pp_rank, explicit,
           bucket_numel, dp)
    if key not in _BUCKET_CACHE:
        if len(_BUCKET_CACHE) > 4096:
            _BUCKET_CACHE.clear()
        chunks = rank_parameters(config, tp, pp, vpp, pp_rank, seq_length, explicit)
        _BUCKET_CACHE[key] = [buffer_buckets(c, bucket_numel, dp) for c in chunks]
    return _BUCKET_CACHE[key]


# -------------------------------------------------------------------------------------------------
# Placement: which links a group's ring crosses (rank = pp_rank * dp * tp + dp_rank * tp + tp_rank)
# -------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _crosses_nodes(kind: str, tp: int, pp: int, dp: int, gpus_per_node: int) -> bool:
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


def _bandwidth(cluster: Cluster, kind: str, layout: Layout) -> float:
    """Bytes/s of the slowest link a group of this kind uses."""
    inter = _crosses_nodes(kind, layout.tp, layout.pp, layout.dp, cluster.gpus_per_node)
    return (cluster.inter_node_gbps if inter else cluster.intra_node_gbps) * 1e9


# -------------------------------------------------------------------------------------------------
# Prediction
# -------------------------------------------------------------------------------------------------
@dataclass
class Prediction:
    layout: Layout
    config: TransformerConfig
    cluster: Cluster
    run: Run
    fits: bool
    # bytes on the fullest stage: parameters, gradients, optimizer, activations, output_layer, overhead, total
    memory: dict
    peak_stage: int  # the pipeline rank of that stage
    build_peak: float  # bytes while the model is built (plus overhead)
    time: dict  # seconds: compute, imbalance, tp_comm, pp_comm, bubble, dp_comm, optimizer, total
    micro_batches: int
    bubble_fraction: float
    model_flops: float  # per iteration, as megalite's log counts them
    hardware_flops: float  # per iteration, with recomputation
    reason: str | None = None  # why it does not fit
    details: dict = field(default_factory=dict)  # intermediate numbers for --explain

    @property
    def step_time(self) -> float:
        return self.time["total"]

    @property
    def peak_bytes(self) -> float:
        return max(self.memory["total"], self.build_peak)

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_time * self.cluster.gpus * self.cluster.peak_tflops * 1e12)

    @property
    def tokens_per_s(self) -> float:
        return self.run.global_batch_size * self.run.seq_length / self.step_time

    def command(self, model_flags: list[str] | None = None) -> str:
        return launch_command(self, model_flags)

    def to_dict(self, model_flags: list[str] | None = None) -> dict:
        return {
            "layout": asdict(self.layout), "fits": self.fits, "reason": self.reason,
            "micro_batches": self.micro_batches, "peak_stage": self.peak_stage,
            "memory_bytes": {k: int(v) for k, v in self.memory.items()},
            "memory_gib": {k: round(v / GIB, 3) for k, v in self.memory.items()},
            "build_peak_gib": round(self.build_peak / GIB, 3), "peak_gib": round(self.peak_bytes / GIB, 3),
            "time_s": {k: round(v, 6) for k, v in self.time.items()},
            "bubble_fraction": round(self.bubble_fraction, 6), "mfu": round(self.mfu, 4),
            "tokens_per_s": round(self.tokens_per_s, 1), "model_flops": self.model_flops,
            "hardware_flops": self.hardware_flops, "command": self.command(model_flags),
        }


def _layer_flops(s: int, b: int, h: int, ffn: int, recompute: str) -> tuple[float, float, float]:
    """(forward, backward incl. recomputation, attention-core forward) FLOPs of one layer and one
    micro-batch, all TP ranks together. Forward: QKV, projection, MLP 2*s*b*(4h^2 + 2*h*ffn) (24 s b h^2
    for ffn = 4h) plus the attention core 4*b*s^2*h; backward twice the forward."""
    core = 4.0 * b * s * s * h
    fwd = 2.0 * s * b * (4 * h * h + 2 * h * ffn) + core
    bwd = 2.0 * fwd
    if recompute == "full":
        bwd += fwd
    elif recompute == "selective":
        bwd += core
    return fwd, bwd, core


def _stored_activations(config: TransformerConfig, layout: Layout, run: Run, layers: int,
                        act_scale: float) -> tuple[float, float]:
    """(bytes stored for backward by `layers` layers of one micro-batch, transient working set during
    the backward of recomputed layers), from Korthikanti et al.'s per-layer formula."""
    s, b, t = run.seq_length, layout.micro_batch_size, layout.tp
    h, a, sp = config.hidden_size, config.num_attention_heads, layout.sequence_parallel
    # Fused SDPA (flash / memory-efficient) keeps no s^2 attention matrices: like selective.
    keep_mode = "selective" if run.attention_backend == "sdpa" else "none"
    if layout.recompute == "selective":
        keep_mode = "selective"
    full_layer = activation_bytes_per_layer(s, b, h, a, t, sp, keep_mode) * act_scale
    if layout.recompute != "full":
        return layers * full_layer, 0.0
    inp = activation_bytes_per_layer(s, b, h, a, t, sp, "full") * act_scale
    if run.recompute_method == "block":
        k = layers if run.recompute_num_layers is None else min(run.recompute_num_layers, layers)
        return k * inp + (layers - k) * full_layer, (full_layer if k else 0.0)
    k = run.recompute_num_layers or 1
    return math.ceil(layers / k) * inp, min(k, layers) * full_layer


def _in_flight_chunks(p: int, r: int, m: int, v: int) -> int:
    """Micro-batches (of one model chunk each) whose activations pipeline rank r holds at its peak:
    the warm-up forwards of megalite's programs plus the one forward before the first backward."""
    if p == 1:
        return 1  # gradient accumulation: forward, backward, forward, ...
    if v == 1:
        return min(p - r, m)  # program_1f1b: p - r - 1 warm-up forwards, then 1F1B
    total = m * v
    if m == p:
        return total  # program_interleaved: all forwards first
    return min(total, 2 * (p - r - 1) + (v - 1) * p + 1)


def predict(config: TransformerConfig, layout: Layout, cluster: Cluster, global_batch_size: int | None = None,
            seq_length: int | None = None, *, run: Run | None = None, dtype: str = "bf16",
            ddp_bucket_size: int = 40_000_000, attention_backend: str = "sdpa") -> Prediction:
    """Memory and step time of one layout (which must be valid: sizes dividing as megalite requires)."""
    if run is None:
        run = Run(global_batch_size, seq_length or config.max_position_embeddings, dtype, ddp_bucket_size,
                  attention_backend)
    _check_gpt(config)
    L, h, a, ffn = config.num_layers, config.hidden_size, config.num_attention_heads, config.ffn_hidden_size
    t, p, d, v, b = layout.tp, layout.pp, layout.dp, layout.v, layout.micro_batch_size
    s, B = run.seq_length, run.global_batch_size
    if B % (b * d):
        raise ValueError(f"global batch {B} is not divisible by micro-batch {b} x dp {d}")
    m = B // (b * d)
    for what, n in (("heads", a), ("ffn hidden size", ffn)):
        if n % t:
            raise ValueError(f"{what} {n} not divisible by tp {t}")
    if layout.vpp and (p == 1 or m % p):
        raise ValueError(f"vpp {layout.vpp} needs pp > 1 and the micro-batches per step ({m}) a multiple of pp {p}")
    if layout.sequence_parallel and (t == 1 or s % t):
        raise ValueError(f"sequence parallelism needs tp > 1 and seq length {s} divisible by tp {t}")
    vocab = pad_vocab_size(config.vocab_size, t, config.make_vocab_size_divisible_by)
    ab = DTYPE_BYTES[run.dtype]
    act_scale = ab / 2.0  # the formula counts 16-bit activations
    counts = stage_layer_counts(L, p, layout.vpp, list(run.pipeline_layers) if run.pipeline_layers else None)

    bw_tp = _bandwidth(cluster, "tp", layout)
    bw_pp = _bandwidth(cluster, "pp", layout)
    bw_dp = _bandwidth(cluster, "dp", layout)
    bw_emb = _bandwidth(cluster, "emb", layout)
    rate = cluster.peak_tflops * 1e12 * cluster.efficiency  # sustained FLOP/s per GPU

    fwd, bwd, core = _layer_flops(s, b, h, ffn, layout.recompute)
    logits_fwd = 2.0 * s * b * h * vocab
    ar_bytes = s * b * h * ab  # one TP all-reduce (or all-gather + reduce-scatter under SP)
    ar_time = 2.0 * (t - 1) / t * ar_bytes / bw_tp if t > 1 else 0.0
    ar_per_layer = 6 if layout.recompute == "full" else 4  # the recomputed forward repeats its 2
    msg = (s // t if layout.sequence_parallel else s) * b * h * ab  # megalite's p2p tensor_shape
    pp_mb = 2.0 * v * msg / bw_pp if p > 1 else 0.0  # per micro-batch and chunk: 1 forward + 1 backward exchange

    even = run.pipeline_layers is None
    ranks = sorted({0, p - 1} | ({1} if p > 2 else set())) if even else list(range(p))
    stages = {}
    for r in ranks:
        chunk_layers = [counts[c * p + r] for c in range(v)]
        n_layers = sum(chunk_layers)
        first, last = r == 0, r == p - 1
        flops_mb = n_layers * (fwd + bwd) / t + (3 * logits_fwd / t if last else 0.0)
        tp_mb = (n_layers * ar_per_layer + first + last) * ar_time if t > 1 else 0.0
        st = rank_state_bytes(config, tp=t, pp=p, dp=d, vpp=layout.vpp, pp_rank=r, dp_rank=0, dtype=run.dtype,
                              distributed_optimizer=layout.distributed_optimizer, seq_length=s,
                              ddp_bucket_size=run.ddp_bucket_size, pipeline_layers=run.pipeline_layers)
        # Activations: in-flight chunks of this rank times the layers of an average chunk.
        chunks_in_flight = _in_flight_chunks(p, r, m, v)
        per_chunk = n_layers / v
        stored_chunk, transient = _stored_activations(config, layout, run, round(per_chunk) or 1, act_scale)
        if even:
            activations = chunks_in_flight * stored_chunk + transient
        else:
            activations = chunks_in_flight * stored_chunk * per_chunk / (round(per_chunk) or 1) + transient
        output = 0.0
        if last:
            # Final LayerNorm input and the (sequence-gathered) output-layer input, in the model
            # dtype; the cross-entropy's peak: the model-dtype logits, their fp32 copy and the fp32
            # softmax kept for backward (a copy only when the model is not fp32).
            sbh = s * b * h * ab
            output = (sbh / t if layout.sequence_parallel else sbh) + sbh
            output += s * b * (vocab // t) * (ab + 4 + (4 if ab != 4 else 0))
        overhead = cluster.overhead_gib * GIB
        total = st.param_buffer + st.grads + st.optimizer + activations + output + overhead
        stages[r] = dict(st=st, n_layers=n_layers, chunk_layers=chunk_layers, flops_mb=flops_mb, tp_mb=tp_mb,
                         compute_mb=flops_mb / rate, t_mb=flops_mb / rate + tp_mb + pp_mb,
                         chunks_in_flight=chunks_in_flight, activations=activations, transient=transient,
                         stored_chunk=stored_chunk, output=output, total=total,
                         build=st.build_peak + overhead)

    # ---- time ----
    hw_flops = m * d * (L * (fwd + bwd) + 3 * logits_fwd)  # the whole model, one iteration
    model_flops = gpt_flops_per_iteration(B, s, L, h, config.vocab_size)
    compute = hw_flops / layout.gpus / rate
    slow = max(stages, key=lambda r: stages[r]["t_mb"])
    T = stages[slow]
    bubble_frac = theoretical_bubble(p, m, layout.vpp)
    bubble = bubble_frac / (1.0 - bubble_frac) * m * T["t_mb"]
    imbalance = max(0.0, m * T["compute_mb"] - compute)
    tp_comm, pp_comm = m * T["tp_mb"], m * pp_mb

    dp_parts = {}
    for r, S in stages.items():
        dp_parts[r] = _dp_exposed(S, layout, run, p, v, d, bw_dp, bw_emb, rate, fwd, bwd, logits_fwd, counts, r, ab)
    dp_stage = max(dp_parts, key=lambda r: dp_parts[r]["total"])
    dp_comm = dp_parts[dp_stage]["total"]
    traffic = _OPTIMIZER_TRAFFIC[run.dtype]
    optimizer = max(S["st"].owned_numel for S in stages.values()) * traffic / (cluster.hbm_gbps * 1e9)
    total_time = compute + imbalance + tp_comm + pp_comm + bubble + dp_comm + optimizer

    # ---- memory ----
    peak_r = max(stages, key=lambda r: stages[r]["total"])
    P = stages[peak_r]
    st = P["st"]
    memory = {"parameters": st.param_buffer, "gradients": st.grads, "optimizer": st.optimizer,
              "activations": P["activations"], "output_layer": P["output"],
              "overhead": cluster.overhead_gib * GIB, "total": P["total"]}
    build_peak = max(S["build"] for S in stages.values())
    capacity = cluster.memory_bytes
    fits = memory["total"] <= capacity and build_peak <= capacity
    reason = None
    if not fits:
        if memory["total"] >= build_peak:
            states = memory["parameters"] + memory["gradients"] + memory["optimizer"]
            out_part = f", output layer {memory['output_layer'] / GIB:.1f}" if memory["output_layer"] else ""
            reason = (f"does not fit: {_over(memory['total'], capacity)} GiB > {cluster.gpu_memory_gib:g} GiB "
                      f"(activations {memory['activations'] / GIB:.1f}{out_part}, parameters + gradients + "
                      f"optimizer {states / GIB:.1f} GiB, stage {peak_r})")
        else:
            reason = (f"does not fit while the model is built: {_over(build_peak, capacity)} GiB > "
                      f"{cluster.gpu_memory_gib:g} GiB (fp32 model + buffers)")
    details = dict(stages=stages, dp_parts=dp_parts, dp_stage=dp_stage, slow_stage=slow, bw_tp=bw_tp, bw_pp=bw_pp,
                   bw_dp=bw_dp, bw_emb=bw_emb, ar_time=ar_time, ar_bytes=ar_bytes, ar_per_layer=ar_per_layer,
                   msg=msg, pp_mb=pp_mb, fwd=fwd, bwd=bwd, core=core, logits_fwd=logits_fwd, vocab=vocab,
                   rate=rate, traffic=traffic)
    return Prediction(layout=layout, config=config, cluster=cluster, run=run, fits=fits, memory=memory,
                      peak_stage=peak_r, build_peak=build_peak,
                      time=dict(compute=compute, imbalance=imbalance, tp_comm=tp_comm, pp_comm=pp_comm,
                                bubble=bubble, dp_comm=dp_comm, optimizer=optimizer, total=total_time),
                      micro_batches=m, bubble_fraction=bubble_frac, model_flops=model_flops, hardware_flops=hw_flops,
                      reason=reason, details=details)


def _over(need: float, capacity: float) -> str:
    """GiB with enough digits to show that it exceeds the capacity."""
    for digits in (1, 2, 3):
        text = f"{need / GIB:.{digits}f}"
        if float(text) > capacity / GIB:
            return text
    return f"{need / GIB:.4f}"


def _dp_exposed(S, layout, run, p, v, d, bw_dp, bw_emb, rate, fwd, bwd, logits_fwd, counts, r, ab) -> dict:
    """Data-parallel time on one pipeline rank that does not hide behind backward.

    Buckets start reducing during each chunk's last backward of the step (one stream, in order):
    chunk c's last backward ends c*p backward passes (of one chunk) before the schedule does, so
    with interleaving the later chunks' buckets have more time. A bucket cannot finish before its
    last gradient (the chunk's last bucket: its first-defined parameters) is ready, at the end of
    that backward. The tied embedding (pp > 1) is reduced after the schedule: over the embedding
    group, then over dp like the other buckets. The distributed optimizer all-gathers the updated
    parameters after the step."""
    out = {"overlapped": 0.0, "embedding": 0.0, "all_gather": 0.0, "total": 0.0}
    if d == 1 and not (p > 1 and r in (0, p - 1)):
        return out
    t = layout.tp
    ring = (d - 1) / d
    reduce_factor = ring if layout.distributed_optimizer else 2 * ring  # reduce-scatter vs all-reduce
    buckets = S["st"].buckets
    last_vs = p * v - 1
    free = -math.inf
    windows = []
    for c in reversed(range(v)):  # chunk v-1's last backward comes first
        layers = counts[c * p + r]
        tb = (layers * bwd + (2 * logits_fwd if c * p + r == last_vs else 0.0)) / t / rate
        end = -c * p * tb
        normal = [(rp) for (_, rp, deferred) in buckets[c] if not deferred]
        if not normal or d == 1:
            continue
        total_c = sum(normal) * 4 * reduce_factor / bw_dp
        last_bucket = normal[-1] * 4 * reduce_factor / bw_dp
        start = max(free, end - tb)
        free = max(start + total_c, end + last_bucket)
        windows.append((c, end - tb, end, total_c, last_bucket))
    out["overlapped"] = max(0.0, free) if windows else 0.0
    deferred = [rp for chunk in buckets for (_, rp, dfr) in chunk if dfr]
    if deferred:
        n = sum(deferred)
        out["embedding"] = n * 4 / bw_emb + (n * 4 * reduce_factor / bw_dp if d > 1 else 0.0)
    if layout.distributed_optimizer and d > 1:
        out["all_gather"] = ring * S["st"].param_buffer / bw_dp
    out["total"] = out["overlapped"] + out["embedding"] + out["all_gather"]
    out["windows"] = windows
    return out


# -------------------------------------------------------------------------------------------------
# Enumeration
# -------------------------------------------------------------------------------------------------
def divisors(n: int) -> list[int]:
    small = [i for i in range(1, int(math.isqrt(n)) + 1) if n % i == 0]
    return sorted(set(small + [n // i for i in small]))


@dataclass
class PlanResult:
    """The layouts that fit, fastest first (indexable like a list), and why the others do not."""
    predictions: list  # fitting Predictions, by step time
    rejected: dict  # reason kind -> [count, example message, example Prediction or None]
    evaluated: int  # layouts whose memory and time were predicted
    closest: Prediction | None = None  # when nothing fits: the layout needing the least memory

    def __iter__(self):
        return iter(self.predictions)

    def __len__(self):
        return len(self.predictions)

    def __getitem__(self, i):
        return self.predictions[i]

    @property
    def best(self) -> Prediction | None:
        return self.predictions[0] if self.predictions else None


def plan(config: TransformerConfig, cluster: Cluster, global_batch_size: int, seq_length: int | None = None, *,
         dtype: str = "bf16", ddp_bucket_size: int = 40_000_000, attention_backend: str = "sdpa",
         max_tp: int | None = None, tp: int | None = None, pp: int | None = None, vpp: int | None = None,
         micro_batch_size: int | None = None, recompute=RECOMPUTE, sequence_parallel=(False, True),
         distributed_optimizer=(False, True)) -> PlanResult:
    """Enumerate every valid layout of `cluster.gpus` GPUs (optionally restricted), predict each, and
    return those that fit, fastest first. max_tp defaults to the GPUs per node."""
    _check_gpt(config)
    seq_length = seq_length or config.max_position_embeddings
    run = Run(global_batch_size, seq_length, dtype, ddp_bucket_size, attention_backend)
    N, L, B = cluster.gpus, config.num_layers, global_batch_size
    max_tp = max_tp or cluster.gpus_per_node
    recompute = (recompute,) if isinstance(recompute, str) else tuple(recompute)
    sequence_parallel = (sequence_parallel,) if isinstance(sequence_parallel, bool) else tuple(sequence_parallel)
    distributed_optimizer = ((distributed_optimizer,) if isinstance(distributed_optimizer, bool)
                             else tuple(distributed_optimizer))
    rejected: dict = {}

    def reject(kind: str, message: str, pred: Prediction | None = None):
        entry = rejected.setdefault(kind, [0, message, pred])
        entry[0] += 1

    fitting, evaluated, closest = [], 0, None
    if tp is not None and N % tp:
        reject("tp does not divide gpus", f"tp {tp} does not divide the {N} GPUs")
    for t in divisors(N):
        if tp is not None and t != tp:
            continue
        if t > max_tp:
            reject("tp > gpus per node", f"tp {t} exceeds {max_tp} GPUs per node" if max_tp == cluster.gpus_per_node
                   else f"tp {t} exceeds --max-tp {max_tp}")
            continue
        if config.num_attention_heads % t:
            reject("heads % tp", f"heads {config.num_attention_heads} not divisible by tp {t}")
            continue
        if config.ffn_hidden_size % t:
            reject("ffn % tp", f"ffn hidden size {config.ffn_hidden_size} not divisible by tp {t}")
            continue
        if pp is not None and (N // t) % pp:
            reject("tp x pp does not divide gpus", f"tp {t} x pp {pp} does not divide the {N} GPUs")
        for p in divisors(N // t):
            if pp is not None and p != pp:
                continue
            if p > L:
                reject("pp > layers", f"pp {p} exceeds the {L} layers")
                continue
            if L % p:
                reject("layers % pp", f"layers {L} not divisible by pp {p}")
                continue
            d = N // (t * p)
            if B % d:
                reject("batch % dp", f"global batch {B} not divisible by dp {d} (tp {t} pp {p})")
                continue
            vpps = [None] + ([x for x in divisors(L // p) if x > 1] if p > 1 else [])
            if vpp is not None:
                vpps = [x for x in vpps if (x or 1) == vpp]
            for b in divisors(B // d):
                if micro_batch_size is not None and b != micro_batch_size:
                    continue
                m = B // (d * b)
                for v in vpps:
                    if v and m % p:
                        reject("interleaved: m % pp", f"vpp {v} needs the micro-batches per step ({m}, mb {b} "
                                                      f"tp {t} pp {p} dp {d}) to be a multiple of pp {p}")
                        continue
                    for rc in recompute:
                        for sp in sequence_parallel:
                            if sp and t == 1:
                                continue
                            if sp and seq_length % t:
                                reject("seq % tp", f"sequence parallelism needs seq length {seq_length} "
                                                   f"divisible by tp {t}")
                                continue
                            for dist_opt in distributed_optimizer:
                                if dist_opt and d == 1 and False in distributed_optimizer:
                                    continue  # identical to the plain optimizer at dp = 1
                                lay = Layout(t, p, d, v, b, rc, sp, dist_opt)
                                pred = predict(config, lay, cluster, run=run)
                                evaluated += 1
                                if pred.fits:
                                    fitting.append(pred)
                                else:
                                    reject("does not fit", f"{lay.short()}: {pred.reason}", pred)
                                    if closest is None or pred.peak_bytes < closest.peak_bytes:
                                        closest = pred
                                        rejected["does not fit"][1:] = [f"{lay.short()}: {pred.reason}", pred]
    fitting.sort(key=lambda x: (x.step_time, x.peak_bytes))
    return PlanResult(fitting, rejected, evaluated, None if fitting else closest)


# -------------------------------------------------------------------------------------------------
# For pretrain_gpt.py --plan: will the requested layout fit?
# -------------------------------------------------------------------------------------------------
def check_layout(config: TransformerConfig, *, tp: int = 1, pp: int = 1, dp: int = 1, vpp: int | None = None,
                 micro_batch_size: int = 1, global_batch_size: int, seq_length: int | None = None,
                 recompute: str | None = None, sequence_parallel: bool | None = None,
                 use_distributed_optimizer: bool = False, dtype: str = "bf16", gpu_memory_bytes: float,
                 cluster: Cluster | None = None, ddp_bucket_size: int = 40_000_000,
                 attention_backend: str | None = None, pipeline_layers=None) -> tuple[bool, Prediction]:
    """(fits, prediction) for one layout; recompute / sequence_parallel / attention_backend default
    to the config's. gpu_memory_bytes overrides the cluster's memory."""
    gpus = tp * pp * dp
    base = cluster or Cluster(gpus=gpus)
    cluster = replace(base, gpus=gpus, gpu_memory_gib=gpu_memory_bytes / GIB)
    layout = Layout(tp, pp, dp, vpp if vpp and vpp > 1 else None, micro_batch_size,
                    recompute or config.recompute,
                    config.sequence_parallel if sequence_parallel is None else sequence_parallel,
                    use_distributed_optimizer)
    run = Run(global_batch_size, seq_length or config.max_position_embeddings, dtype, ddp_bucket_size,
              attention_backend or config.attention_backend,
              tuple(pipeline_layers) if pipeline_layers else None, config.recompute_method,
              config.recompute_num_layers)
    pred = predict(config, layout, cluster, run=run)
    return pred.fits, pred


def check_args(args, world_size: int, gpu_memory_bytes: float | None = None,
               cluster: Cluster | None = None) -> tuple[bool, Prediction]:
    """check_layout for a parsed pretrain_gpt.py namespace (after megalite.arguments.validate):
    the device's memory by default."""
    from megalite import arguments

    config = arguments.model_config(args)
    if gpu_memory_bytes is None:
        import torch

        if not torch.cuda.is_available():
            raise ValueError("no GPU: give gpu_memory_bytes to check a layout")
        gpu_memory_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if cluster is None:
        from megalite.metrics import default_peak_tflops

        cluster = Cluster(gpus=world_size, peak_tflops=getattr(args, "peak_tflops", None) or default_peak_tflops()
                          or Cluster.peak_tflops)
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    dp = world_size // (args.tp * args.pp)
    return check_layout(config, tp=args.tp, pp=args.pp, dp=dp, vpp=args.vpp, micro_batch_size=args.micro_batch_size,
                        global_batch_size=args.global_batch_size, seq_length=args.seq_length,
                        recompute=args.recompute, sequence_parallel=args.sequence_parallel,
                        use_distributed_optimizer=args.use_distributed_optimizer, dtype=dtype,
                        gpu_memory_bytes=gpu_memory_bytes, cluster=cluster, ddp_bucket_size=args.ddp_bucket_size,
                        pipeline_layers=args.pipeline_layers)


# -------------------------------------------------------------------------------------------------
# Output
# -------------------------------------------------------------------------------------------------
def model_flags(config: TransformerConfig, preset_name: str | None = None) -> list[str]:
    """pretrain_gpt.py flags that build this shape: the preset alone when it matches."""
    shape = dict(num_layers=config.num_layers, hidden_size=config.hidden_size,
                 num_attention_heads=config.num_attention_heads, ffn_hidden_size=config.ffn_hidden_size,
                 vocab_size=config.vocab_size)
    if preset_name in PRESETS:
        ref = TransformerConfig(**PRESETS[preset_name])
        diff = {k: v for k, v in shape.items() if getattr(ref, k) != v}
        flags = ["--model", preset_name]
    else:
        diff, flags = shape, ["--model", "gpt-tiny"]
    for k, v in diff.items():
        flags += [f"--{k.replace('_', '-')}", str(v)]
    return flags


def launch_command(pred: Prediction, flags: list[str] | None = None) -> str:
    lay, cl, run = pred.layout, pred.cluster, pred.run
    flags = flags if flags is not None else model_flags(pred.config, _preset_of(pred.config))
    gpn = min(cl.gpus_per_node, lay.gpus)
    nodes = math.ceil(lay.gpus / gpn)
    launcher = f"torchrun --nproc_per_node {gpn}" + (f" --nnodes {nodes}" if nodes > 1 else " --standalone")
    parts = [launcher, "pretrain_gpt.py", *flags, "--tp", str(lay.tp), "--pp", str(lay.pp)]
    if lay.vpp:
        parts += ["--vpp", str(lay.vpp)]
    parts += ["--micro-batch-size", str(lay.micro_batch_size), "--global-batch-size", str(run.global_batch_size),
              "--seq-length", str(run.seq_length), "--recompute", lay.recompute]
    if lay.sequence_parallel:
        parts.append("--sequence-parallel")
    if lay.distributed_optimizer:
        parts.append("--use-distributed-optimizer")
    if run.dtype != "fp32":
        parts.append(f"--{run.dtype}")
    if run.attention_backend != "sdpa":
        parts += ["--attention-backend", run.attention_backend]
    if run.ddp_bucket_size != 40_000_000:
        parts += ["--ddp-bucket-size", str(run.ddp_bucket_size)]
    return " ".join(parts)


def _preset_of(config: TransformerConfig) -> str | None:
    for name in GPT_PRESETS:
        ref = TransformerConfig(**PRESETS[name])
        if all(getattr(ref, k) == getattr(config, k) for k in
               ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size")):
            return name
    return None


def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def format_table(preds: list[Prediction]) -> str:
    head = (f"{'#':>2} {'tp':>3} {'pp':>3} {'dp':>4} {'vpp':>3} {'mb':>3} {'recompute':>9} {'sp':>3} {'dopt':>4} | "
            f"{'GiB':>5} {'param':>5} {'grad':>5} {'optim':>5} {'act':>5} {'out':>4} | "
            f"{'step s':>7} {'bubble':>6} {'tp':>5} {'pp':>5} {'dp':>5} | {'MFU':>5}")
    lines = [head, "-" * len(head)]
    for i, x in enumerate(preds, 1):
        L, M, T = x.layout, x.memory, x.time
        pct = lambda k: f"{100 * T[k] / T['total']:4.1f}%"  # noqa: E731
        lines.append(
            f"{i:>2} {L.tp:>3} {L.pp:>3} {L.dp:>4} {L.vpp or '-':>3} {L.micro_batch_size:>3} {L.recompute:>9} "
            f"{'on' if L.sequence_parallel else '-':>3} {'on' if L.distributed_optimizer else '-':>4} | "
            f"{_gib(x.peak_bytes):>5} {_gib(M['parameters']):>5} {_gib(M['gradients']):>5} "
            f"{_gib(M['optimizer']):>5} {_gib(M['activations']):>5} {_gib(M['output_layer']):>4} | "
            f"{T['total']:>7.3f} {pct('bubble'):>6} {pct('tp_comm'):>5} {pct('pp_comm'):>5} {pct('dp_comm'):>5} | "
            f"{100 * x.mfu:4.1f}%")
    return "\n".join(lines)


def format_rejections(result: PlanResult) -> str:
    if not result.rejected:
        return "rejected: none"
    lines = ["rejected (counted where they fail: a tp value, a (tp, pp) pair, or one full layout):"]
    for kind, (count, example, _) in sorted(result.rejected.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {count:>6} x {kind:<22} e.g. {example}")
    return "\n".join(lines)


def explain(pred: Prediction) -> str:
    """The formulas of the prediction, with its numbers."""
    c, lay, cl, run, D = pred.config, pred.layout, pred.cluster, pred.run, pred.details
    s, b, h, a, V = run.seq_length, lay.micro_batch_size, c.hidden_size, c.num_attention_heads, D["vocab"]
    t, p, d, v, m = lay.tp, lay.pp, lay.dp, lay.v, pred.micro_batches
    ab = DTYPE_BYTES[run.dtype]
    r = pred.peak_stage
    S = D["stages"][r]
    st = S["st"]
    out = [f"layout: {lay.short()} on {lay.gpus} GPUs; {m} micro-batches per step; {run.dtype}; "
           f"attention backend {run.attention_backend}",
           "", f"memory on pipeline stage {r} (the fullest), per GPU:"]
    layer = sum(layer_parameter_numels(h, c.ffn_hidden_size, t))
    pieces = [f"{S['n_layers']} layers x {layer:,} (= (4h^2 + 2h*ffn + 3h + ffn)/tp + 6h)"]
    if r == 0:
        pieces.insert(0, f"word embedding {V}/{t} x {h} = {V // t * h:,}, positions {positions(c, s)} x {h}")
    if r == p - 1:
        tied = f"tied word embedding copy {V // t * h:,}, " if p > 1 else ""
        pieces.append(f"{tied}final norm {2 * h}")
    out.append(f"  parameters   {st.numel:,} elements = {'; '.join(pieces)}")
    out.append(f"               x {ab} B (+ {st.padded_numel - st.numel:,} padding elements) = "
               f"{_gib(st.param_buffer)} GiB")
    out.append(f"  gradients    {st.padded_numel:,} x 4 B (fp32 buffers, buckets of {run.ddp_bucket_size:,} "
               f"padded to a "
               f"multiple of dp={d}: {st.grad_padding // 4:,} padding) = {_gib(st.grads)} GiB")
    master = 0 if run.dtype == "fp32" else 4
    who = (f"{st.owned_numel:,} owned (this dp rank's shard of every bucket)" if lay.distributed_optimizer
           else f"{st.owned_numel:,} (every parameter)")
    out.append(f"  optimizer    ({master} B fp32 master{' (none: fp32 parameters are their own)' if not master else ''}"
               f" + 8 B Adam exp_avg, exp_avg_sq) x {who} = {_gib(st.optimizer)} GiB")
    keep = "selective" if (run.attention_backend == "sdpa" or lay.recompute == "selective") else "none"
    per_layer = activation_bytes_per_layer(s, b, h, a, t, lay.sequence_parallel,
                                           "full" if lay.recompute == "full" else keep) * ab / 2
    formula = {"none": "s*b*h*(10 + 24/t + 5*a*s/(h*t))", "selective": "s*b*h*(10 + 24/t)"}[keep]
    if lay.sequence_parallel:
        formula = {"none": "s*b*h*(34 + 5*a*s/h)/t", "selective": "34*s*b*h/t"}[keep]
    if lay.recompute == "full":
        formula = "2*s*b*h" + ("/t" if lay.sequence_parallel else "") + " (layer inputs only)"
    sdpa_note = ", sdpa keeps no s^2 matrices" if keep != "none" and lay.recompute == "none" else ""
    sched = ("1 (no pipeline)" if p == 1 else f"min(p - r, m) = {S['chunks_in_flight']}" if v == 1 else
             f"min(v*m, 2(p-1-r) + (v-1)p + 1) = {S['chunks_in_flight']} chunks of {S['n_layers'] // v} layers")
    out.append(f"  activations  {formula} = {per_layer / 2 ** 20:.1f} MiB per layer and micro-batch "
               f"(s={s} b={b} h={h} a={a} t={t}{sdpa_note})")
    out.append(f"               x {S['n_layers'] // v} layers per chunk x in flight {sched}"
               + (f" + one layer recomputed in backward {S['transient'] / GIB:.2f} GiB" if S["transient"] else "")
               + f" = {_gib(S['activations'])} GiB")
    if r == p - 1:
        out.append(f"  output layer final-norm and output-layer inputs 2*s*b*h*{ab} B + logits s*b*V/t x "
                   f"({ab} + 4{' + 4' if ab != 4 else ''}) B = {s}*{b}*{V // t} x {ab + 4 + (4 if ab != 4 else 0)} B "
                   f"... = {_gib(S['output'])} GiB")
    out.append(f"  overhead     {cl.overhead_gib:g} GiB (CUDA context, workspaces, NCCL buffers)")
    out.append(f"  total        {_gib(pred.memory['total'])} GiB of {cl.gpu_memory_gib:g} GiB; while building the "
               f"model: {_gib(pred.build_peak)} GiB (the fp32 model, each chunk's flat buffers allocated before "
               f"its fp32 "
               f"parameters are released{', the fp32 masters cloned' if ab != 4 else ''}; plus overhead)")
    T, rate = pred.time, D["rate"]
    out += ["", "step time:"]
    rc = {"none": "", "selective": " + 4*B*s^2*h*L (selective: attention core again)",
          "full": " + 24*B*s*L*h^2*(1 + s/6h) (full: the forward again)"}[lay.recompute]
    out.append(f"  compute      [72*B*s*L*h^2*(1 + s/6h) + 6*B*s*h*V]{rc} = {pred.hardware_flops:.3e} FLOPs / "
               f"({lay.gpus} GPUs x {cl.peak_tflops:g} TFLOP/s x {cl.efficiency:g}) = {T['compute']:.3f} s")
    out.append(f"  imbalance    slowest stage {D['slow_stage']} (the last also runs the output layer) over the mean: "
               f"{T['imbalance']:.3f} s")
    if t > 1:
        Ss = D["stages"][D["slow_stage"]]
        extra = (Ss["tp_mb"] / D["ar_time"]) - Ss["n_layers"] * D["ar_per_layer"]
        out.append(f"  tp comm      ({Ss['n_layers']} layers x {D['ar_per_layer']} + {extra:.0f} embedding/output) "
                   f"all-reduces of s*b*h*{ab} B = {D['ar_bytes'] / 2 ** 20:.1f} MiB per micro-batch on stage "
                   f"{D['slow_stage']}, 2(t-1)/t x bytes / {D['bw_tp'] / 1e9:g} GB/s = {D['ar_time'] * 1e3:.3f} ms "
                   f"each, x {m} micro-batches = {T['tp_comm']:.3f} s")
    if p > 1:
        out.append(f"  pp comm      2 x v={v} exchanges of {D['msg'] / 2 ** 20:.1f} MiB per micro-batch at "
                   f"{D['bw_pp'] / 1e9:g} GB/s x {m} = {T['pp_comm']:.3f} s")
        out.append(f"  bubble       (p-1)/(v*m) = {p - 1}/({v}*{m}) of the per-micro-batch time "
                   f"(theoretical_bubble {pred.bubble_fraction:.4f}) = {T['bubble']:.3f} s")
    part = D["dp_parts"][D["dp_stage"]]
    kind = "reduce-scatter (d-1)/d" if lay.distributed_optimizer else "all-reduce 2(d-1)/d"
    out.append(f"  dp comm      {kind} x fp32 grads / {D['bw_dp'] / 1e9:g} GB/s, minus what hides behind the last "
               f"backward: {part['overlapped']:.3f} s; tied embedding (after the schedule) {part['embedding']:.3f} s; "
               f"parameter all-gather {part['all_gather']:.3f} s (stage {D['dp_stage']}) = {T['dp_comm']:.3f} s")
    out.append(f"  optimizer    {max(S2['st'].owned_numel for S2 in D['stages'].values()):,} elements x "
               f"{D['traffic']} B / {cl.hbm_gbps:g} GB/s = {T['optimizer']:.3f} s")
    out.append(f"  total        {T['total']:.3f} s per step; {pred.tokens_per_s:,.0f} tokens/s; MFU "
               f"{100 * pred.mfu:.1f}% (model FLOPs {pred.model_flops:.3e} as megalite logs them)")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m megalite.tools.plan",
                                 description="Enumerate megalite parallel layouts; predict memory and step time.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = ap.add_argument_group("model (a preset, or the shape flags of pretrain_gpt.py)")
    g.add_argument("--model", choices=GPT_PRESETS, help="GPT preset")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--ffn-hidden-size", type=int, help="default 4 x hidden")
    g.add_argument("--vocab-size", type=int, help="default: the preset's, else 50257")
    g = ap.add_argument_group("cluster")
    g.add_argument("--gpus", type=int, required=True)
    g.add_argument("--gpu-memory-gib", type=float, default=80.0)
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--intra-node-gbps", type=float, default=450.0, help="GB/s per GPU per direction (NVLink)")
    g.add_argument("--inter-node-gbps", type=float, default=50.0, help="GB/s per GPU per direction (network)")
    g.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU")
    g.add_argument("--efficiency", type=float, default=0.5, help="fraction of peak the matmuls sustain")
    g.add_argument("--hbm-gbps", type=float, default=3350.0, help="GPU memory bandwidth (optimizer step)")
    g.add_argument("--overhead-gib", type=float, default=2.0, help="fixed per-GPU framework/CUDA overhead")
    g = ap.add_argument_group("training run")
    g.add_argument("--global-batch-size", type=int, required=True)
    g.add_argument("--seq-length", type=int, help="default: the preset's positions")
    prec = g.add_mutually_exclusive_group()
    prec.add_argument("--bf16", action="store_const", const="bf16", dest="dtype", help="(default)")
    prec.add_argument("--fp16", action="store_const", const="fp16", dest="dtype")
    prec.add_argument("--fp32", action="store_const", const="fp32", dest="dtype")
    g.add_argument("--ddp-bucket-size", type=int, default=40_000_000)
    g.add_argument("--attention-backend", choices=["sdpa", "fused", "torch"], default="sdpa")
    g = ap.add_argument_group("restrict the search")
    g.add_argument("--tp", type=int)
    g.add_argument("--pp", type=int)
    g.add_argument("--vpp", type=int, help="1 = no interleaving")
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--recompute", choices=RECOMPUTE)
    g.add_argument("--sequence-parallel", choices=["on", "off"])
    g.add_argument("--distributed-optimizer", choices=["on", "off"])
    g.add_argument("--max-tp", type=int, help="largest tp (default: GPUs per node)")
    g = ap.add_argument_group("output")
    g.add_argument("--top", type=int, default=5)
    g.add_argument("--explain", action="store_true", help="the formulas with numbers for the best layout")
    g.add_argument("--json", action="store_true", help="machine-readable output")
    return ap


def config_from_args(args, ap: argparse.ArgumentParser) -> TransformerConfig:
    shape = {k: getattr(args, k) for k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                          "vocab_size") if getattr(args, k) is not None}
    if args.model:
        base = dict(PRESETS[args.model])
    else:
        missing = [f"--{k.replace('_', '-')}" for k in ("num_layers", "hidden_size", "num_attention_heads")
                   if k not in shape]
        if missing:
            ap.error(f"give --model or the shape: {' '.join(missing)} missing")
        base = {"vocab_size": 50257, "max_position_embeddings": args.seq_length or 1024}
    try:
        return TransformerConfig(**{**base, **shape})
    except ValueError as e:
        ap.error(str(e))


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    config = config_from_args(args, ap)
    dtype = args.dtype or "bf16"
    seq = args.seq_length or config.max_position_embeddings
    try:
        cluster = Cluster(gpus=args.gpus, gpu_memory_gib=args.gpu_memory_gib, gpus_per_node=args.gpus_per_node,
                          intra_node_gbps=args.intra_node_gbps, inter_node_gbps=args.inter_node_gbps,
                          peak_tflops=args.peak_tflops, efficiency=args.efficiency, hbm_gbps=args.hbm_gbps,
                          overhead_gib=args.overhead_gib)
        Run(args.global_batch_size, seq, dtype, args.ddp_bucket_size, args.attention_backend)
    except ValueError as e:
        ap.error(str(e))
    onoff = lambda x: (False, True) if x is None else (x == "on",)  # noqa: E731
    result = plan(config, cluster, args.global_batch_size, seq, dtype=dtype, ddp_bucket_size=args.ddp_bucket_size,
                  attention_backend=args.attention_backend, max_tp=args.max_tp, tp=args.tp, pp=args.pp,
                  vpp=args.vpp, micro_batch_size=args.micro_batch_size,
                  recompute=(args.recompute,) if args.recompute else RECOMPUTE,
                  sequence_parallel=onoff(args.sequence_parallel),
                  distributed_optimizer=onoff(args.distributed_optimizer))
    name = args.model or "custom GPT"
    n_params = _total_params(config, seq)
    nodes = math.ceil(cluster.gpus / cluster.gpus_per_node)
    flags = model_flags(config, args.model)
    header = (f"{name}: {n_params / 1e9:.2f}B parameters ({config.num_layers} layers, hidden {config.hidden_size}, "
              f"{config.num_attention_heads} heads, vocab {config.vocab_size}); {cluster.gpus} GPUs "
              f"({nodes} node{'s' if nodes > 1 else ''} of {min(cluster.gpus_per_node, cluster.gpus)}, "
              f"{cluster.gpu_memory_gib:g} GiB each); global batch {args.global_batch_size} x {seq} tokens, {dtype}\n"
              f"peak {cluster.peak_tflops:g} TFLOP/s x efficiency {cluster.efficiency:g}; "
              f"links {cluster.intra_node_gbps:g} "
              f"GB/s in a node, {cluster.inter_node_gbps:g} GB/s between nodes; overhead {cluster.overhead_gib:g} GiB")
    best = result.best
    if best is None:
        if result.closest is not None:
            x = result.closest
            states = x.memory["parameters"] + x.memory["gradients"] + x.memory["optimizer"]
            msg = (f"megalite plan: no layout of {name} fits {cluster.gpus} GPUs of {cluster.gpu_memory_gib:g} GiB: "
                   f"the smallest needs {x.peak_bytes / GIB:.1f} GiB per GPU ({x.layout.short()}: parameters, "
                   f"gradients and optimizer states alone {states / GIB:.1f} GiB); "
                   f"use more GPUs, GPUs with more memory, or a smaller model or batch")
        else:
            first = next(iter(result.rejected.values()), [0, "no candidates"])[1]
            msg = (f"megalite plan: no valid layout of {name} on {cluster.gpus} GPUs with these restrictions "
                   f"(e.g. {first})")
        if args.json:
            print(json.dumps({"error": msg, "evaluated": result.evaluated, "feasible": 0,
                              "rejected": _rejected_json(result),
                              "closest": result.closest.to_dict(flags) if result.closest else None}, indent=1))
        print(msg, file=sys.stderr)
        return 1
    top = result.predictions[:max(args.top, 1)]
    command = best.command(flags)
    if args.json:
        print(json.dumps({"model": name, "parameters": n_params, "config": _config_json(config),
                          "cluster": asdict(cluster), "global_batch_size": args.global_batch_size, "seq_length": seq,
                          "dtype": dtype, "evaluated": result.evaluated, "feasible": len(result),
                          "best": [x.to_dict(flags) for x in top], "rejected": _rejected_json(result),
                          "command": command}, indent=1))
        return 0
    print(header)
    print(f"evaluated {result.evaluated:,} layout{'s' if result.evaluated != 1 else ''}: {len(result):,} fit\n")
    print(format_table(top))
    print()
    print(format_rejections(result))
    print("\nrun the best with" + (" (plus your rendezvous flags, e.g. --rdzv-backend c10d --rdzv-endpoint "
                                  "HOST:29500):" if nodes > 1 else ":"))
    print(f"  {command}")
    if args.explain:
        print()
        print(explain(best))
    return 0


def _total_params(config: TransformerConfig, seq: int) -> int:
    vocab = pad_vocab_size(config.vocab_size, 1, config.make_vocab_size_divisible_by)
    return (vocab * config.hidden_size + positions(config, seq) * config.hidden_size
            + config.num_layers * sum(layer_parameter_numels(config.hidden_size, config.ffn_hidden_size, 1))
            + 2 * config.hidden_size)


def _config_json(config: TransformerConfig) -> dict:
    return {k: getattr(config, k) for k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                            "vocab_size", "max_position_embeddings")}


def _rejected_json(result: PlanResult) -> list:
    return [{"reason": kind, "count": n, "example": ex} for kind, (n, ex, _) in
            sorted(result.rejected.items(), key=lambda kv: -kv[1][0])]


if __name__ == "__main__":
    sys.exit(main())
