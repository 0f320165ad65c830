"""The next token from the last position's logits: greedy (temperature 0), or a draw after
temperature, top-k and top-p (nucleus) filtering, from a seeded generator.

Every rank that samples holds the same whole-vocabulary logits and a generator seeded alike, so the
tensor-parallel ranks of the last stage draw the same token without exchanging it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.determinism import prefix_sums


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int = 0  # 0: every token
    top_p: float = 1.0  # 1: every token
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0 keeps every token), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, device) -> torch.Generator | None:
        return None if self.greedy else torch.Generator(device=device).manual_seed(self.seed)


def filtered(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [b, V] with the tokens outside the top k, and outside the smallest set whose
    probability reaches top_p (the most likely token always stays), set to -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = prefix_sums(probs) - probs  # the probability of the tokens ranked above
        ordered = ordered.masked_fill(before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    return logits


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """[b, V] logits (fp32) -> [b] token ids."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    logits = filtered(logits / sampling.temperature, sampling.top_k, sampling.top_p)
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)
