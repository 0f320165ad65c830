"""--moe-router-force-load-balancing (Megatron-LM's flag, for benchmarking): the router's logits
replaced by independent standard-normal values per token and expert, so every expert receives an
even share of the tokens in expectation whatever the router has learned; the gradient goes
straight through to the router's own logits, as if they had been used.

Megatron-LM draws the values from a generator per rank. megalite draws them from each token itself
instead: a hash of the signs of its router input's elements. So a token is routed the same way on
whichever rank holds it and in a recomputed forward, and layouts whose router inputs differ in the
last bits (a tensor-parallel sum in another order) route alike unless one of a token's elements
lies within that rounding of zero: then the two part, as a router's own scores part at a tie (seen
once in 3 steps at TP 2 x EP 2; EP, PP, CP and TP alone trained to the one-device losses). The
signs of the hidden size's elements tell tokens apart; tokens with the same signs everywhere get
the same logits.

The hash works on integers below the Mersenne prime 2^31 - 1, so every product fits in int64 on
every device: a key per token (its signs times fixed coefficients, summed, mod p), then per expert
three rounds of multiply-add mod p and a fold of the high bits; the result mapped to (0, 1) and
through the normal distribution's inverse CDF."""
from __future__ import annotations

import torch

_P = 2 ** 31 - 1
_ROUNDS = ((1_103_515_245, 12_345), (2_147_483_629, 7_777_777), (1_664_525, 1_013_904_223))
_fixed: dict[tuple, torch.Tensor] = {}  # the hash's constants, drawn once (the same on every rank and run)


def _constants(kind: str, n: int, low: int, seed: int, device: torch.device) -> torch.Tensor:
    key = (kind, n, str(device))
    if key not in _fixed:
        g = torch.Generator().manual_seed(seed)
        _fixed[key] = torch.randint(low, _P, (n,), generator=g, dtype=torch.int64).to(device)
    return _fixed[key]


def hashed_logits(tokens: torch.Tensor, experts: int) -> torch.Tensor:
    """[T, experts] fp32 standard-normal values, each a function of its token's signs (`tokens`
    [T, hidden]; an element >= 0, -0.0 included, counts as positive) and the expert alone."""
    signs = (tokens.detach() >= 0).to(torch.int64)
    key = (signs * _constants("coefficients", tokens.shape[-1], 1, 0x6D6C, tokens.device)).sum(-1) % _P
    x = key[:, None] ^ _constants("salts", experts, 0, 0x6578, tokens.device)[None, :]
    for a, b in _ROUNDS:
        x = (x * a + b) % _P
        x = x ^ (x >> 16)
    uniform = ((x % _P).double() + 0.5) / _P
    return torch.special.ndtri(uniform).float()


class _Balanced(torch.autograd.Function):
    """Forward: `hashed_logits` of the tokens, NaN where the router's own row is not finite (so a
    broken router still stops training, moe/stats.py); backward: the incoming gradient to `logits`,
    unchanged."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        out = hashed_logits(tokens, logits.shape[-1])
        return out.masked_fill(~torch.isfinite(logits).all(-1, keepdim=True), float("nan"))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def force_balanced(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The logits routing uses under --moe-router-force-load-balancing (see the module docstring)."""
    return _Balanced.apply(logits, tokens)
