"""A deterministic synthetic token stream with learnable structure, for tests and smoke runs.

Sample i depends only on (seed, i): any data-parallel layout sees the same global batches.
Each sequence follows t[k+1] = (a * t[k] + c + noise) mod vocab with noise in {0, 1}, so a model
can learn it and its loss falls.
"""
from __future__ import annotations

import torch


class SyntheticTokens:
    def __init__(self, vocab_size: int, seq_length: int, seed: int = 0):
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed

    def sample(self, index: int) -> torch.Tensor:
        """seq_length + 1 token ids of sample `index`."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        noise = torch.randint(0, 2, (self.seq_length,), generator=gen)
        tokens = torch.empty(self.seq_length + 1, dtype=torch.long)
        tokens[0] = torch.randint(0, self.vocab_size, (1,), generator=gen)
        for k in range(self.seq_length):
            tokens[k + 1] = (7 * tokens[k] + 3 + noise[k]) % self.vocab_size
        return tokens

    def batch(self, indices) -> dict[str, torch.Tensor]:
        tokens = torch.stack([self.sample(i) for i in indices])
        return {
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(len(indices), self.seq_length),
        }


class SyntheticBERT:
    """Deterministic BERT-shaped batches (sample i depends on (seed, i) only): the learnable
    stream above with 15% of positions masked, a sentence-order label from the first token's parity."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int = 0):
        if vocab_size < 8:
            raise ValueError("SyntheticBERT needs a vocabulary of at least 8")
        self.stream = SyntheticTokens(vocab_size - 4, seq_length, seed)
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed
        self.mask_id = vocab_size - 1  # the top ids play the special tokens

    def _one(self, index: int) -> dict[str, torch.Tensor]:
        tokens = self.stream.sample(index)[:-1]
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 7)
        chosen = torch.rand(self.seq_length, generator=gen) < 0.15
        chosen[0] = True
        masked = tokens.masked_fill(chosen, self.mask_id)
        half = self.seq_length // 2
        return {"tokens": masked, "token_types": (torch.arange(self.seq_length) >= half).long(),
                "padding_mask": torch.ones(self.seq_length, dtype=torch.bool),
                "labels": tokens.masked_fill(~chosen, 0), "loss_mask": chosen.float(),
                "sop_labels": tokens[0] % 2}

    def batch(self, indices) -> dict[str, torch.Tensor]:
        samples = [self._one(i) for i in indices]
        return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
