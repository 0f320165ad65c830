"""Transformer models built from the tensor-parallel layers, one pipeline stage at a time."""
from megalite.models.bert import BERTModel
from megalite.models.config import TransformerConfig
from megalite.models.presets import PRESETS, preset
from megalite.models.gpt import GPTModel
from megalite.models.memory import activation_bytes_per_layer
from megalite.models.transformer import TransformerLayer, compile_layers

__all__ = [
    "activation_bytes_per_layer", "BERTModel", "compile_layers", "GPTModel", "PRESETS", "TransformerConfig",
    "TransformerLayer", "preset",
]
