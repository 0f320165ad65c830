"""Learning-rate schedule: linear warm-up, then cosine, linear or constant decay to min_lr.

Warm-up: step i (0-based) of W warm-up steps trains at lr * (i + 1) / W, so the first step
already moves the weights (lr / W) and step W - 1 reaches lr; with the 1-based iteration numbers
of the log, iteration k trains at lr * k / W. This is one step ahead of Megatron-LM's
lr * i / W, whose first step runs at lr 0 and so only spends a batch (and, for Adam, feeds the
moment estimates a gradient that never moves a weight). Decay starts after the warm-up, at lr,
so lr is held for two steps (W - 1 and W) where the two phases meet.
"""
from __future__ import annotations

import math


class LRSchedule:
    def __init__(self, lr: float, min_lr: float = 0.0, warmup_iters: int = 0, decay_iters: int = 0,
                 style: str = "cosine"):
        if style not in ("cosine", "linear", "constant"):
            raise ValueError(f"lr decay style must be cosine, linear or constant, got {style!r}")
        if min_lr > lr:
            raise ValueError(f"min_lr ({min_lr}) is larger than lr ({lr})")
        self.lr, self.min_lr, self.warmup, self.decay, self.style = lr, min_lr, warmup_iters, decay_iters, style

    def __call__(self, iteration: int) -> float:
        """LR for step `iteration` (0-based)."""
        if self.warmup and iteration < self.warmup:
            return self.lr * (iteration + 1) / self.warmup
        if self.style == "constant" or self.decay <= self.warmup:
            return self.lr
        frac = min(1.0, (iteration - self.warmup) / (self.decay - self.warmup))
        if self.style == "linear":
            coeff = 1.0 - frac
        else:
            coeff = 0.5 * (1.0 + math.cos(math.pi * frac))
        return self.min_lr + coeff * (self.lr - self.min_lr)
