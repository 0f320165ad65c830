"""Gradient bookkeeping across the 3D layout that is not data-parallel reduction."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel import state


def allreduce_sequence_parallel_grads(params) -> None:
    """Parameters replicated over TP but applied to a sequence shard (LayerNorm, row bias under
    sequence parallelism) hold partial gradients: sum them over TP (in `main_grad`)."""
    if state.get_tensor_model_parallel_world_size() == 1:
        return
    grads = [p.main_grad for p in params if getattr(p, "sequence_parallel", False)]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=state.get_tensor_model_parallel_group())
    torch._foreach_copy_(grads, [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in grads]), grads)])


def counts_once(p: torch.nn.Parameter) -> bool:
    """Whether this rank counts `p` in global norms: TP-sharded parameters on every TP rank,
    replicated ones on TP rank 0 only, the last stage's copy of a tied embedding never."""
    if getattr(p, "shared_embedding", False):
        return False
    return getattr(p, "tensor_model_parallel", False) or state.get_tensor_model_parallel_rank() == 0
