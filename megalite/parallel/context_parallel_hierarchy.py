"""Hierarchical context parallelism (Megatron-LM's --cp-comm-type a2a+p2p with
--hierarchical-context-parallel-sizes A P): the CP group of A x P ranks split into inner groups of A
consecutive CP ranks, which trade the sequence for heads by all-to-all (fast links, e.g. one node),
and outer groups of the P ranks that hold the same heads, which pass keys and values around a ring
(the slow links carry K/V blocks only, not activations of every head).

Why the ring needs no change: CP rank i holds chunks i and 2N-1-i of the sequence (N = A x P). After
the all-to-all inside inner group o, a rank holds, for its A-th of the heads, chunks o A ... o A + A - 1
and their mirrors: super-chunks o and 2P-1-o of the sequence cut into 2P, the ring's own
load-balanced layout at size P once the gathered tokens are put in position order. So the ring runs
over the outer group as it runs over a whole CP group, documents, windows and sinks included."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.parallel import lanes, state, traffic
from megalite.parallel.context_parallel import _check_shapes, ring_attention
from megalite.parallel.context_parallel_a2a import _AllToAll


@dataclass(frozen=True)
class Hierarchy:
    inner_group: object
    inner_ranks: tuple[int, ...]  # global ranks, inner rank 0 first: the all-to-all
    outer_group: object
    outer_ranks: tuple[int, ...]  # global ranks, outer rank 0 first: the ring
    cp_ranks: tuple[int, ...] = ()  # the CP group it splits (a later layout's groups are other ones)

    @property
    def inner_rank(self) -> int:
        return self.inner_ranks.index(dist.get_rank())


_HIERARCHY: dict[int, Hierarchy] = {}  # by the inner size (one layout a process, rebuilt per group set)


def initialize_hierarchy(inner: int, timeout=None) -> Hierarchy | None:
    """Build the inner and outer groups of every CP group (collective: every rank, the same order),
    after `state.initialize_model_parallel`. `inner` must divide the CP size; returns this rank's."""
    s = state._state()
    cp = state.get_context_parallel_world_size()
    if cp % inner:
        raise ValueError(f"the all-to-all size {inner} does not divide --cp {cp}")
    _HIERARCHY.clear()
    if s is None:  # one process: nothing to split
        return None
    mine = None
    for ranks in state.rank_groups(s.sizes, ("context",)):
        outer = len(ranks) // inner
        for o in range(outer):
            inner_ranks = ranks[o * inner:(o + 1) * inner]
            group = state.built_group("context_inner", inner_ranks, timeout)
            if dist.get_rank() in inner_ranks:
                mine_inner = (group, tuple(inner_ranks))
        for j in range(inner):
            outer_ranks = ranks[j::inner]
            group = state.built_group("context_outer", outer_ranks, timeout)
            if dist.get_rank() in outer_ranks:
                mine_outer = (group, tuple(outer_ranks))
        if dist.get_rank() in ranks:
            mine = Hierarchy(*mine_inner, *mine_outer, tuple(ranks))
    if mine is not None:
        _HIERARCHY[inner] = mine
    return mine


def get_hierarchy(inner: int) -> Hierarchy:
    """This rank's hierarchy of `inner`, for the CP groups in place now."""
    if inner not in _HIERARCHY or _HIERARCHY[inner].cp_ranks != tuple(state.get_context_parallel_ranks()):
        raise RuntimeError(f"hierarchical context parallelism with an all-to-all of {inner} ranks is not set up: "
                           f"call megalite.parallel.context_parallel_hierarchy.initialize_hierarchy({inner}) after "
                           f"initialize_model_parallel")
    return _HIERARCHY[inner]


def position_order(inner: int, local: int, device=None) -> torch.Tensor:
    """Where each token of the ring's layout sits among the tokens the all-to-all gathered (inner rank
    j's `local` tokens, its two chunks, at j * local): the first chunks in inner-rank order, then the
    second chunks in reverse, i.e. in position order within each super-chunk."""
    half = local // 2
    firsts = [torch.arange(j * local, j * local + half, device=device) for j in range(inner)]
    seconds = [torch.arange(j * local + half, (j + 1) * local, device=device) for j in reversed(range(inner))]
    return torch.cat(firsts + seconds)


def _gather_starts(starts: torch.Tensor, h: Hierarchy) -> torch.Tensor:
    """query_starts [b, local] of every rank of the inner group, joined along the sequence."""
    pieces = [torch.empty_like(starts) for _ in h.inner_ranks]
    if not torch.compiler.is_compiling():
        traffic.gather_or_scatter("cp", starts.nbytes * len(pieces), len(pieces))
    lanes.collective(dist.all_gather, pieces, starts.contiguous(), group=h.inner_group, kind="cp", hand_over=False)
    return torch.cat(pieces, dim=1)


def hierarchical_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: Hierarchy, causal: bool = True,
                           softmax_scale: float | None = None, query_starts: torch.Tensor | None = None,
                           document_bounds: torch.Tensor | None = None, window_left: int | None = None,
                           sink: torch.Tensor | None = None) -> torch.Tensor:
    """`ring_attention`'s result (q [b, heads, s_local, d], k and v [b, groups, s_local, d], this
    CP rank's load-balanced share; the same arguments) by an all-to-all over the inner group, a ring
    over the outer group, and the all-to-all back. Heads and KV groups must divide by the inner size."""
    _check_shapes(q, k, v)
    inner = len(h.inner_ranks)
    heads, groups = q.shape[1], k.shape[1]
    if heads % inner or groups % inner:
        raise ValueError(f"--cp-comm-type a2a+p2p splits the heads across the all-to-all's {inner} ranks, but "
                         f"{heads} query heads / {groups} KV groups do not divide by {inner}: choose "
                         f"--hierarchical-context-parallel-sizes whose first size divides both")
    if inner == 1:
        return ring_attention(q, k, v, h.outer_group, h.outer_ranks, causal, softmax_scale, query_starts,
                              document_bounds, window_left, sink)
    order = position_order(inner, q.shape[2], q.device)
    q, k, v = (_AllToAll.apply(t, 1, 2, h.inner_group).index_select(2, order) for t in (q, k, v))
    if query_starts is not None:
        query_starts = _gather_starts(query_starts, h).index_select(1, order)
    if sink is not None:  # this rank's heads' sinks: the gradient lands in their block of the whole
        sink = sink.chunk(inner)[h.inner_rank]
    out = ring_attention(q, k, v, h.outer_group, h.outer_ranks, causal, softmax_scale, query_starts,
                         document_bounds, window_left, sink)
    return _AllToAll.apply(out.index_select(2, torch.argsort(order)), 2, 1, h.inner_group)
