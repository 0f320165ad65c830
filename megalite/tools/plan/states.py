"""What one rank holds for the model and the optimizer (`StateBytes`, `rank_state_bytes`):
parameters, gradient buffers and optimizer states exactly as megalite allocates them at each ZeRO
stage, a MoE model's expert buffers beside the dense ones, and the transient peak of the build
(stages 2-3's transient peak of a step: zero_replay.py)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

from megalite.models.config import TransformerConfig
from megalite.optim.buffers import BucketLayout, plan_layout
from megalite.tools.plan.inputs import (DTYPE_BYTES, ZERO_STAGES, positions, rank_parameter_layers, rank_parameter_parts,
                                        rank_parameters)
from megalite.tools.plan.overlap import needed_fractions, ready_fractions
from megalite.tools.plan.zero_replay import chunk_units, transient_peak


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
    # per chunk and bucket: the fraction of the chunk's layer backward done when it is complete (overlap.py)
    bucket_ready: list[list[float]] = field(default_factory=list)
    bucket_needed: list[list[float]] = field(default_factory=list)  # per chunk: overlap.needed_fractions
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

    @property
    def expert_ready(self) -> list[list[float]]:
        """Per chunk, the expert buckets' `bucket_ready`."""
        return self.experts.bucket_ready if self.experts is not None else [[] for _ in self.buckets]

    @property
    def expert_needed(self) -> list[list[float]]:
        """Per chunk, the expert buckets' `bucket_needed`."""
        return self.experts.bucket_needed if self.experts is not None else [[] for _ in self.buckets]


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
    buckets, ready, needed = _rank_buckets(config, tp, pp, vpp, pp_rank, seq_length, explicit, ddp_bucket_size, dp,
                                           stage == 3, ep, etp, experts, v_shape)
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
        _TRANSIENT_CACHE[key] = transient_peak(config, tp, pp, vpp, pp_rank, seq_length, explicit, stage, pb, gb,
                                               buckets, reshard_after_forward, keep_params_for_step, ep, etp, experts,
                                               v_shape)
    replay = _TRANSIENT_CACHE[key]
    return StateBytes(numel=real, padded_numel=padded, owned_numel=owned, params=real * pb,
                      param_buffer=param_numel * pb, grads=grad_numel * gb,
                      grad_padding=(grad_numel - (real if stage < 2 else owned)) * gb,
                      optimizer=optimizer, build_peak=build, buckets=buckets, zero_stage=stage,
                      transient=replay.peak_total, transient_grads=replay.peak["grads"],
                      transient_gathered=replay.peak["gathered"], layer_buckets=replay.layer_buckets,
                      grad_bytes=gb, comm_bytes=DTYPE_BYTES[grad_dtype], bucket_ready=ready,
                      bucket_needed=needed)


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
        unit = max(((b.end - b.start) * (4 + (pb if dtype != "fp32" else 0)) for chunk in buckets for b in chunk),
                   default=0)  # a rank whose stages hold no weight (a layout's empty stages) has none
    build = max(per_elem * sum(pads[:c + 1]) + 4 * sum(reals[c:]) + unit for c in range(len(pads)))
    if dtype != "fp32":
        build = max(build, per_elem * sum(pads) + 4 * owned)
    return int(build)


_BUCKET_CACHE: dict = {}
_TRANSIENT_CACHE: dict = {}


def _rank_buckets(config, tp, pp, vpp, pp_rank, seq_length, explicit, bucket_numel, dp, units=False, ep=1,
                  etp=None, experts=None, v_shape=False) -> tuple[list, list, list]:
    """plan_layout of every chunk of one rank (ZeRO-3: its units), cached (the planner asks for the
    same ones often); `experts`: of the expert buffer (True), the dense one (False), or all (None).
    With them, per chunk and bucket, the fraction of the chunk's layer backward done when the bucket
    is complete (overlap.ready_fractions), and the fraction of its forward done when the bucket is
    first needed (overlap.needed_fractions)."""
    key = (repr(config), positions(config, seq_length), tp, pp, vpp, pp_rank, explicit, bucket_numel, dp, units,
           ep, etp, experts, v_shape)
    if key not in _BUCKET_CACHE:
        if len(_BUCKET_CACHE) > 4096:
            _BUCKET_CACHE.clear()
        chunks = rank_parameters(config, tp, pp, vpp, pp_rank, seq_length, explicit, ep=ep, etp=etp, experts=experts,
                                 v_shape=v_shape)
        layers = rank_parameter_layers(config, tp, pp, vpp, pp_rank, seq_length, explicit, experts=experts,
                                       v_shape=v_shape)
        if units:
            layouts = [plan_layout(c, bucket_numel, dp, units=chunk_units(c, ls)) for c, ls in zip(chunks, layers)]
        else:
            layouts = [plan_layout(c, bucket_numel, dp) for c in chunks]
        ready = [ready_fractions(b, [n for n, _ in c], ls) for b, c, ls in zip(layouts, chunks, layers)]
        parts = rank_parameter_parts(config, tp, pp, vpp, pp_rank, seq_length, explicit, experts=experts,
                                     v_shape=v_shape)
        needed = [needed_fractions(b, [n for n, _ in c], ls, ps) for b, c, ls, ps in zip(layouts, chunks, layers, parts)]
        _BUCKET_CACHE[key] = (layouts, ready, needed)
    return _BUCKET_CACHE[key]
