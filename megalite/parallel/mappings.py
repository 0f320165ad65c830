"""Autograd-aware collectives over a process group: the tensor-parallel group unless `group=` names
another (context- or expert-parallel code reuses them over its own ranks).

Each pair is a forward collective whose backward is its conjugate:
copy <-> all-reduce, scatter (split) <-> all-gather, and for sequence parallelism
all-gather along the sequence <-> reduce-scatter along the sequence.
Tensors are laid out [sequence, batch, hidden], so the sequence is dim 0. Over a group of one rank
every collective is the identity and adds no autograd node.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel import state

# torch >= 2.12 renamed the single-tensor collectives; keep working on older releases (the one
# place that knows: optim.buffers uses these too).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _size(group) -> int:
    return state.get_tensor_model_parallel_world_size() if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return state.get_tensor_model_parallel_rank() if group is None else dist.get_rank(group)


def _group(group):
    return state.get_tensor_model_parallel_group() if group is None else group


def _split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    return x.chunk(_size(group), dim=-1)[_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x, group=_group(group))
    return torch.cat(parts, dim=-1)


def _reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=_group(group))
    return x


def _split_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = _size(group)
    if x.shape[0] % size:
        raise ValueError(f"sequence length ({x.shape[0]}) is not divisible by the group size ({size})")
    return x.chunk(size, dim=0)[_rank(group)].contiguous()


def _gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((x.shape[0] * _size(group), *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(out, x, group=_group(group))
    return out


def _reduce_scatter_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = _size(group)
    if x.shape[0] % size:
        raise ValueError(f"sequence length ({x.shape[0]}) is not divisible by the group size ({size})")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, x, group=_group(group))
    return out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _reduce(g, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        if not x.is_contiguous():
            return _reduce(x, group)
        # Sum in place: x is a fresh matmul output nobody else holds, so no copy is needed.
        ctx.mark_dirty(x)
        dist.all_reduce(x, group=_group(group))
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_last_dim(g, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, g):
        return _split_last_dim(g, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first_dim(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_first_dim(g, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_grad_is_parallel, group):
        ctx.output_grad_is_parallel, ctx.group = output_grad_is_parallel, group
        return _gather_first_dim(x, group)

    @staticmethod
    def backward(ctx, g):
        # Consumers of the gathered tensor that are tensor-parallel (a column-parallel matmul)
        # leave each rank a partial gradient: sum and keep our slice. A replicated consumer
        # leaves every rank the full gradient: just keep our slice.
        if ctx.output_grad_is_parallel:
            return _reduce_scatter_first_dim(g, ctx.group), None, None
        return _split_first_dim(g, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_first_dim(g, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over the group backward."""
    return x if _size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce over the group forward; identity backward."""
    return x if _size(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's slice of the last dim forward; all-gather the gradient backward."""
    return x if _size(group) == 1 else _ScatterToRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather along the last dim forward; keep this rank's slice of the gradient backward."""
    return x if _size(group) == 1 else _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's slice of the sequence (dim 0) forward; all-gather backward."""
    return x if _size(group) == 1 else _ScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, output_grad_is_parallel: bool = True,
                                         group=None) -> torch.Tensor:
    """All-gather the sequence (dim 0) forward; reduce-scatter (or split) the gradient backward."""
    return x if _size(group) == 1 else _GatherFromSequenceRegion.apply(x, output_grad_is_parallel, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over the group and keep this rank's slice of the sequence forward; all-gather backward."""
    return x if _size(group) == 1 else _ReduceScatterToSequenceRegion.apply(x, group)
