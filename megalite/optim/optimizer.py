"""AdamW with the usual parameter groups: no weight decay on biases and norm weights."""
from __future__ import annotations

import torch


def param_groups(model_chunks, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if not p.requires_grad:
                continue
            # 1-D parameters are biases and norm weights; embeddings and matrices decay.
            (no_decay if p.ndim == 1 else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_adamw(model_chunks, lr: float, weight_decay: float = 0.01, betas=(0.9, 0.95),
                eps: float = 1e-8) -> torch.optim.Optimizer:
    params = [p for c in model_chunks for p in c.parameters()]
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(param_groups(model_chunks, weight_decay), lr=lr, betas=betas, eps=eps,
                             fused=fused or None, foreach=None if fused else True)
