"""Autograd-aware collectives over the tensor-parallel group.

Each pair is a forward collective whose backward is its conjugate:
copy <-> all-reduce, scatter (split) <-> all-gather, and for sequence parallelism
all-gather along the sequence <-> reduce-scatter along the sequence.
Tensors are laid out [sequence, batch, hidden], so the sequence is dim 0.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel import state

# torch >= 2.12 renamed the single-tensor collectives; keep working on older releases (the one
# place that knows: optim.buffers uses these too).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _tp_size() -> int:
    return state.get_tensor_model_parallel_world_size()


def _tp():
    return state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_group()


def _split_last_dim(x: torch.Tensor) -> torch.Tensor:
    size, _ = _tp()
    if size == 1:
        return x
    return x.chunk(size, dim=-1)[state.get_tensor_model_parallel_rank()].contiguous()


def _gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    size, group = _tp()
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def _reduce(x: torch.Tensor) -> torch.Tensor:
    size, group = _tp()
    if size == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_first_dim(x: torch.Tensor) -> torch.Tensor:
    size, _ = _tp()
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(f"sequence length ({x.shape[0]}) is not divisible by the TP size ({size})")
    return x.chunk(size, dim=0)[state.get_tensor_model_parallel_rank()].contiguous()


def _gather_first_dim(x: torch.Tensor) -> torch.Tensor:
    size, group = _tp()
    if size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((x.shape[0] * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(out, x, group=group)
    return out


def _reduce_scatter_first_dim(x: torch.Tensor) -> torch.Tensor:
    size, group = _tp()
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(f"sequence length ({x.shape[0]}) is not divisible by the TP size ({size})")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, x, group=group)
    return out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return _reduce(g)


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        size, group = _tp()
        if size == 1:
            return x
        if not x.is_contiguous():
            return _reduce(x)
        # Sum in place: x is a fresh matmul output nobody else holds, so no copy is needed.
        ctx.mark_dirty(x)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_last_dim(x)

    @staticmethod
    def backward(ctx, g):
        return _gather_last_dim(g)


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _gather_last_dim(x)

    @staticmethod
    def backward(ctx, g):
        return _split_last_dim(g)


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_first_dim(x)

    @staticmethod
    def backward(ctx, g):
        return _gather_first_dim(g)


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_grad_is_parallel):
        ctx.output_grad_is_parallel = output_grad_is_parallel
        return _gather_first_dim(x)

    @staticmethod
    def backward(ctx, g):
        # Consumers of the gathered tensor that are tensor-parallel (a column-parallel matmul)
        # leave each rank a partial gradient: sum and keep our slice. A replicated consumer
        # leaves every rank the full gradient: just keep our slice.
        if ctx.output_grad_is_parallel:
            return _reduce_scatter_first_dim(g), None
        return _split_first_dim(g), None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _reduce_scatter_first_dim(x)

    @staticmethod
    def backward(ctx, g):
        return _gather_first_dim(g)


def copy_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over TP backward."""
    if _tp_size() == 1:  # one TP rank: every collective is the identity; no autograd node
        return x
    return _CopyToRegion.apply(x)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """All-reduce over TP forward; identity backward."""
    if _tp_size() == 1:  # one TP rank: every collective is the identity; no autograd node
        return x
    return _ReduceFromRegion.apply(x)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Keep this rank's slice of the last dim forward; all-gather the gradient backward."""
    if _tp_size() == 1:  # one TP rank: every collective is the identity; no autograd node
        return x
    return _ScatterToRegion.apply(x)


def gather_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """All-gather along the last dim forward; keep this rank's slice of the gradient backward."""
    if _tp_size() == 1:  # one TP rank: every collective is the identity; no autograd node
        return x
    return _GatherFromRegion.apply(x)


def scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Keep this rank's slice of the sequence (dim 0) forward; all-gather backward."""
    if _tp_size() == 1:  # one TP rank: every collective is the identity; no autograd node
        return x
    return _ScatterToSequenceRegion.apply(x)


def gather_from_sequence_parallel_region(x: torch.Tensor, output_grad_is_parallel: bool = True) -> torch.Tensor:
    """All-gather the sequence (dim 0) forward; reduce-scatter (or split) the gradient backward."""
    if _tp_size() == 1:  # one TP rank: every collective is the identity; no autograd node
        return x
    return _GatherFromSequenceRegion.apply(x, output_grad_is_parallel)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Sum over TP and keep this rank's slice of the sequence forward; all-gather backward."""
    if _tp_size() == 1:  # one TP rank: every collective is the identity; no autograd node
        return x
    return _ReduceScatterToSequenceRegion.apply(x)
