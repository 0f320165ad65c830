"""Position embeddings as components, chosen in `position_embedding(config, ...)`.

Today every model learns absolute positions; rotary ("rope") and "none" become more entries of
`POSITION_EMBEDDINGS`, picked there from the config.
"""
from __future__ import annotations

from torch import nn

from megalite.models.config import TransformerConfig
from megalite.models.rng import POSITION_EMBEDDING_COMPONENT, init_generator, init_replicated


class LearnedPositionEmbedding(nn.Embedding):
    """A table of `max_position_embeddings` learned vectors (GPT-2, BERT), whole on every TP rank,
    drawn N(0, init_method_std) from the position component's generator."""

    def __init__(self, config: TransformerConfig, seed: int, device=None):
        super().__init__(config.max_position_embeddings, config.hidden_size, dtype=config.params_dtype, device=device)
        init_replicated(self, config.init_method_std, init_generator(seed, POSITION_EMBEDDING_COMPONENT, device),
                        device)

    def check_length(self, s: int) -> None:
        if s > self.num_embeddings:
            raise ValueError(f"sequence length ({s}) exceeds max_position_embeddings ({self.num_embeddings})")


POSITION_EMBEDDINGS: dict[str, type[nn.Module]] = {"learned_absolute": LearnedPositionEmbedding}


def position_embedding(config: TransformerConfig, seed: int, device=None) -> nn.Module:
    """The position embedding a first stage holds (as `position_embeddings`)."""
    kind = "learned_absolute"  # the only kind yet: the config's position_embedding_type picks here
    return POSITION_EMBEDDINGS[kind](config, seed, device)
