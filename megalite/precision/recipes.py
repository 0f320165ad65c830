"""FP8 recipes as data: which 8-bit format each operand of a GEMM takes, and how its scales are
chosen. The layers never branch on a recipe's name; they ask a `Recipe` for a role's format and tile.

Roles: `input` (a linear layer's activations), `weight`, `grad` (the gradient of its output). The
formats (Megatron-LM's `--fp8-format`): `e4m3` everywhere, or `hybrid`: E4M3 forward, E5M2 for
gradients (two more exponent bits for their wider range).

The recipes (Megatron-LM's `--fp8-recipe`):
- `tensorwise`: current scaling, one scale per tensor from this tensor's amax: scale = max / amax.
- `delayed`: one scale per tensor from the amaxes of earlier steps (`--fp8-amax-history-len`,
  `--fp8-amax-compute-algo`, `--fp8-margin`; Transformer Engine's DelayedScaling): no reduction in
  the GEMM's path, one per step.
- `blockwise`: DeepSeek-V3's tiles (arXiv 2412.19437, section 3.3): activations and gradients one
  scale per 1 x 128 run along the contraction, weights one per 128 x 128 block; power-of-two
  scales (Transformer Engine's Float8BlockScaling default).
- `mxfp8`: OCP Microscaling: one power-of-two scale (E8M0) per 32 elements along the contraction.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
AMAX_ALGOS = ("most_recent", "max")
ROLES = ("input", "weight", "grad")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}  # largest finite values

BLOCK = 128  # blockwise: activations 1 x 128, weights 128 x 128
MX_BLOCK = 32  # mxfp8: 1 x 32 along the contraction


@dataclass(frozen=True)
class Recipe:
    recipe: str = "tensorwise"
    format: str = "e4m3"
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    margin: int = 0
    wgrad: bool = True  # False (--no-fp8-wgrad): the weight-gradient GEMM in the activations' dtype

    def __post_init__(self):
        for value, allowed, flag in ((self.recipe, RECIPES, "--fp8-recipe"), (self.format, FORMATS, "--fp8-format"),
                                     (self.amax_compute_algo, AMAX_ALGOS, "--fp8-amax-compute-algo")):
            if value not in allowed:
                raise ValueError(f"{flag} {value!r}: choose one of {', '.join(allowed)}")
        if self.amax_history_len < 1:
            raise ValueError(f"--fp8-amax-history-len {self.amax_history_len} must be at least 1")

    def dtype(self, role: str) -> torch.dtype:
        """The 8-bit format of `role`'s operands."""
        return E5M2 if self.format == "hybrid" and role == "grad" else E4M3

    @property
    def power_of_two(self) -> bool:
        """Scales are powers of two: the tiled recipes, blockwise and mxfp8 (whose E8M0 holds only those)."""
        return self.recipe in ("blockwise", "mxfp8")

    def tile(self, role: str) -> tuple[int, int] | None:
        """(rows, columns) of one scale's tile for `role`'s operand laid out [rows, contraction], or
        None for one scale per tensor."""
        if self.recipe == "blockwise":
            return (BLOCK, BLOCK) if role == "weight" else (1, BLOCK)
        if self.recipe == "mxfp8":
            return (1, MX_BLOCK)
        return None

    @property
    def delayed(self) -> bool:
        return self.recipe == "delayed"


def fp8_layer_numbers(num_layers: int, first_last_bf16: bool = False, at_start: int = 1,
                      at_end: int = 1) -> range:
    """The transformer layers (0-based, over the whole model) that run in FP8: all of them, or
    with `first_last_bf16` all but `at_start` first and `at_end` last (Megatron-LM's flags)."""
    if not first_last_bf16:
        return range(num_layers)
    if at_start + at_end >= num_layers:
        raise ValueError(f"--num-layers-at-start-in-bf16 ({at_start}) + --num-layers-at-end-in-bf16 ({at_end}) "
                         f"leave none of the {num_layers} layers in FP8: lower them, or drop --fp8-format")
    return range(at_start, num_layers - at_end)
