"""TransformerConfig: the shape and regularization of a transformer, plus named presets."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class TransformerConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int = 50257
    max_position_embeddings: int = 1024
    ffn_hidden_size: int | None = None  # default 4 * hidden_size
    # No dropout by default, as usual for pretraining and as the CLI's --hidden-dropout and
    # --attention-dropout; fine-tuning (and BERT as published, 0.1) passes it explicitly.
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128  # padded to a multiple of this times TP
    sequence_parallel: bool = False
    recompute: str = "none"  # none | selective | full
    recompute_num_layers: int | None = None  # full: how many layers per stage (default all)
    recompute_method: str = "uniform"  # full: uniform | block
    # sdpa: PyTorch's fused attention (flash where available); fused: score matmuls + megalite's
    # fused softmax kernel; torch: explicit matmuls and softmax (the layout the memory formula counts)
    attention_backend: str = "sdpa"
    norm_backend: str = "auto"  # auto | fused: megalite.ops (kernel where it runs) | torch: F.layer_norm
    # Architecture switches; the defaults are GPT-2's, BERT as published is post / gelu / not causal.
    layernorm_position: str = "pre"  # pre: x + f(LN(x)) | post: LN(x + f(x))
    normalization: str = "layernorm"  # layernorm (weight and bias) | rmsnorm (weight only)
    activation: str = "gelu_tanh"  # MLP: gelu_tanh (tanh approximation) | gelu (exact, erf)
    causal: bool = True  # attention: to earlier positions only, or bidirectional
    params_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be none, selective or full, got {self.recompute!r}")
        if self.attention_backend not in ("sdpa", "fused", "torch"):
            raise ValueError(f"attention_backend must be sdpa, fused or torch, got {self.attention_backend!r}")
        if self.normalization not in ("layernorm", "rmsnorm"):
            raise ValueError(f"normalization must be layernorm or rmsnorm, got {self.normalization!r}")
        if self.norm_backend not in ("auto", "fused", "torch"):
            raise ValueError(f"norm_backend must be auto, fused or torch, got {self.norm_backend!r}")
        if self.recompute_method not in ("uniform", "block"):
            raise ValueError(f"recompute_method must be uniform or block, got {self.recompute_method!r}")
        if self.layernorm_position not in ("pre", "post"):
            raise ValueError(f"layernorm_position must be pre or post, got {self.layernorm_position!r}")
        if self.activation not in ("gelu_tanh", "gelu"):
            raise ValueError(f"activation must be gelu_tanh or gelu, got {self.activation!r}")
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal must be True or False, got {self.causal!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise ValueError naming both numbers when the model cannot be split over `tp` ranks."""
        for what, n in (
            ("num_attention_heads", self.num_attention_heads),
            ("ffn_hidden_size", self.ffn_hidden_size),
        ):
            if n % tp:
                raise ValueError(
                    f"{what} ({n}) is not divisible by the tensor-parallel size ({tp}): "
                    f"choose --tp among the divisors of {n}"
                )
        if self.sequence_parallel and tp == 1:
            raise ValueError("sequence parallelism needs a tensor-parallel size > 1 (got --tp 1)")

    def replace(self, **changes) -> "TransformerConfig":
        return dataclasses.replace(self, **changes)


# BERT as published (Devlin et al. 2019; Hugging Face's bert-*-uncased). Attention direction is
# left to the model class: BERTModel is always bidirectional, GPTModel causal.
_BERT = dict(layernorm_position="post", activation="gelu", layernorm_epsilon=1e-12)

# Named shapes. Vocabulary sizes are those of the tokenizers they are used with; the GPT-2
# family follows the GPT-2 / Megatron-LM papers, BERT's the 30522-token WordPiece vocabulary.
PRESETS: dict[str, dict] = {
    "gpt-tiny": dict(num_layers=4, hidden_size=128, num_attention_heads=4, max_position_embeddings=128,
                     vocab_size=1024),
    "gpt2-124m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, max_position_embeddings=1024),
    "gpt2-350m": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, max_position_embeddings=1024),
    "gpt-1.3b": dict(num_layers=24, hidden_size=2048, num_attention_heads=16, max_position_embeddings=2048),
    "gpt-175b": dict(num_layers=96, hidden_size=12288, num_attention_heads=96, max_position_embeddings=2048),
    "bert-tiny": dict(num_layers=2, hidden_size=128, num_attention_heads=2, max_position_embeddings=128,
                      vocab_size=30522, **_BERT),
    "bert-base": dict(num_layers=12, hidden_size=768, num_attention_heads=12, max_position_embeddings=512,
                      vocab_size=30522, **_BERT),
    "bert-large": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, max_position_embeddings=512,
                       vocab_size=30522, **_BERT),
}


def preset(name: str, **overrides) -> TransformerConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}")
    return TransformerConfig(**{**PRESETS[name], **overrides})
