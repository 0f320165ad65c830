"""Position embeddings as components, chosen in `position_embedding(config, ...)`.

`config.position_embedding_type` picks from `POSITION_EMBEDDINGS`: "learned_absolute" adds a
learned table to the first stage's input; "rope" adds nothing there (attention rotates q and k,
megalite/models/rope.py) and "none" gives no position information at all.
"""
from __future__ import annotations

import torch
from torch import nn

from megalite.models.config import TransformerConfig
from megalite.models.rng import POSITION_EMBEDDING_COMPONENT, embedding_init, init_generator, init_replicated
from megalite.parallel.grad_accumulation import embedding


class LearnedPositionEmbedding(nn.Embedding):
    """A table of `max_position_embeddings` learned vectors (GPT-2, BERT), whole on every TP rank,
    drawn by `embedding_init` from the position component's generator."""

    def __init__(self, config: TransformerConfig, seed: int, device=None):
        super().__init__(config.max_position_embeddings, config.hidden_size, dtype=config.params_dtype, device=device)
        init_replicated(self, embedding_init(config, init_generator(seed, POSITION_EMBEDDING_COMPONENT, device)),
                        device)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return embedding(positions, self.weight)  # F.embedding, or its split form under a zero-bubble schedule


# kind -> the module a first stage adds to its input, or None (rope acts in attention).
POSITION_EMBEDDINGS: dict[str, type[nn.Module] | None] = {
    "learned_absolute": LearnedPositionEmbedding, "rope": None, "none": None,
}


def position_embedding(config: TransformerConfig, seed: int, device=None) -> nn.Module | None:
    """The position embedding a first stage holds (as `position_embeddings`), None for rope and none."""
    kind = POSITION_EMBEDDINGS[config.position_embedding_type]
    return None if kind is None else kind(config, seed, device)


def check_length(config: TransformerConfig, s: int) -> None:
    if s > config.max_position_embeddings:
        raise ValueError(f"sequence length ({s}) exceeds max_position_embeddings ({config.max_position_embeddings})")
