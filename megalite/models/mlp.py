"""The transformer's feed-forward block (tensor-parallel) and its activations.

`mlp_layer(config, ...)` is the one place a layer's MLP is chosen: a gated MLP (SwiGLU: fc1 twice
as wide, act(gate) * up) is one more class built there when the config asks for it.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megalite.models.config import TransformerConfig
from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# config.activation -> function; BERT's masked-LM head uses the same one.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"gelu_tanh": _gelu_tanh, "gelu": F.gelu}


def activation_function(config: TransformerConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    return ACTIVATIONS[config.activation]


class ParallelMLP(nn.Module):
    """fc2(act(fc1(x))): fc1 column-parallel (the ffn features split over TP), fc2 row-parallel."""

    def __init__(self, config: TransformerConfig, init_method, output_init_method, device=None):
        super().__init__()
        sp, dtype = config.sequence_parallel, config.params_dtype
        self.fc1 = ColumnParallelLinear(
            config.hidden_size, config.ffn_hidden_size, init_method=init_method,
            sequence_parallel=sp, params_dtype=dtype, device=device,
        )
        self.fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, init_method=output_init_method,
            sequence_parallel=sp, params_dtype=dtype, device=device,
        )
        self.activation = activation_function(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))


def mlp_layer(config: TransformerConfig, init_method, output_init_method, device=None) -> nn.Module:
    """The config's MLP; its weights drawn by `init_method` (fc1) and `output_init_method` (fc2)."""
    return ParallelMLP(config, init_method, output_init_method, device)
