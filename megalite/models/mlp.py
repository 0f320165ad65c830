"""The transformer's feed-forward block (tensor-parallel) and its activations.

`mlp_layer(config, ...)` is the one place a layer's MLP is chosen: plain, or gated (SwiGLU with
silu: fc1 twice as wide, fc2(act(gate) * up)) when `config.gated_linear_unit`.
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
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_tanh": _gelu_tanh, "gelu": F.gelu, "silu": F.silu,
}


def activation_function(config: TransformerConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    return ACTIVATIONS[config.activation]


class ParallelMLP(nn.Module):
    """fc2(act(fc1(x))): fc1 column-parallel (the ffn features split over TP), fc2 row-parallel."""

    fc1_width = 1  # fc1 rows per ffn feature

    def __init__(self, config: TransformerConfig, init_method, output_init_method, device=None):
        super().__init__()
        sp, dtype, bias = config.sequence_parallel, config.params_dtype, config.add_bias_linear
        self.fc1 = ColumnParallelLinear(
            config.hidden_size, self.fc1_width * config.ffn_hidden_size, bias=bias, init_method=init_method,
            sequence_parallel=sp, params_dtype=dtype, device=device,
        )
        self.fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, bias=bias, init_method=output_init_method,
            sequence_parallel=sp, params_dtype=dtype, device=device,
        )
        self.activation = activation_function(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))


class GatedMLP(ParallelMLP):
    """fc2(act(gate) * up) (SwiGLU with silu). fc1's rows interleave gate and up (row 2i gate_i,
    row 2i + 1 up_i), so every contiguous TP block holds matching pairs, whatever the TP size."""

    fc1_width = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)
        return self.fc2(self.activation(y[..., 0::2]) * y[..., 1::2])


def mlp_layer(config: TransformerConfig, init_method, output_init_method, device=None) -> nn.Module:
    """The config's MLP; its weights drawn by `init_method` (fc1) and `output_init_method` (fc2)."""
    kind = GatedMLP if config.gated_linear_unit else ParallelMLP
    return kind(config, init_method, output_init_method, device)
