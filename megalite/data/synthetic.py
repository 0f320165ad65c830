"""A deterministic synthetic token stream with learnable structure, for tests and smoke runs.

Sample i depends only on (seed, i): any data-parallel layout sees the same global batches.
Each sequence follows t[k+1] = (a * t[k] + c + noise) mod vocab with noise in {0, 1}, so a model
can learn it and its loss falls.
"""
from __future__ import annotations

import numpy as np
import torch


def _affine_powers(multiplier: int, modulus: int, length: int) -> np.ndarray:
    """multiplier**(k+1) mod modulus for k < length, without overflow (int64 while modulus**2 < 2**63)."""
    powers = np.empty(length, dtype=np.int64)
    value = 1
    for k in range(length):
        value = value * multiplier % modulus
        powers[k] = value
    return powers


def _unroll_affine(increments: np.ndarray, powers: np.ndarray, modulus: int) -> np.ndarray:
    """For x[k+1] = (m * x[k] + increments[..., k]) mod modulus with powers[k] = m**(k+1) mod modulus,
    B with x[k+1] = (powers[k] * x[0] + B[..., k]) mod modulus, by prefix doubling: log2(length)
    vectorised steps instead of one Python step per token."""
    offset = increments % modulus
    shift = 1
    while shift < offset.shape[-1]:
        # Entry k >= shift has composed the `shift` maps ending at k: compose the `shift` before them.
        offset[..., shift:] = (powers[shift - 1] * offset[..., :-shift] + offset[..., shift:]) % modulus
        shift *= 2
    return offset


class SyntheticTokens:
    def __init__(self, vocab_size: int, seq_length: int, seed: int = 0):
        if vocab_size >= 2**31:
            raise ValueError(f"SyntheticTokens supports vocabularies below 2**31, not {vocab_size}")
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed
        self._powers = _affine_powers(7, vocab_size, seq_length)

    def _tokens(self, indices) -> torch.Tensor:
        """[len(indices), seq_length + 1] token ids; each row draws from its own (seed, index) generator."""
        first, noise = [], []
        for index in indices:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + int(index))
            noise.append(torch.randint(0, 2, (self.seq_length,), generator=gen))
            first.append(torch.randint(0, self.vocab_size, (1,), generator=gen))
        first = torch.cat(first).numpy()
        offset = _unroll_affine(torch.stack(noise).numpy() + 3, self._powers, self.vocab_size)
        rest = (self._powers * first[:, None] + offset) % self.vocab_size
        return torch.from_numpy(np.concatenate([first[:, None], rest], axis=1))

    def sample(self, index: int) -> torch.Tensor:
        """seq_length + 1 token ids of sample `index`."""
        return self._tokens([index])[0]

    def batch(self, indices) -> dict[str, torch.Tensor]:
        tokens = self._tokens(list(indices))
        return {
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(len(tokens), self.seq_length),
        }


class SyntheticBERT:
    """Deterministic BERT-shaped batches (sample i depends on (seed, i) only): the learnable
    stream above with `mask_prob` (15%) of positions masked, a sentence-order label from the first
    token's parity; without the binary head one segment (token type 0 throughout)."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int = 0, mask_prob: float = 0.15,
                 binary_head: bool = True):
        if vocab_size < 8:
            raise ValueError("SyntheticBERT needs a vocabulary of at least 8")
        self.stream = SyntheticTokens(vocab_size - 4, seq_length, seed)
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed
        self.mask_prob, self.binary_head = mask_prob, binary_head
        self.mask_id = vocab_size - 1  # the top ids play the special tokens

    def batch(self, indices) -> dict[str, torch.Tensor]:
        indices = list(indices)
        tokens = self.stream._tokens(indices)[:, :-1]
        chosen = torch.stack([torch.rand(self.seq_length, generator=torch.Generator().manual_seed(
            self.seed * 1_000_003 + index + 7)) for index in indices]) < self.mask_prob
        chosen[:, 0] = True
        n, half = len(indices), self.seq_length // 2 if self.binary_head else self.seq_length
        return {"tokens": tokens.masked_fill(chosen, self.mask_id),
                "token_types": (torch.arange(self.seq_length) >= half).long().expand(n, -1).contiguous(),
                "padding_mask": torch.ones(n, self.seq_length, dtype=torch.bool),
                "labels": tokens.masked_fill(~chosen, 0), "loss_mask": chosen.float(),
                "sop_labels": tokens[:, 0] % 2}
