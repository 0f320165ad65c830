"""Gradient bookkeeping across the 3D layout: reductions every rank must do after backward,
and the global gradient norm counting every parameter exactly once."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel import state


def allreduce_sequence_parallel_grads(params) -> None:
    """Parameters replicated over TP but applied to a sequence shard (LayerNorm, row bias under
    sequence parallelism) hold partial gradients: sum them over TP."""
    if state.get_tensor_model_parallel_world_size() == 1:
        return
    grads = [p.grad for p in params if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if grads:
        _allreduce_coalesced(grads, state.get_tensor_model_parallel_group())


def allreduce_embedding_grads(model_chunks) -> None:
    """Tied word embeddings live on the first and the last pipeline stage: sum their gradients."""
    if state.get_pipeline_model_parallel_world_size() == 1:
        return
    group = state.get_embedding_group()
    if group is None:
        return
    for chunk in model_chunks:
        emb = getattr(chunk, "word_embeddings", None)
        if emb is not None and emb.weight.grad is not None:
            dist.all_reduce(emb.weight.grad, group=group)


def _allreduce_coalesced(grads, group) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def counts_once(p: torch.nn.Parameter) -> bool:
    """Whether this rank counts `p` in global norms: TP-sharded parameters on every TP rank,
    replicated ones on TP rank 0 only, the last stage's copy of a tied embedding never."""
    if getattr(p, "shared_embedding", False):
        return False
    return getattr(p, "tensor_model_parallel", False) or state.get_tensor_model_parallel_rank() == 0


def global_grad_norm(params) -> torch.Tensor:
    """L2 norm of the full model's gradient (identical on every rank; DP replicas agree after
    reduction, so the sum runs over TP x PP only)."""
    grads = [p.grad for p in params if p.grad is not None and counts_once(p)]
    device = grads[0].device if grads else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sq = torch.zeros(1, dtype=torch.float32, device=device)
    if grads:
        sq += torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sq, group=state.get_model_parallel_group())
    return sq.sqrt()[0]


def clip_grads(params, max_norm: float, norm: torch.Tensor) -> None:
    """Scale gradients so that their global norm is at most max_norm (no host sync)."""
    if max_norm <= 0:
        return
    coeff = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coeff)
