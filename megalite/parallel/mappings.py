"""Autograd-aware collectives over a process group: the tensor-parallel group unless `group=` names
another (context- or expert-parallel code reuses them over its own ranks).

Each pair is a forward collective whose backward is its conjugate:
copy <-> all-reduce, scatter (split) <-> all-gather, and for sequence parallelism
all-gather along the sequence <-> reduce-scatter along the sequence.
Tensors are laid out [sequence, batch, hidden], so the sequence is dim 0. Over a group of one rank
every collective is the identity and adds no autograd node.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megalite.parallel import lanes, state, traffic
# the single-tensor all-gather and reduce-scatter (optim.buffers uses them too); on gloo the
# reduce-scatter sends each chunk to its owner, half the bytes of gloo's own
from megalite.parallel.collectives import all_gather_single, reduce_scatter_single


def _size(group) -> int:
    return state.get_tensor_model_parallel_world_size() if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return state.get_tensor_model_parallel_rank() if group is None else dist.get_rank(group)


def _group(group):
    return state.get_tensor_model_parallel_group() if group is None else group


def _kind(group, tp_kind: str) -> str:
    """The traffic kind of a collective over `group`: "cp" over the context-parallel group, "ep" over the
    expert ETP x EP group, else
    `tp_kind` ("tp" for the last-dim and all-reduce regions, "sp" for the sequence ones)."""
    if group is not None and state.model_parallel_is_initialized():
        if group is state.get_context_parallel_group():
            return "cp"
        if group is state.get_expert_tensor_and_model_parallel_group():  # the all-gather dispatcher
            return "ep"
    return tp_kind


def _count(record, group, tp_kind: str, nbytes: int, size: int) -> None:
    """Count a collective's bytes (megalite.parallel.traffic), outside torch.compile only: a counter
    call traced into a compiled layer would break its graph, so --torch-compile's layers go uncounted."""
    if not torch.compiler.is_compiling():
        record(_kind(group, tp_kind), nbytes, size)


def count_sequence_collective(group, whole_nbytes: int) -> None:
    """Count an all-gather or reduce-scatter along the sequence whose whole tensor (gathered output,
    scattered input) holds `whole_nbytes`: as one collective, whether it runs as one or as the ring of
    sends --tp-comm-overlap pipelines with the GEMMs (megalite.parallel.tp_overlap)."""
    _count(traffic.gather_or_scatter, group, "sp", whole_nbytes, _size(group))


def _split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    return x.chunk(_size(group), dim=-1)[_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    _count(traffic.gather_or_scatter, group, "tp", x.nbytes * len(parts), len(parts))
    lanes.collective(dist.all_gather, parts, x, group=_group(group), kind=_kind(group, "tp"))
    return torch.cat(parts, dim=-1)


def _reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    _count(traffic.all_reduce, group, "tp", x.nbytes, _size(group))
    lanes.collective(dist.all_reduce, x, group=_group(group), kind=_kind(group, "tp"))
    return x


def _check_sequence_splits(x: torch.Tensor, group) -> int:
    """The group size, after checking that the sequence (dim 0) splits evenly over it."""
    size = _size(group)
    if x.shape[0] % size:
        raise ValueError(f"sequence length ({x.shape[0]}) is not divisible by the group size ({size})")
    return size


def _split_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    return x.chunk(_check_sequence_splits(x, group), dim=0)[_rank(group)].contiguous()


def _gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((x.shape[0] * _size(group), *x.shape[1:]), dtype=x.dtype, device=x.device)
    count_sequence_collective(group, out.nbytes)
    lanes.collective(all_gather_single, out, x, group=_group(group), kind=_kind(group, "sp"))
    return out


def _reduce_scatter_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = _check_sequence_splits(x, group)
    x = x.contiguous()
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    count_sequence_collective(group, x.nbytes)
    lanes.collective(reduce_scatter_single, out, x, group=_group(group), kind=_kind(group, "sp"))
    return out


def _identity(x: torch.Tensor, group) -> torch.Tensor:
    return x


def _region(name: str, forward, backward) -> type[torch.autograd.Function]:
    """An autograd Function that runs `forward(x, group)` on its input and `backward(grad, group)`
    on the gradient, over the group passed to `apply(x, group)`."""

    def run_forward(ctx, x, group):
        ctx.group = group
        # No gradient (every TP rank alike: a zero-bubble B leaving a weight's to W): no collective.
        ctx.set_materialize_grads(False)
        return forward(x, group)

    def run_backward(ctx, grad):
        return (None if grad is None else backward(grad, ctx.group)), None

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(run_forward), "backward": staticmethod(run_backward)})


class _ReduceFromRegion(torch.autograd.Function):
    """All-reduce forward (in place when it can be), identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        if not x.is_contiguous():
            return _reduce(x, group)
        # Sum in place: x is a fresh matmul output nobody else holds, so no copy is needed.
        ctx.mark_dirty(x)
        _count(traffic.all_reduce, group, "tp", x.nbytes, _size(group))
        lanes.collective(dist.all_reduce, x, group=_group(group), kind=_kind(group, "tp"))
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


# The regions: forward collective, and the conjugate collective on the gradient backward.
_CopyToRegion = _region("_CopyToRegion", _identity, _reduce)
_ScatterToRegion = _region("_ScatterToRegion", _split_last_dim, _gather_last_dim)
_GatherFromRegion = _region("_GatherFromRegion", _gather_last_dim, _split_last_dim)
_ScatterToSequenceRegion = _region("_ScatterToSequenceRegion", _split_first_dim, _gather_first_dim)
_ReduceScatterToSequenceRegion = _region("_ReduceScatterToSequenceRegion", _reduce_scatter_first_dim,
                                         _gather_first_dim)
# Consumers of the gathered sequence that are tensor-parallel (a column-parallel matmul) leave each
# rank a partial gradient: sum and keep our slice. A replicated consumer leaves every rank the full
# gradient: just keep our slice.
_GatherFromSequenceRegion = _region("_GatherFromSequenceRegion", _gather_first_dim, _reduce_scatter_first_dim)
_GatherFromSequenceRegionFullGrad = _region("_GatherFromSequenceRegionFullGrad", _gather_first_dim,
                                            _split_first_dim)
# A statistic every rank's output depends on (a norm over all heads): summed both ways, on a copy
# (the input, or the gradient, may be read elsewhere).
_SumRegion = _region("_SumRegion", lambda x, group: _reduce(x.clone(), group),
                     lambda g, group: _reduce(g.clone(), group))


def _apply(region: type[torch.autograd.Function], x: torch.Tensor, group) -> torch.Tensor:
    # Over one rank every collective is the identity: no autograd node, no communication.
    return x if _size(group) == 1 else region.apply(x, group)


def _collective(name: str, region: type[torch.autograd.Function], doc: str):
    """The public collective `name(x, group=None)`: `region` over `group` (default: the TP group)."""

    def collective(x: torch.Tensor, group=None) -> torch.Tensor:
        return _apply(region, x, group)

    collective.__name__ = collective.__qualname__ = name
    collective.__doc__ = doc
    return collective


copy_to_tensor_model_parallel_region = _collective(
    "copy_to_tensor_model_parallel_region", _CopyToRegion,
    "Identity forward; all-reduce of the gradient over the group backward.")
reduce_from_tensor_model_parallel_region = _collective(
    "reduce_from_tensor_model_parallel_region", _ReduceFromRegion,
    "All-reduce over the group forward; identity backward.")
sum_over_tensor_model_parallel_region = _collective(
    "sum_over_tensor_model_parallel_region", _SumRegion,
    "All-reduce over the group forward, and of the gradient backward (every rank's result feeds "
    "every rank's output).")
scatter_to_tensor_model_parallel_region = _collective(
    "scatter_to_tensor_model_parallel_region", _ScatterToRegion,
    "Keep this rank's slice of the last dim forward; all-gather the gradient backward.")
gather_from_tensor_model_parallel_region = _collective(
    "gather_from_tensor_model_parallel_region", _GatherFromRegion,
    "All-gather along the last dim forward; keep this rank's slice of the gradient backward.")
scatter_to_sequence_parallel_region = _collective(
    "scatter_to_sequence_parallel_region", _ScatterToSequenceRegion,
    "Keep this rank's slice of the sequence (dim 0) forward; all-gather backward.")
reduce_scatter_to_sequence_parallel_region = _collective(
    "reduce_scatter_to_sequence_parallel_region", _ReduceScatterToSequenceRegion,
    "Sum over the group and keep this rank's slice of the sequence forward; all-gather backward.")


def gather_from_sequence_parallel_region(x: torch.Tensor, output_grad_is_parallel: bool = True,
                                         group=None) -> torch.Tensor:
    """All-gather the sequence (dim 0) forward; backward, reduce-scatter the gradient when the
    consumers are tensor-parallel (`output_grad_is_parallel`), else keep this rank's slice of it."""
    region = _GatherFromSequenceRegion if output_grad_is_parallel else _GatherFromSequenceRegionFullGrad
    return _apply(region, x, group)


# -- expert parallelism: exchanges whose sizes vary by rank (megalite.models.moe) ----------------
def _count_ep(nbytes_sent: int) -> None:
    if not torch.compiler.is_compiling():
        traffic.record("ep", nbytes_sent)


def _rows_exchange(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group):
    """(the all-to-all's arguments, its receiving buffer) for rows of `x` sent to each rank of `group`
    (input_splits[r] rows to rank r, in rank order) and received from each (output_splits[r]).
    Bytes counted: the rows that leave this rank."""
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    row = x.element_size() * math.prod(x.shape[1:])
    _count_ep(row * (sum(input_splits) - input_splits[dist.get_rank(group)]))
    kwargs = dict(output_split_sizes=list(output_splits), input_split_sizes=list(input_splits), group=group, kind="ep")
    return (dist.all_to_all_single, out, x), kwargs, out


def _all_to_all_rows(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    args, kwargs, out = _rows_exchange(x, output_splits, input_splits, group)
    lanes.collective(*args, **kwargs)
    return out


def post_rows(x: torch.Tensor, group, output_splits: list[int], input_splits: list[int]):
    """`_all_to_all_rows` posted to the lane's queue (`lanes.post`): the receiving buffer, filled once
    the returned post is waited for."""
    args, kwargs, out = _rows_exchange(x, output_splits, input_splits, group)
    return out, lanes.post(*args, **kwargs)


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        return _all_to_all_rows(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all_rows(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all_rows(x: torch.Tensor, group, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    """All-to-all of rows with sizes that vary by rank (experts receive what the router sends them,
    zero rows included); backward sends the gradients back the same way. Identity over one rank."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllToAllRows.apply(x, group, list(output_splits), list(input_splits))


def _gather_rows_v(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Every rank's rows, rank order (sizes[r] rows from rank r): an all-gather over rows padded to the
    largest count, the padding dropped."""
    longest = max(sizes)
    if longest == 0:  # nobody has a row (every rank knows the sizes): nothing to exchange
        return x
    padded = x.new_zeros((longest, *x.shape[1:]))
    padded[:x.shape[0]] = x
    out = x.new_empty((longest * len(sizes), *x.shape[1:]))
    _count_ep(padded.nbytes * (len(sizes) - 1))
    lanes.collective(all_gather_single, out, padded, group=group, kind="ep")
    return torch.cat([out[r * longest:r * longest + n] for r, n in enumerate(sizes)])


def _reduce_scatter_rows_v(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """The inverse of `_gather_rows_v` for gradients: each rank's rows summed over the group."""
    longest, me = max(sizes), dist.get_rank(group)
    if longest == 0:
        return x
    padded = x.new_zeros((longest * len(sizes), *x.shape[1:]))
    for r, part in enumerate(x.split(sizes)):
        padded[r * longest:r * longest + sizes[r]] = part
    out = x.new_empty((longest, *x.shape[1:]))
    _count_ep(out.nbytes * (len(sizes) - 1))
    lanes.collective(reduce_scatter_single, out, padded, group=group, kind="ep")
    return out[:sizes[me]]


class _GatherRowsV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _gather_rows_v(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows_v(grad, ctx.sizes, ctx.group), None, None


class _ReduceScatterRowsV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _reduce_scatter_rows_v(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows_v(grad.contiguous(), ctx.sizes, ctx.group), None, None


def gather_rows_v(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """All-gather of rows whose count differs by rank (`sizes`, rank order); backward: each rank's
    rows' gradients summed over the group. Identity over one rank."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherRowsV.apply(x, group, list(sizes))


def reduce_scatter_rows_v(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Rows laid out as `gather_rows_v` returns them, summed over the group; this rank keeps its own
    (sizes[rank] rows). Backward: the all-gather. Identity over one rank."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _ReduceScatterRowsV.apply(x, group, list(sizes))
