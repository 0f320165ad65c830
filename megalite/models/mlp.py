"""The transformer's feed-forward block (tensor-parallel) and its activations.

`mlp_layer(config, ...)` is the one place a layer's MLP is chosen: plain, or gated (SwiGLU with
silu, quick GeGLU with quick_gelu: fc1 twice as wide, fc2(act(gate) * up), `glu_function`) when
`config.gated_linear_unit`. The gated fc1 holds
the gate rows, then the up rows (each TP rank: its gate rows, then its up rows); checkpoints and
Hugging Face conversion store it as [gate; up] whatever the TP size.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megalite.models.config import TransformerConfig
from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear, normal_init


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _squared_relu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()  # Nemotron's MLP (Megatron-LM's --squared-relu)


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)  # GeLU's sigmoid approximation (Megatron-Core's quick_gelu; gpt-oss)


# config.activation -> function; BERT's masked-LM head uses the same one.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_tanh": _gelu_tanh, "gelu": F.gelu, "silu": F.silu, "squared_relu": _squared_relu, "quick_gelu": _quick_gelu,
}


def activation_function(config: TransformerConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    return ACTIVATIONS[config.activation]


def glu_function(config: TransformerConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A gated MLP's act(gate) * up; with --activation-func-clamp-value v the gate clamped to at most v
    and up to [-v, v] first, and with --glu-linear-offset c, up + c (Megatron-Core's unfused GLU, the
    bias already added; gpt-oss's experts: quick GeLU, v 7, c 1)."""
    act, limit, offset = activation_function(config), config.activation_func_clamp_value, config.glu_linear_offset
    if limit is None and not offset:
        return lambda gate, up: act(gate) * up

    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return act(gate) * (up + offset)
    return glu


class ParallelMLP(nn.Module):
    """fc2(act(fc1(x))): fc1 column-parallel (the ffn features split over TP), fc2 row-parallel."""

    fc1_width = 1  # fc1 rows per ffn feature

    def __init__(self, config: TransformerConfig, init_method, output_init_method, device=None):
        super().__init__()
        sp, dtype, bias = config.sequence_parallel, config.params_dtype, config.add_bias_linear
        self.fc1 = ColumnParallelLinear(
            config.hidden_size, self.fc1_width * config.ffn_hidden_size, bias=bias,
            init_method=self._fc1_init(init_method), sequence_parallel=sp, params_dtype=dtype, device=device,
            partition_blocks=self.fc1_width, **config.tp_comm_options(),
        )
        self.fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, bias=bias, init_method=output_init_method,
            sequence_parallel=sp, params_dtype=dtype, device=device, **config.tp_comm_options(),
        )
        self.activation = activation_function(config)

    @staticmethod
    def _fc1_init(init_method):
        return init_method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))


class GatedMLP(ParallelMLP):
    """fc2(act(gate) * up) (SwiGLU with silu). fc1's full weight is the gate rows, then the up rows,
    each block split over TP (`partition_blocks=2`), so a rank's fc1 output is [its gate | its up]:
    the activation reads two contiguous halves and the backward writes them without a scatter."""

    fc1_width = 2

    def __init__(self, config: TransformerConfig, init_method, output_init_method, device=None):
        super().__init__(config, init_method, output_init_method, device)
        self.glu = glu_function(config)

    @staticmethod
    def _fc1_init(init_method):
        """Draw as megalite always has (rows 2i, 2i + 1 = gate_i, up_i) and stack the halves, so a
        seed builds the same function as before the halves layout."""
        init_method = init_method or normal_init()

        def init(w: torch.Tensor):
            init_method(w)
            if not w.is_meta:
                w.copy_(torch.cat((w[0::2], w[1::2])))
            return w
        return init

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(self.glu(gate, up))


def mlp_layer(config: TransformerConfig, init_method, output_init_method, device=None) -> nn.Module:
    """The config's MLP; its weights drawn by `init_method` (fc1) and `output_init_method` (fc2)."""
    kind = GatedMLP if config.gated_linear_unit else ParallelMLP
    return kind(config, init_method, output_init_method, device)
