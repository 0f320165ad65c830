"""Context parallelism by all-to-all (DeepSpeed-Ulysses style; --cp-comm-type a2a): the sequence split
traded for a head split, attention over the whole sequence, and the trade undone. The ring's
counterpart, the load-balanced layout both share, is megalite.parallel.context_parallel."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.parallel import lanes, traffic
from megalite.parallel.context_parallel import _check_shapes, _rank_order


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """x split in N pieces along scatter_dim, piece r to CP rank r; the pieces received joined along gather_dim."""
    size = dist.get_world_size(group)
    pieces = [p.contiguous() for p in x.chunk(size, dim=scatter_dim)]
    received = [torch.empty_like(p) for p in pieces]
    if not torch.compiler.is_compiling():  # (a compiled graph's sizes may be symbolic: counted outside)
        traffic.gather_or_scatter("cp", x.nbytes, size)
    lanes.collective(dist.all_to_all, received, pieces, group=group, kind="cp")
    return torch.cat(received, dim=gather_dim)


class _AllToAll(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def a2a_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, ranks, causal: bool = True,
                  softmax_scale: float | None = None, attend=None) -> torch.Tensor:
    """The same result as `ring_attention`, by all-to-all: each rank gets heads / N of the heads (and
    groups / N of the KV groups) for the whole sequence, attends, and sends the results back.
    `attend(q, k, v)`, where given, attends over the whole sequence in its place (in global order:
    documents packed into the sequence, for one)."""
    _check_shapes(q, k, v)
    size = len(ranks)
    heads, groups = q.shape[1], k.shape[1]
    if heads % size or groups % size:
        raise ValueError(f"--cp-comm-type a2a splits the heads across cp = {size} ranks, but {heads} query heads / "
                         f"{groups} KV groups do not divide by {size}: use --cp-comm-type p2p")
    if attend is None:
        def attend(q, k, v):
            return _attend(q, k, v, causal, softmax_scale)
    if size == 1:
        return attend(q, k, v)
    to_global = torch.argsort(_rank_order(q.shape[2] * size, size)).to(q.device)
    whole = [_AllToAll.apply(t, 1, 2, group).index_select(2, to_global) for t in (q, k, v)]
    out = attend(*whole)
    back_to_ranks = torch.argsort(to_global)
    return _AllToAll.apply(out.index_select(2, back_to_ranks), 2, 1, group)


def _attend(q, k, v, causal, softmax_scale):
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale, **gqa)
