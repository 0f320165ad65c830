"""A step's gradients made final across the 3D layout: `finalize_grads` is the one place the loop
calls after the last backward (tied embeddings over pipeline stages, data-parallel buckets,
sequence-parallel sums over TP); `counts_once` says which rank counts a parameter in global norms."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel import state, traffic


# `finalize_grads`'s embedding group where the first and last stage are two chunks of one rank (a V).
SAME_RANK = "same-rank"


def finalize_grads(buffers, embedding_group=None) -> None:
    """After a step's last backward: the tied word embedding's gradient summed over the first and
    last pipeline stage (`embedding_group`; `SAME_RANK` when they are chunks 0 and 1 of this rank;
    None when one stage holds both), every buffer's
    data-parallel reduction finished, then the sequence-parallel gradients summed over TP. At ZeRO
    stages 0-1 the stages are summed before data parallelism, so that each DP rank reduces the whole
    gradient; at stages 2-3 each backward already reduce-scattered it, and the sums are of this
    rank's shards (the same elements on every stage and TP rank: the layouts are the same)."""
    if embedding_group == SAME_RANK:
        _sum_chunk_copies(buffers)
    for buf in buffers:
        if embedding_group not in (None, SAME_RANK):
            for grad in buf.deferred_grads():
                traffic.counted_all_reduce("embedding", grad, embedding_group)
        buf.finish_grad_sync()
    if state.get_tensor_model_parallel_world_size() == 1:  # nothing is partial over TP
        return
    kinds: list[str] = []  # grads_of calls keep(p) once for each gradient it returns, in order

    def keep(p) -> bool:
        partial = is_partial_over_tp(p)
        if partial:
            kinds.append(_tp_sum_kind(p))
        return partial
    _sum_over_tp([g for buf in buffers for g in buf.grads_of(keep)], kinds)


def _sum_chunk_copies(buffers) -> None:
    """The V's tied copies: chunk 0's deferred gradients (the word embedding) and chunk 1's (the
    output layer's, multi-token prediction's), pair by pair in the order the all-reduce over two
    stages would meet them, each set to the sum (a + b: the same bits as that all-reduce)."""
    first = [g for buf in buffers if buf.chunk_index == 0 for g in buf.deferred_grads()]
    last = [g for buf in buffers if buf.chunk_index == 1 for g in buf.deferred_grads()]
    if len(first) != len(last) or any(a.shape != b.shape for a, b in zip(first, last)):
        raise RuntimeError(f"the tied embedding's copies differ between the V's chunks: "
                           f"{[tuple(g.shape) for g in first]} and {[tuple(g.shape) for g in last]}")
    for a, b in zip(first, last):
        total = a + b
        a.copy_(total)
        b.copy_(total)


def allreduce_sequence_parallel_grads(params) -> None:
    """Parameters replicated over TP but applied to a sequence shard (LayerNorm, row bias under
    sequence parallelism), or to this rank's heads only (`partial_over_tp`: qk-norm weights), hold
    partial gradients: sum them over TP (in `main_grad`)."""
    partial = [p for p in params if is_partial_over_tp(p)]
    _sum_over_tp([p.main_grad for p in partial], [_tp_sum_kind(p) for p in partial])


def _tp_sum_kind(p) -> str:
    """Traffic kind of summing `p`'s gradient over TP: "sp" where sequence parallelism made it
    partial (norms, row biases), "tp" where each rank holds some heads (qk-norm weights)."""
    return "sp" if getattr(p, "sequence_parallel", False) else "tp"


def _sum_over_tp(grads: list[torch.Tensor], kinds: list[str]) -> None:
    tp = state.get_tensor_model_parallel_world_size()
    if tp == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    for kind in set(kinds):  # one all-reduce; its volume shared out by kind
        traffic.all_reduce(kind, sum(g.nbytes for g, k in zip(grads, kinds) if k == kind), tp)
    dist.all_reduce(flat, group=state.get_tensor_model_parallel_group())
    torch._foreach_copy_(grads, [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in grads]), grads)])


def is_partial_over_tp(p: torch.nn.Parameter) -> bool:
    """Whether each TP rank holds only part of `p`'s gradient, to be summed over TP."""
    return getattr(p, "sequence_parallel", False) or getattr(p, "partial_over_tp", False)


def counts_once(p: torch.nn.Parameter) -> bool:
    """Whether this rank counts `p` in global norms: TP-sharded parameters on every TP rank,
    replicated ones on TP rank 0 only, the last stage's copy of a tied embedding never."""
    if getattr(p, "shared_embedding", False):
        return False
    if is_expert(p):  # a distinct shard on every ETP x EP rank (norms sum them over that grid)
        return True
    return getattr(p, "tensor_model_parallel", False) or state.get_tensor_model_parallel_rank() == 0


def is_expert(p: torch.nn.Parameter) -> bool:
    """An expert's weight: sharded over the expert grid (EP x ETP), reduced over expert data parallelism."""
    return getattr(p, "expert_parallel", False)
