"""Learning-rate schedule: linear warm-up, then cosine, linear, constant, inverse-square-root or WSD
(warm-up, stable, decay) decay to min_lr.

Warm-up: step i (0-based) of W warm-up steps trains at lr * (i + 1) / W (from --lr-warmup-init I:
I + (lr - I) * (i + 1) / W), so the first step
already moves the weights (lr / W) and step W - 1 reaches lr; with the 1-based iteration numbers
of the log, iteration k trains at lr * k / W. This is one step ahead of Megatron-LM's
lr * i / W, whose first step runs at lr 0 and so only spends a batch (and, for Adam, feeds the
moment estimates a gradient that never moves a weight). Decay starts after the warm-up, at lr,
so lr is held for two steps (W - 1 and W) where the two phases meet.

Lengths may be fractional (a schedule given in samples, divided by the global batch). The decay
shapes are Megatron-LM's: inverse-square-root is lr * sqrt(W / i) (floored at min_lr); WSD holds lr
until the last D steps of the decay length, then falls to min_lr over them with q from 0 to 1 as
exponential 2 * 0.5**q - 1, linear 1 - q, cosine (1 + cos(pi q)) / 2 or minus_sqrt 1 - sqrt(q).

Weight decay (`WeightDecaySchedule`, Megatron-LM's --weight-decay-incr-style): step i of a run of T
steps decays with start + c (end - start), c = i / T (linear) or (1 - cos(pi i / T)) / 2 (cosine),
Megatron-LM's own step count: its first step decays with the start value.
"""
from __future__ import annotations

import math


_STYLES = ("cosine", "linear", "constant", "inverse-square-root", "WSD")
_WSD_SHAPES = {
    "exponential": lambda q: 2.0 * 0.5 ** q - 1.0,
    "linear": lambda q: 1.0 - q,
    "cosine": lambda q: 0.5 * (1.0 + math.cos(math.pi * q)),
    "minus_sqrt": lambda q: 1.0 - math.sqrt(q),
}


class LRSchedule:
    def __init__(self, lr: float, min_lr: float = 0.0, warmup_iters: float = 0, decay_iters: float = 0,
                 style: str = "cosine", wsd_decay_iters: float | None = None, wsd_style: str = "exponential",
                 warmup_init: float = 0.0):
        if style not in _STYLES:
            raise ValueError(f"lr decay style must be one of {', '.join(_STYLES)}, got {style!r}")
        if min_lr > lr:
            raise ValueError(f"min_lr ({min_lr}) is larger than lr ({lr})")
        if style == "WSD" and (wsd_decay_iters is None or wsd_style not in _WSD_SHAPES):
            raise ValueError(f"WSD needs the length of its decay and a shape among {', '.join(_WSD_SHAPES)}")
        self.lr, self.min_lr, self.warmup, self.decay, self.style = lr, min_lr, warmup_iters, decay_iters, style
        self.wsd_decay, self.wsd_shape = wsd_decay_iters, _WSD_SHAPES.get(wsd_style)
        self.warmup_init = warmup_init

    def __call__(self, iteration: int) -> float:
        """LR for step `iteration` (0-based)."""
        if self.warmup and iteration < self.warmup:  # a fractional warm-up (in samples) ends inside a step
            if not self.warmup_init:
                return min(self.lr, self.lr * (iteration + 1) / self.warmup)
            return self.warmup_init + (self.lr - self.warmup_init) * min(1.0, (iteration + 1) / self.warmup)
        if self.style == "inverse-square-root":
            return max(self.min_lr, self.lr * math.sqrt(max(self.warmup, 1) / max(iteration, 1)))
        if self.style == "constant" or self.decay <= self.warmup:
            return self.lr
        if self.style == "WSD":
            anneal_start = self.decay - self.wsd_decay
            if iteration <= anneal_start:
                return self.lr
            coeff = self.wsd_shape(min(1.0, (iteration - anneal_start) / self.wsd_decay))
            return self.min_lr + coeff * (self.lr - self.min_lr)
        frac = min(1.0, (iteration - self.warmup) / (self.decay - self.warmup))
        if self.style == "linear":
            coeff = 1.0 - frac
        else:
            coeff = 0.5 * (1.0 + math.cos(math.pi * frac))
        return self.min_lr + coeff * (self.lr - self.min_lr)


class WeightDecaySchedule:
    """The weight decay of step `at` (0-based; fractional with a batch ramp: samples seen / global batch)
    of a run of `steps` steps, from `start` to `end` (Megatron-LM's linear and cosine increments)."""

    def __init__(self, start: float, end: float, style: str, steps: float):
        if style not in ("linear", "cosine"):
            raise ValueError(f"weight decay increment style must be linear or cosine, got {style!r}")
        self.start, self.end, self.style, self.steps = start, end, style, steps

    def __call__(self, at: float) -> float:
        ratio = min(1.0, max(0.0, at / self.steps)) if self.steps > 0 else 1.0
        coeff = ratio if self.style == "linear" else 0.5 * (1.0 - math.cos(math.pi * ratio))
        return self.start + coeff * (self.end - self.start)
