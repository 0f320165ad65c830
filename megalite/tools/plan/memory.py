"""Bytes per GPU: parameters, gradient buffers and optimizer states exactly as megalite allocates
them, activations held by the schedule, the output layer, and the transient peak of the build."""
from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, field, replace

from megalite.models.config import TransformerConfig
from megalite.models.memory import layer_activation_bytes
from megalite.optim.buffers import BucketLayout, plan_layout
from megalite.optim.zero import MAX_IN_FLIGHT, layer_units
from megalite.pipeline.partition import virtual_stage
from megalite.pipeline.schedules import build_program, peak_in_flight
from megalite.tools.plan.experts import moe_layer_extra_bytes
from megalite.tools.plan.inputs import (
    DTYPE_BYTES,
    GIB,
    ZERO_STAGES,
    Layout,
    Run,
    positions,
    rank_parameter_layers,
    rank_parameters,
)


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
    zero_transient: float = 0.0  # ZeRO stages 2-3: whole-bucket gradients and gathered units (StateBytes.transient)
    experts: float = 0.0  # of parameters + gradients + optimizer: the expert weights' (sharded over EDP)
    mtp: float = 0.0  # of output_layer: the multi-token prediction modules' activations (mtp_bytes)

    @property
    def states(self) -> float:
        """Parameters, gradients and optimizer states: what no micro-batch size changes."""
        return self.parameters + self.gradients + self.optimizer


@dataclass
class StateBytes:
    """What one rank holds for the model and the optimizer, in bytes (and elements)."""
    numel: int  # parameter elements held (real)
    padded_numel: int  # elements of the parameter / gradient layout (with bucket padding)
    owned_numel: int  # elements this rank's optimizer updates
    params: int  # sum of p.numel() * p.element_size(): the parameters themselves
    param_buffer: int  # the parameter storage, padding included: param_data (stage 3: param_shard)
    grads: int  # the gradient storage, padding included: grad_data (stages 2-3: grad_shard)
    grad_padding: int  # of which padding
    optimizer: int  # MegaliteOptimizer.state_bytes(): fp32 master copies + Adam exp_avg, exp_avg_sq
    build_peak: int  # transient while the model is built and laid out (before any activation)
    buckets: list[list[BucketLayout]] = field(default_factory=list)  # per chunk, as plan_layout lays them out
    zero_stage: int = 0
    # Stages 2-3, the step's peak beyond the stored state (buffer.stored_bytes()["peak_transient"]):
    # whole-bucket gradients waiting for their reduce-scatter, and (stage 3) gathered units.
    transient: int = 0
    transient_grads: int = 0  # of which gradients ("peak_grad_buckets", alone)
    transient_gathered: int = 0  # of which parameters ("peak_gathered", alone)
    layer_buckets: list[set] = field(default_factory=list)  # per chunk, stage 3: the units that are layers
    grad_bytes: int = 4  # bytes of a stored (and transient) gradient element
    comm_bytes: int = 4  # bytes of a reduced gradient element (--grad-reduce-dtype)
    # MoE: the expert weights' own buffers (reduced and sharded over EDP), included in the totals above
    experts: "StateBytes | None" = None
    edp: int = 1  # expert-data-parallel size

    @property
    def steady(self) -> int:
        return self.param_buffer + self.grads + self.optimizer

    @property
    def expert_buckets(self) -> list[list[BucketLayout]]:
        """Per chunk, the expert buffer's buckets (empty without experts)."""
        return self.experts.buckets if self.experts is not None else [[] for _ in self.buckets]


def rank_state_bytes(config: TransformerConfig, *, tp: int = 1, pp: int = 1, dp: int = 1, vpp: int | None = None,
                     pp_rank: int = 0, dp_rank: int = 0, dtype: str = "bf16", distributed_optimizer: bool = False,
                     zero_stage: int | None = None, grad_dtype: str = "fp32", seq_length: int | None = None,
                     ddp_bucket_size: int = 40_000_000, pipeline_layers=None, reshard_after_forward: bool = True,
                     keep_params_for_step: bool = False, ep: int = 1, etp: int | None = None,
                     edp_rank: int = 0, v_shape: bool = False) -> StateBytes:
    """Bytes of parameters, gradients and optimizer states on rank (pp_rank, dp_rank, any tp rank),
    exactly as megalite allocates them at ZeRO stage `zero_stage` (None: 1 with
    `distributed_optimizer`, else 0), plus stages 2-3's transient peak of one step.

    grad_dtype is --grad-reduce-dtype: the reduction's dtype, and at stages 2-3 the stored one
    (below stage 2 gradients accumulate in fp32 whatever it is), as `training.build_optimizer` does.
    dp is the ranks dense gradients are reduced over (DP x CP). A MoE model's expert weights (split
    over ep x etp, etp None: tp) have buffers of their own, reduced and sharded over the expert-data-
    parallel group, EDP = tp x dp / (ep x etp), where this rank is `edp_rank`; the totals add both.
    v_shape: the two chunks sit in a V (zb-v). See megalite.optim.buffers / zero / optimizer."""
    stage = _stage(zero_stage, distributed_optimizer)
    seq_length = seq_length or config.max_position_embeddings
    explicit = tuple(pipeline_layers) if pipeline_layers is not None else None
    key = (repr(config), positions(config, seq_length), tp, pp, dp, vpp, pp_rank, dp_rank, dtype, stage, grad_dtype,
           ddp_bucket_size, explicit, reshard_after_forward, keep_params_for_step, ep, etp, edp_rank, v_shape)
    if key not in _STATE_CACHE:  # the search asks for the same rank at many micro-batch sizes
        if len(_STATE_CACHE) > 4096:
            _STATE_CACHE.clear()
        _STATE_CACHE[key] = _rank_state(config, tp, pp, dp, vpp, pp_rank, dp_rank, dtype, stage, grad_dtype,
                                        seq_length, ddp_bucket_size, explicit, reshard_after_forward,
                                        keep_params_for_step, ep, etp, edp_rank, v_shape)
    return copy.copy(_STATE_CACHE[key])


_STATE_CACHE: dict = {}


def _rank_state(config, tp, pp, dp, vpp, pp_rank, dp_rank, dtype, stage, grad_dtype, seq_length, ddp_bucket_size,
                explicit, reshard_after_forward, keep_params_for_step, ep, etp, edp_rank, v_shape) -> StateBytes:
    if not config.is_moe:
        return _state_bytes(config, tp, pp, vpp, pp_rank, dp, dp_rank, dtype, stage, grad_dtype, seq_length,
                            ddp_bucket_size, explicit, reshard_after_forward, keep_params_for_step, v_shape=v_shape)
    etp = tp if etp is None else etp
    if (tp * dp) % (ep * etp):
        raise ValueError(f"etp {etp} x ep {ep} must divide tp x dp x cp = {tp * dp}: choose ep x etp among its divisors")
    edp = tp * dp // (ep * etp)
    common = (config, tp, pp, vpp, pp_rank)
    rest = (dtype, stage, grad_dtype, seq_length, ddp_bucket_size, explicit, reshard_after_forward,
            keep_params_for_step)
    dense = _state_bytes(*common, dp, dp_rank, *rest, ep=ep, etp=etp, experts=False, v_shape=v_shape)
    experts = _state_bytes(*common, edp, edp_rank, *rest, ep=ep, etp=etp, experts=True, v_shape=v_shape)
    return _with_experts(dense, experts, edp, dtype)


def _with_experts(dense: StateBytes, experts: StateBytes, edp: int, dtype: str) -> StateBytes:
    """One rank's totals from its dense and expert buffers (megalite builds both per chunk)."""
    total = {k: getattr(dense, k) + getattr(experts, k)
             for k in ("numel", "padded_numel", "owned_numel", "params", "param_buffer", "grads", "grad_padding",
                       "optimizer", "transient", "transient_grads", "transient_gathered")}
    return replace(dense, **total, build_peak=_build_peak_of_both(dense, experts, dtype), experts=experts, edp=edp)


def _build_peak_of_both(dense: StateBytes, experts: StateBytes, dtype: str) -> int:
    """`_build_peak` when each chunk lays out a dense and an expert buffer before its fp32
    parameters are released (stages 0-2: the stored bytes per element are the buffers' own)."""
    init = 0 if dtype == "fp32" else 4

    def per_chunk(st: StateBytes) -> tuple[list[float], list[int]]:
        per_elem = st.param_buffer / max(st.padded_numel, 1) + init + st.grads / max(st.padded_numel, 1)
        return ([per_elem * sum(b.end - b.start for b in chunk) for chunk in st.buckets],
                [sum(b.real_numel for b in chunk) for chunk in st.buckets])

    (alloc_d, real_d), (alloc_e, real_e) = per_chunk(dense), per_chunk(experts)
    alloc = [a + b for a, b in zip(alloc_d, alloc_e)]
    reals = [a + b for a, b in zip(real_d, real_e)]
    build = max(sum(alloc[:c + 1]) + 4 * sum(reals[c:]) for c in range(len(alloc)))
    if dtype != "fp32":
        build = max(build, sum(alloc) + 4 * (dense.owned_numel + experts.owned_numel))
    return int(build)


def _state_bytes(config, tp, pp, vpp, pp_rank, dp, dp_rank, dtype, stage, grad_dtype, seq_length, ddp_bucket_size,
                 explicit, reshard_after_forward, keep_params_for_step, ep=1, etp=None, experts=None,
                 v_shape=False) -> StateBytes:
    """rank_state_bytes of one buffer per chunk: every parameter (experts None), or the dense ones
    or the expert ones alone, reduced and sharded over `dp` ranks."""
    buckets = _rank_buckets(config, tp, pp, vpp, pp_rank, seq_length, explicit, ddp_bucket_size, dp, stage == 3,
                            ep, etp, experts, v_shape)
    pb = DTYPE_BYTES[dtype]
    gb = DTYPE_BYTES[grad_dtype] if stage >= 2 else 4
    reals = [sum(b.real_numel for b in chunk) for chunk in buckets]
    pads = [sum(b.end - b.start for b in chunk) for chunk in buckets]
    real, padded = sum(reals), sum(pads)
    owned = sum(b.owned_numel(dp, dp_rank) for chunk in buckets for b in chunk) if stage >= 1 else real
    # _master: fp32 and unsharded -> the parameter itself; fp32 sharded -> the stored parameters
    # (buffer or shard), updated in place; bf16/fp16 -> an fp32 copy (4 bytes). Adam: exp_avg + exp_avg_sq, fp32.
    master = 0 if dtype == "fp32" else 4
    optimizer = owned * (master + 8)
    # Stored: stage 0-1 whole parameters and gradients, stage 2 whole parameters and a 1/dp gradient
    # shard, stage 3 both sharded (every bucket is a multiple of dp long).
    param_numel = padded // dp if stage == 3 else padded
    grad_numel = padded // dp if stage >= 2 else padded
    build = _build_peak(stage, dtype, pb, gb, dp, reals, pads, owned, buckets)
    key = (repr(config), positions(config, seq_length), tp, pp, vpp, pp_rank, explicit, ddp_bucket_size, dp, stage,
           pb, gb, reshard_after_forward, keep_params_for_step, ep, etp, experts, v_shape)
    if key not in _TRANSIENT_CACHE:  # the search asks for the same rank's replay often
        if len(_TRANSIENT_CACHE) > 4096:
            _TRANSIENT_CACHE.clear()
        _TRANSIENT_CACHE[key] = _transient(config, tp, pp, vpp, pp_rank, seq_length, explicit, stage, pb, gb, buckets,
                                           reshard_after_forward, keep_params_for_step, ep, etp, experts, v_shape)
    replay = _TRANSIENT_CACHE[key]
    return StateBytes(numel=real, padded_numel=padded, owned_numel=owned, params=real * pb,
                      param_buffer=param_numel * pb, grads=grad_numel * gb,
                      grad_padding=(grad_numel - (real if stage < 2 else owned)) * gb,
                      optimizer=optimizer, build_peak=build, buckets=buckets, zero_stage=stage,
                      transient=replay.peak_total, transient_grads=replay.peak["grads"],
                      transient_gathered=replay.peak["gathered"], layer_buckets=replay.layer_buckets,
                      grad_bytes=gb, comm_bytes=DTYPE_BYTES[grad_dtype])


def _stage(zero_stage: int | None, distributed_optimizer: bool) -> int:
    if zero_stage is None:
        return 1 if distributed_optimizer else 0
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of 0, 1, 2, 3, got {zero_stage!r}")
    if distributed_optimizer and zero_stage == 0:
        raise ValueError("distributed_optimizer is ZeRO stage 1: give zero_stage >= 1 or drop it")
    return zero_stage


def _build_peak(stage, dtype, pb, gb, dp, reals, pads, owned, buckets) -> int:
    """Transient peak while megalite builds the rank (training.build_model_chunks, build_optimizer):
    every chunk is built in fp32 (4 B); then, chunk by chunk, its stored buffers are allocated -- the
    parameters (model dtype), the gradients and, below fp32, the fp32 initial values kept for the
    masters (4) -- before its fp32 parameters are released. Below fp32 the optimizer then clones its
    masters (4 B per owned element) before those initial values are freed. Stage 3 stores shards,
    and lays each unit out whole once (an fp32 copy, then the model-dtype one) to cut them."""
    init = 0 if dtype == "fp32" else 4
    param_share = 1 / dp if stage == 3 else 1
    grad_share = 1 / dp if stage >= 2 else 1
    per_elem = pb * param_share + init * param_share + gb * grad_share
    unit = 0
    if stage == 3:
        unit = max((b.end - b.start) * (4 + (pb if dtype != "fp32" else 0)) for chunk in buckets for b in chunk)
    build = max(per_elem * sum(pads[:c + 1]) + 4 * sum(reals[c:]) + unit for c in range(len(pads)))
    if dtype != "fp32":
        build = max(build, per_elem * sum(pads) + 4 * owned)
    return int(build)


_BUCKET_CACHE: dict = {}
_TRANSIENT_CACHE: dict = {}


def _rank_buckets(config, tp, pp, vpp, pp_rank, seq_length, explicit, bucket_numel, dp, units=False, ep=1,
                  etp=None, experts=None, v_shape=False) -> list:
    """plan_layout of every chunk of one rank (ZeRO-3: its units), cached (the planner asks for the
    same ones often); `experts`: of the expert buffer (True), the dense one (False), or all (None)."""
    key = (repr(config), positions(config, seq_length), tp, pp, vpp, pp_rank, explicit, bucket_numel, dp, units,
           ep, etp, experts, v_shape)
    if key not in _BUCKET_CACHE:
        if len(_BUCKET_CACHE) > 4096:
            _BUCKET_CACHE.clear()
        chunks = rank_parameters(config, tp, pp, vpp, pp_rank, seq_length, explicit, ep=ep, etp=etp, experts=experts,
                                 v_shape=v_shape)
        if units:
            layers = rank_parameter_layers(config, tp, pp, vpp, pp_rank, seq_length, explicit, experts=experts,
                                           v_shape=v_shape)
            _BUCKET_CACHE[key] = [plan_layout(c, bucket_numel, dp, units=chunk_units(c, ls))
                                  for c, ls in zip(chunks, layers)]
        else:
            _BUCKET_CACHE[key] = [plan_layout(c, bucket_numel, dp) for c in chunks]
    return _BUCKET_CACHE[key]


class _Param:
    """Stands for one parameter in `megalite.optim.zero.layer_units`, which reads only ids and
    whether a parameter is deferred."""
    __slots__ = ("deferred",)

    def __init__(self, deferred: bool):
        self.deferred = deferred


class _Layer:
    def __init__(self, params: list):
        self._params = params

    def parameters(self):
        return iter(self._params)


class _Chunk:
    def __init__(self, layers: list):
        self.layers = layers


def chunk_units(params: list[tuple[int, bool]], layer_of: list[int | None]) -> list[list[int]]:
    """ZeRO-3 units of one chunk given as `rank_parameters` / `rank_parameter_layers`: megalite's
    own `layer_units`, asked about a stand-in chunk with the same layers and parameters."""
    stand_ins = [_Param(deferred) for _, deferred in params]
    n_layers = max((i for i in layer_of if i is not None), default=-1) + 1
    layers = [_Layer([p for p, i in zip(stand_ins, layer_of) if i == k]) for k in range(n_layers)]
    return layer_units(_Chunk(layers), stand_ins, lambda p: p.deferred)


# -------------------------------------------------------------------------------------------------
# Stages 2-3: the transient peak, replayed from megalite.optim.zero's order of events
# -------------------------------------------------------------------------------------------------
class _Replay:
    """The byte counters of `ShardedGradBuffer` / `ShardedParamBuffer` (`_transient`), driven by
    one step's events on one chunk: units gathered and freed, gradients arriving per parameter,
    buckets launched (at most MAX_IN_FLIGHT reduce-scatters in flight) and landed."""

    def __init__(self, buckets: list[BucketLayout], stage: int, pb: int, gb: int, keep_for_step: bool):
        self.buckets, self.stage, self.pb, self.gb = buckets, stage, pb, gb
        self.keep_for_step = keep_for_step
        self.bucket_of = {k: i for i, b in enumerate(buckets) for k in b.members}
        self.now = {"grads": 0, "gathered": 0}
        self.peak = {"grads": 0, "gathered": 0}
        self.peak_total = 0
        self.gathered: set[int] = set()
        self.open: dict[int, int] = {}  # bucket -> gradients in so far
        self.in_flight: list[int] = []

    def _count(self, kind: str, nbytes: int) -> None:
        self.now[kind] += nbytes
        self.peak[kind] = max(self.peak[kind], self.now[kind])
        self.peak_total = max(self.peak_total, sum(self.now.values()))

    def _numel(self, i: int) -> int:
        return self.buckets[i].end - self.buckets[i].start

    def gather(self, i: int) -> None:
        if i not in self.gathered:
            self.gathered.add(i)
            self._count("gathered", self._numel(i) * self.pb)

    def free(self, i: int) -> None:
        if i in self.gathered and not self.keep_for_step:
            self.gathered.discard(i)
            self._count("gathered", -self._numel(i) * self.pb)

    def grad(self, k: int) -> None:
        i = self.bucket_of[k]
        if i not in self.open:
            self.open[i] = 0
            self._count("grads", self._numel(i) * self.gb)
        self.open[i] += 1
        if self.open[i] == len(self.buckets[i].members):
            self._launch(i)

    def _launch(self, i: int) -> None:
        self.in_flight.append(i)
        while len(self.in_flight) > MAX_IN_FLIGHT:
            self._land(self.in_flight.pop(0))
        if self.stage == 3:
            self.free(i)  # its gradients are in: the unit is not needed again this backward

    def _land(self, i: int) -> None:
        del self.open[i]
        self._count("grads", -self._numel(i) * self.gb)

    def end_of_backward(self) -> None:
        for i in list(self.open):
            if i not in self.in_flight:
                self._launch(i)
        while self.in_flight:
            self._land(self.in_flight.pop(0))


@dataclass
class _Peaks:
    peak_total: int = 0
    peak: dict = field(default_factory=lambda: {"grads": 0, "gathered": 0})
    layer_buckets: list = field(default_factory=list)


def _transient(config, tp, pp, vpp, pp_rank, seq_length, explicit, stage, pb, gb, buckets, reshard,
               keep, ep=1, etp=None, experts=None, v_shape=False) -> _Peaks:
    """Stages 2-3: the largest transient of one step on this rank. Chunks run one at a time and
    each forward and backward ends with nothing in flight (and, resharding, nothing gathered), so
    the rank's peak is its fullest chunk's; kept gathered (no resharding) they add up."""
    out = _Peaks()
    if stage < 2:
        return out
    chunks = rank_parameters(config, tp, pp, vpp, pp_rank, seq_length, explicit, ep=ep, etp=etp, experts=experts,
                             v_shape=v_shape)
    layers = rank_parameter_layers(config, tp, pp, vpp, pp_rank, seq_length, explicit, experts=experts,
                                   v_shape=v_shape)
    v = vpp or 1
    peaks = []
    for c, (params, layer_of, chunk_buckets) in enumerate(zip(chunks, layers, buckets)):
        if not params:  # a chunk without expert weights: no expert buffer
            peaks.append(_Replay(chunk_buckets, stage, pb, gb, False))
            out.layer_buckets.append(set())
            continue
        post = virtual_stage(pp, pp_rank, c, v_shape) == pp * v - 1
        replay = _Replay(chunk_buckets, stage, pb, gb, keep and stage == 3)
        layer_bucket = _replay_step(replay, params, layer_of, post, reshard or stage < 3)
        out.layer_buckets.append(set(layer_bucket))
        peaks.append(replay)
    out.peak = {k: max(r.peak[k] for r in peaks) for k in ("grads", "gathered")}
    out.peak_total = max(r.peak_total for r in peaks)
    if stage == 3 and (keep or not reshard) and len(peaks) > 1:
        # Interleaved, every chunk forwards before the first backward and keeps its units: one
        # chunk's peak with the other chunks whole.
        whole = [sum(b.end - b.start for b in chunk) * pb for chunk in buckets]
        out.peak_total = max(r.peak_total + sum(whole) - whole[c] for c, r in enumerate(peaks))
        out.peak["gathered"] = sum(whole)
    return out


def _replay_step(replay: _Replay, params, layer_of, post: bool, reshard: bool) -> list[int]:
    """One micro-batch's forward and backward of a chunk, in the order megalite's hooks see them
    (zero._UnitHooks; stage 2 only has the backward's gradients). Returns the bucket of each layer."""
    layer_ids = sorted({i for i in layer_of if i is not None})  # an expert buffer skips the dense layers
    n_layers = len(layer_ids)
    layer_bucket = [replay.bucket_of[layer_of.index(i)] for i in layer_ids]
    others = sorted({replay.bucket_of[k] for k, i in enumerate(layer_of) if i is None})
    if replay.stage == 3:  # forward: the chunk's other units, then each layer with the next prefetched
        for i in others:
            replay.gather(i)
        for i in range(n_layers):
            replay.gather(layer_bucket[i])
            if i + 1 < n_layers:
                replay.gather(layer_bucket[i + 1])
            if reshard:
                replay.free(layer_bucket[i])
        if reshard:
            for i in others:
                replay.free(i)
        for i in others:  # backward: the chunk's output hook gathers them, prefetches the last layer
            replay.gather(i)
        if n_layers:
            replay.gather(layer_bucket[-1])
    # Gradients, as backward produces them: the output layer's and final norm's first (with the
    # deferred tied copy that the output layer uses), then the layers last to first (each in
    # reverse definition order), then the embeddings (a tied one once both its uses are in).
    in_layers = [k for k, i in enumerate(layer_of) if i is not None]
    first, last = (in_layers[0], in_layers[-1]) if in_layers else (len(params), len(params) - 1)
    early = [k for k, (_, deferred) in enumerate(params) if deferred and post]
    tail = [k for k in reversed(range(last + 1, len(params))) if k not in early]
    head = [k for k in reversed(range(min(first, last + 1))) if k not in early]
    for k in early + tail:
        replay.grad(k)
    for i in reversed(range(n_layers)):
        if replay.stage == 3:
            replay.gather(layer_bucket[i])
            if i > 0:
                replay.gather(layer_bucket[i - 1])
        for k in reversed([k for k, j in enumerate(layer_of) if j == layer_ids[i]]):
            replay.grad(k)
    for k in head:
        replay.grad(k)
    replay.end_of_backward()
    return layer_bucket


@functools.lru_cache(maxsize=4096)
def in_flight_chunks(p: int, r: int, m: int, vpp: int | None, schedule: str = "1f1b") -> int:
    """Micro-batches (of one model chunk each) whose activations pipeline rank r holds at its peak,
    read off the schedule program megalite runs (zb-h1: forwarded and not yet through W)."""
    return peak_in_flight(build_program(p, r, m, vpp, schedule))


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
    """The last stage's extra: the final LayerNorm input and the (sequence-gathered) output-layer
    input, in the model dtype; the cross-entropy's peak: the model-dtype logits, their fp32 copy and
    the fp32 softmax kept for backward (a copy only when the model is not fp32)."""
    s, b, h, t = run.seq_length // layout.cp, layout.micro_batch_size, config.hidden_size, layout.tp
    ab = DTYPE_BYTES[run.dtype]
    sbh = s * b * h * ab
    output = (sbh / t if layout.sequence_parallel else sbh) + sbh
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


def over(need: float, capacity: float) -> str:
    """GiB with enough digits to show that it exceeds the capacity."""
    for digits in (1, 2, 3):
        text = f"{need / GIB:.{digits}f}"
        if float(text) > capacity / GIB:
            return text
    return f"{need / GIB:.4f}"
