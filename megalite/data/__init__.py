"""Datasets and tokenizers."""
from megalite.data.synthetic import SyntheticTokens

__all__ = ["SyntheticTokens"]
