"""megalite: Megatron-style 3D-parallel transformer training in plain PyTorch."""
from megalite import parallel
from megalite.models import GPTModel, TransformerConfig
from megalite.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    initialize_model_parallel,
    vocab_parallel_cross_entropy,
)

__version__ = "0.1.0"
__all__ = [
    "ColumnParallelLinear", "GPTModel", "RowParallelLinear", "TransformerConfig", "VocabParallelEmbedding",
    "initialize_model_parallel", "parallel", "vocab_parallel_cross_entropy",
]
