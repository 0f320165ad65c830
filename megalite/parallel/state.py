"""3D process groups: tensor (TP) x data (DP) x pipeline (PP).

Rank order follows Megatron-Core: tensor fastest, then data, then pipeline,
    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank
so a TP group is a block of consecutive ranks (one node's fast links).

When torch.distributed is not initialized at all, every getter answers as a single
process (size 1, rank 0, group None), so the parallel layers work in a plain script.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist


@dataclass
class _ParallelState:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int | None = None
    tp_group: object = None
    pp_group: object = None
    dp_group: object = None
    model_parallel_group: object = None  # TP x PP of one DP replica
    embedding_group: object = None  # first and last pipeline stage, for tied embeddings
    pp_ranks: list = field(default_factory=list)  # global ranks of this rank's pipeline
    embedding_ranks: list = field(default_factory=list)
    virtual_pp_rank: int | None = None


_STATE: _ParallelState | None = None


def _layout_error(what: str, size: int, world: int, fix: str) -> ValueError:
    return ValueError(f"{what} ({size}) does not divide the world size ({world}): {fix}")


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    timeout=None,
) -> None:
    """Build the TP, PP, DP, model-parallel and embedding groups on every rank. `timeout` (a
    timedelta) bounds every collective in them; by default torch's default for the backend."""
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group() "
            "(or launch with torchrun) before initialize_model_parallel()"
        )
    world = dist.get_world_size()
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    for name, size in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
        if size < 1:
            raise ValueError(f"{name} must be >= 1, got {size}")
    if world % tp:
        raise _layout_error("tensor_model_parallel_size", tp, world, "choose a TP size that divides it")
    if world % (tp * pp):
        raise ValueError(
            f"tensor_model_parallel_size x pipeline_model_parallel_size ({tp} x {pp} = {tp * pp}) "
            f"does not divide the world size ({world}): choose sizes whose product divides it"
        )
    vpp = virtual_pipeline_model_parallel_size
    if vpp is not None and vpp > 1 and pp < 2:
        raise ValueError(
            f"virtual_pipeline_model_parallel_size ({vpp}) needs pipeline_model_parallel_size > 1 "
            f"(got {pp}): drop --vpp or raise --pp"
        )
    if vpp is not None and vpp < 1:
        raise ValueError(f"virtual_pipeline_model_parallel_size must be >= 1, got {vpp}")
    dp = world // (tp * pp)
    rank = dist.get_rank()
    state = _ParallelState(tp=tp, pp=pp, dp=dp, vpp=vpp if vpp and vpp > 1 else None)
    if state.vpp:
        state.virtual_pp_rank = 0

    def rank_of(p: int, d: int, t: int) -> int:
        return p * dp * tp + d * tp + t

    # Every rank must call new_group for every group, in the same order.
    for p in range(pp):
        for d in range(dp):
            ranks = [rank_of(p, d, t) for t in range(tp)]
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                state.tp_group = group
    for p in range(pp):
        for t in range(tp):
            ranks = [rank_of(p, d, t) for d in range(dp)]
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                state.dp_group = group
    for d in range(dp):
        ranks = [rank_of(p, d, t) for p in range(pp) for t in range(tp)]
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            state.model_parallel_group = group
    for d in range(dp):
        for t in range(tp):
            ranks = [rank_of(p, d, t) for p in range(pp)]
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                state.pp_group, state.pp_ranks = group, ranks
            emb_ranks = sorted({ranks[0], ranks[-1]})
            group = dist.new_group(emb_ranks, timeout=timeout)
            if rank in emb_ranks:
                state.embedding_group, state.embedding_ranks = group, emb_ranks
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


def _rank_in(group) -> int:
    return dist.get_rank(group) if group is not None else 0


def get_tensor_model_parallel_group():
    s = _state()
    return s.tp_group if s else None


def get_tensor_model_parallel_world_size() -> int:
    s = _state()
    return s.tp if s else 1


def get_tensor_model_parallel_rank() -> int:
    s = _state()
    return _rank_in(s.tp_group) if s else 0


def get_pipeline_model_parallel_group():
    s = _state()
    return s.pp_group if s else None


def get_pipeline_model_parallel_world_size() -> int:
    s = _state()
    return s.pp if s else 1


def get_pipeline_model_parallel_rank() -> int:
    s = _state()
    return _rank_in(s.pp_group) if s else 0


def get_data_parallel_group():
    s = _state()
    return s.dp_group if s else None


def get_data_parallel_world_size() -> int:
    s = _state()
    return s.dp if s else 1


def get_data_parallel_rank() -> int:
    s = _state()
    return _rank_in(s.dp_group) if s else 0


def get_model_parallel_group():
    """TP x PP ranks holding one full model replica (for global norms and checks)."""
    s = _state()
    return s.model_parallel_group if s else None


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
    return list(s.pp_ranks) if s else [0]


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
    return get_pipeline_model_parallel_rank() == s.pp - 1
