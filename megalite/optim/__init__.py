"""Optimizer, learning-rate schedule and gradient reduction / clipping across the 3D layout."""
from megalite.optim.grads import (
    allreduce_embedding_grads,
    allreduce_sequence_parallel_grads,
    clip_grads,
    global_grad_norm,
)
from megalite.optim.lr import LRSchedule
from megalite.optim.optimizer import build_adamw, param_groups

__all__ = [
    "LRSchedule", "allreduce_embedding_grads", "allreduce_sequence_parallel_grads", "build_adamw",
    "clip_grads", "global_grad_norm", "param_groups",
]
