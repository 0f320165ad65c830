"""Process groups: tensor (TP) x context (CP) x data (DP) x pipeline (PP), and for expert layers
expert-tensor (ETP) x expert (EP) x expert-data (EDP) x pipeline over the same ranks.

Rank order follows Megatron-Core: tensor fastest, then context, then data, then pipeline,
    rank = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank
so a TP group is a block of consecutive ranks (one node's fast links), and with cp = 1 every rank
keeps the 3D position. Every group is the set of ranks that differ along some of these dimensions
only (`GROUPS`, `rank_groups`).

Expert layers fold their own grid onto each pipeline stage's TP x CP x DP ranks (Megatron-Core's
"parallel folding"): ETP fastest, then EP, then EDP, with ETP x EP x EDP = TP x CP x DP, so
    rank = pp_rank * (edp * ep * etp) + edp_rank * (ep * etp) + ep_rank * etp + etp_rank
Attention and dense layers keep the first grid; an expert's weights are split over ETP, the experts
over EP, and copies of one expert shard are the EDP group (its gradients are reduced there).

When torch.distributed is not initialized at all, every getter answers as a single
process (size 1, rank 0, group None), so the parallel layers work in a plain script.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field

import torch.distributed as dist

from megalite.parallel import lanes

# The groups every rank builds, in this order (each rank must call new_group for every group, in
# the same order): name -> the parallel dimensions along which its ranks differ.
GROUPS = {
    "tensor": ("tensor",),
    "context": ("context",),
    "data": ("data",),
    # Context-parallel ranks hold the same parameters: their gradients are reduced together with
    # data parallelism's, and the distributed optimizer shards over both.
    "data_context": ("context", "data"),
    # One micro-batch's tokens under sequence and context parallelism (MoE load-balancing statistics).
    "tensor_context": ("tensor", "context"),
    "model": ("tensor", "pipeline"),  # one full model replica (for global norms and checks)
    "pipeline": ("pipeline",),
}
# The expert grid's groups, over the sizes (expert_tensor, expert, expert_data, pipeline).
EXPERT_GROUPS = {
    "expert_tensor": ("expert_tensor",),
    "expert": ("expert",),
    "expert_tensor_and_model": ("expert_tensor", "expert"),  # the all-gather dispatcher's ranks
    "expert_data": ("expert_data",),
    # every expert shard of the model once (for global norms)
    "expert_model_pipeline": ("expert_tensor", "expert", "pipeline"),
}


@dataclass
class _ParallelState:
    sizes: dict  # dimension -> its size
    groups: dict = field(default_factory=dict)  # GROUPS name -> this rank's group
    ranks: dict = field(default_factory=dict)  # GROUPS name -> its global ranks, ascending
    vpp: int | None = None
    embedding_group: object = None  # first and last pipeline stage, for tied embeddings
    embedding_ranks: list = field(default_factory=list)
    virtual_pp_rank: int | None = None
    expert_sizes: dict = field(default_factory=dict)  # the expert grid's dimension -> size
    timeout: object = None  # of every group, those built on first use included


_STATE: _ParallelState | None = None
# Groups already built in this process, by (name, ranks, timeout, backend): a later
# initialize_model_parallel (the next run of a test spawn, a notebook's second layout) takes them
# again instead of building more. Each gloo group holds its own connections and threads (about 40
# threads and 70 descriptors a rank for one layout's groups at 8 ranks), which would pile up;
# destroying them instead costs more than building them (0.16 s a layout at 8 ranks). Held weakly,
# as is the default group they were built under: torch holds every live group until the default
# one is destroyed, and then nothing here keeps them (or the store, and its port) alive.
_BUILT: dict[tuple, object] = {}  # key -> a weak reference to the group (or new_group's non-member marker)
_BUILT_UNDER: weakref.ref | None = None  # to the default group they were built under


def built_group(name: str, ranks: list[int], timeout=None, backend: str | None = None):
    """dist.new_group(ranks, timeout), or the `name` group built for these ranks before under the same
    default group. Collective like new_group: every rank asks for the same groups in the same order,
    so all find them built or all build them. Groups of other names over the same ranks stay apart
    (their own communicators: operations on one need no order against the other's)."""
    global _BUILT_UNDER
    world = dist.group.WORLD
    if _BUILT_UNDER is None or _BUILT_UNDER() is not world:  # a new default group: the old ones went with it
        _BUILT.clear()
        _BUILT_UNDER = weakref.ref(world)
    key = (name, tuple(ranks), timeout, backend)
    held = _BUILT.get(key)
    group = held() if isinstance(held, weakref.ref) else held
    if group is None:
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        # (a rank outside `ranks` gets torch's marker, an int: kept as it is)
        _BUILT[key] = weakref.ref(group) if isinstance(group, dist.ProcessGroup) else group
    return group


def _layout_error(what: str, size: int, world: int, fix: str) -> ValueError:
    return ValueError(f"{what} ({size}) does not divide the world size ({world}): {fix}")


def rank_groups(sizes: dict[str, int], spanned: tuple[str, ...]) -> list[list[int]]:
    """Every group of global ranks that differ only along the `spanned` dimensions. `sizes` lists the
    dimensions in rank order, fastest first: a rank's coordinate in one is (rank // the product of
    the faster sizes) % its size. Groups, and the ranks in each, go slowest dimension first, so ranks
    ascend within a group."""
    strides, stride = {}, 1
    for name, size in sizes.items():
        strides[name], stride = stride, stride * size
    slowest_first = list(reversed(sizes))
    fixed = [name for name in slowest_first if name not in spanned]
    moving = [name for name in slowest_first if name in spanned]

    def offsets(names):
        for coordinates in itertools.product(*(range(sizes[name]) for name in names)):
            yield sum(c * strides[name] for name, c in zip(names, coordinates))

    return [[base + offset for offset in offsets(moving)] for base in offsets(fixed)]


def _check_sizes(world: int, tp: int, pp: int, vpp: int | None, cp: int = 1) -> None:
    for name, size in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                       ("context_parallel_size", cp)):
        if size < 1:
            raise ValueError(f"{name} must be >= 1, got {size}")
    if world % tp:
        raise _layout_error("tensor_model_parallel_size", tp, world, "choose a TP size that divides it")
    if world % (tp * pp):
        raise ValueError(
            f"tensor_model_parallel_size x pipeline_model_parallel_size ({tp} x {pp} = {tp * pp}) "
            f"does not divide the world size ({world}): choose sizes whose product divides it"
        )
    if world % (tp * cp * pp):
        raise ValueError(
            f"tensor x context x pipeline parallel sizes ({tp} x {cp} x {pp} = {tp * cp * pp}) do not divide "
            f"the world size ({world}): choose sizes whose product divides it"
        )
    if vpp is not None and vpp > 1 and pp < 2:
        raise ValueError(
            f"virtual_pipeline_model_parallel_size ({vpp}) needs pipeline_model_parallel_size > 1 "
            f"(got {pp}): drop --vpp or raise --pp"
        )
    if vpp is not None and vpp < 1:
        raise ValueError(f"virtual_pipeline_model_parallel_size must be >= 1, got {vpp}")


def expert_grid(tp: int, cp: int, dp: int, pp: int, ep: int = 1, etp: int | None = None) -> dict[str, int]:
    """The expert layers' sizes, fastest first, folded onto the TP x CP x DP ranks of each stage.
    A ValueError names the numbers when EP x ETP does not divide TP x CP x DP."""
    etp = tp if etp is None else etp
    for name, size in (("expert_model_parallel_size", ep), ("expert_tensor_parallel_size", etp)):
        if size < 1:
            raise ValueError(f"{name} must be >= 1, got {size}")
    stage = tp * cp * dp
    if stage % (ep * etp):
        raise ValueError(
            f"expert-tensor x expert parallel sizes ({etp} x {ep} = {etp * ep}) do not divide the ranks of a "
            f"pipeline stage (TP x CP x DP = {tp} x {cp} x {dp} = {stage}): choose --ep and --etp whose product "
            f"divides {stage}")
    return {"expert_tensor": etp, "expert": ep, "expert_data": stage // (ep * etp), "pipeline": pp}


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    timeout=None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
) -> None:
    """Build the TP, CP, PP, DP, model-parallel and embedding groups on every rank, and the expert
    grid's ETP, EP, ETP x EP and EDP groups (ETP defaults to the TP size). `timeout` (a timedelta)
    bounds every collective in them; by default torch's default for the backend."""
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group() "
            "(or launch with torchrun) before initialize_model_parallel()"
        )
    world = dist.get_world_size()
    tp, pp, vpp = tensor_model_parallel_size, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size
    cp = context_parallel_size
    _check_sizes(world, tp, pp, vpp, cp)
    sizes = {"tensor": tp, "context": cp, "data": world // (tp * cp * pp), "pipeline": pp}  # fastest first
    expert_sizes = expert_grid(tp, cp, sizes["data"], pp, expert_model_parallel_size, expert_tensor_parallel_size)
    state = _ParallelState(sizes=sizes, vpp=vpp if vpp and vpp > 1 else None, expert_sizes=expert_sizes,
                           timeout=timeout)
    if state.vpp:
        state.virtual_pp_rank = 0
    rank = dist.get_rank()
    for name, spanned in GROUPS.items():
        for ranks in rank_groups(sizes, spanned):
            group = built_group(name, ranks, timeout)
            if rank in ranks:
                state.groups[name], state.ranks[name] = group, ranks
    for name, spanned in EXPERT_GROUPS.items():
        for ranks in rank_groups(expert_sizes, spanned):
            group = built_group(name, ranks, timeout)
            if rank in ranks:
                state.groups[name], state.ranks[name] = group, ranks
    # The first and last stage of each pipeline share the tied word embeddings.
    for pipeline in rank_groups(sizes, GROUPS["pipeline"]):
        ends = sorted({pipeline[0], pipeline[-1]})
        group = built_group("embedding", ends, timeout)
        if rank in ends:
            state.embedding_group, state.embedding_ranks = group, ends
    _STATE = state


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def destroy_model_parallel() -> None:
    global _STATE
    _STATE = None


def _state() -> _ParallelState | None:
    if _STATE is None and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            "model parallel groups are not initialized: call "
            "megalite.parallel.initialize_model_parallel() after init_process_group()"
        )
    return _STATE


def _getters(dimension: str, prefix: str):
    """get_{prefix}_group, get_{prefix}_world_size and get_{prefix}_rank for one group. Without
    torch.distributed they answer as a single process: group None, size 1, rank 0."""

    def group():
        s = _state()
        return s.groups[dimension] if s else None

    def world_size() -> int:
        s = _state()
        return len(s.ranks[dimension]) if s else 1

    def rank() -> int:
        s = _state()
        return dist.get_rank(s.groups[dimension]) if s else 0

    for getter in (group, world_size, rank):
        getter.__name__ = getter.__qualname__ = f"get_{prefix}_{getter.__name__}"
    return group, world_size, rank


(get_tensor_model_parallel_group, get_tensor_model_parallel_world_size,
 get_tensor_model_parallel_rank) = _getters("tensor", "tensor_model_parallel")
(get_pipeline_model_parallel_group, get_pipeline_model_parallel_world_size,
 get_pipeline_model_parallel_rank) = _getters("pipeline", "pipeline_model_parallel")
(get_context_parallel_group, get_context_parallel_world_size,
 get_context_parallel_rank) = _getters("context", "context_parallel")
(get_expert_model_parallel_group, get_expert_model_parallel_world_size,
 get_expert_model_parallel_rank) = _getters("expert", "expert_model_parallel")
(get_expert_tensor_parallel_group, get_expert_tensor_parallel_world_size,
 get_expert_tensor_parallel_rank) = _getters("expert_tensor", "expert_tensor_parallel")
(get_expert_tensor_and_model_parallel_group, get_expert_tensor_and_model_parallel_world_size,
 get_expert_tensor_and_model_parallel_rank) = _getters("expert_tensor_and_model", "expert_tensor_and_model_parallel")
(get_expert_data_parallel_group, get_expert_data_parallel_world_size,
 get_expert_data_parallel_rank) = _getters("expert_data", "expert_data_parallel")
_data_group, _data_world_size, _data_rank = _getters("data", "data_parallel")
_data_context = _getters("data_context", "data_parallel")


def get_data_parallel_group(with_context_parallel: bool = False):
    """The data-parallel group; with_context_parallel: data x context, the ranks that hold the same
    parameters (gradients are reduced and the optimizer sharded over it)."""
    return _data_context[0]() if with_context_parallel else _data_group()


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    if with_context_parallel:
        s = _state()
        return s.sizes["data"] * s.sizes["context"] if s else 1
    return _data_world_size()


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return _data_context[2]() if with_context_parallel else _data_rank()


def get_tensor_and_context_parallel_group():
    """TP x CP: the ranks that share one micro-batch's tokens (sequence-sharded over both)."""
    s = _state()
    return s.groups["tensor_context"] if s else None


def get_amax_reduction_group():
    """TP x CP x DP: the ranks of one pipeline stage, which hold the same layers (or their TP parts)
    and see every token of a step between them: FP8 delayed scaling reduces its amaxes over them
    once a step. Built on first use, so collective: every rank calls it."""
    s = _state()
    if s is None:
        return None
    if "amax" not in s.groups:
        for ranks in rank_groups(s.sizes, ("tensor", "context", "data")):
            group = built_group("amax", ranks, s.timeout)
            if dist.get_rank() in ranks:
                s.groups["amax"], s.ranks["amax"] = group, ranks
    return s.groups["amax"]


def get_expert_data_parallel_group_in_replica():
    """Local SGD: the ranks of one data-parallel replica (its TP x CP ranks) that hold the same expert
    shard, whose expert gradients are summed every step; replicas meet only in the outer step. Built
    on first use, so collective: every rank calls it. A ValueError when EP x ETP does not divide
    TP x CP (an expert group would cross replicas)."""
    s = _state()
    if s is None:
        return None
    if "expert_data_replica" not in s.groups:
        e, model = s.expert_sizes, s.sizes["tensor"] * s.sizes["context"]
        grid = e["expert_tensor"] * e["expert"]
        if model % grid:
            raise ValueError(f"local SGD keeps expert parallelism inside a replica: expert-tensor x expert parallel "
                             f"sizes ({e['expert_tensor']} x {e['expert']}) must divide TP x CP ({model}); choose "
                             f"--ep and --etp whose product divides {model}")
        sizes = {"expert_tensor": e["expert_tensor"], "expert": e["expert"], "in_replica": model // grid,
                 "replica": s.sizes["data"], "pipeline": s.sizes["pipeline"]}
        for ranks in rank_groups(sizes, ("in_replica",)):
            group = built_group("expert_data_replica", ranks, s.timeout)
            if dist.get_rank() in ranks:
                s.groups["expert_data_replica"], s.ranks["expert_data_replica"] = group, ranks
    return s.groups["expert_data_replica"]


def get_expert_data_parallel_group_in_replica_size() -> int:
    s = _state()
    return len(s.ranks["expert_data_replica"]) if s and "expert_data_replica" in s.ranks else 1


def get_expert_model_pipeline_group():
    """ETP x EP x PP: the ranks that together hold every expert shard of one model copy once."""
    s = _state()
    return s.groups["expert_model_pipeline"] if s else None


def get_model_parallel_group():
    """TP x PP ranks holding one full model replica (for global norms and checks)."""
    s = _state()
    return s.groups["model"] if s else None


def get_embedding_group():
    """First and last pipeline stage of this rank's pipeline (None if not one of them)."""
    s = _state()
    return s.embedding_group if s else None


def is_rank_in_embedding_group() -> bool:
    s = _state()
    return s is None or dist.get_rank() in s.embedding_ranks


def get_pipeline_model_parallel_ranks() -> list[int]:
    """Global ranks of this rank's pipeline, stage 0 first."""
    s = _state()
    return list(s.ranks["pipeline"]) if s else [0]


def get_context_parallel_ranks() -> list[int]:
    """Global ranks of this rank's context-parallel group, CP rank 0 first (the ring's order)."""
    s = _state()
    return list(s.ranks["context"]) if s else [0]


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    s = _state()
    return s.vpp if s else None


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    s = _state()
    return s.virtual_pp_rank if s else None


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    s = _state()
    if s is not None:
        s.virtual_pp_rank = rank


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    s = _state()
    if s is None:
        return True
    if not ignore_virtual and s.vpp and s.virtual_pp_rank != 0:
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    s = _state()
    if s is None:
        return True
    if not ignore_virtual and s.vpp and s.virtual_pp_rank != s.vpp - 1:
        return False
    return get_pipeline_model_parallel_rank() == s.sizes["pipeline"] - 1


# Each pass of an overlapped pair (megalite.parallel.lanes) runs in its own model chunk.
lanes.register_lane_local(get_virtual_pipeline_model_parallel_rank, set_virtual_pipeline_model_parallel_rank)
