"""FP8 applied to a built model: which transformer layers run their linear GEMMs in FP8, and delayed
scaling's once-a-step close (megalite.precision, megalite.parallel.fp8_linear; docs/fp8.md).

Every column- and row-parallel linear layer inside an FP8 transformer layer takes the recipe: the
attention's query/key/value and output projections (MLA's up-projections too), the MLP, a MoE
layer's shared expert. The word embedding, the output layer, the router, norms, softmax, losses and
multi-token prediction's modules stay in the model's dtype, as the recipes prescribe.
"""
from __future__ import annotations

import torch

from megalite.models.transformer import TransformerLayer
from megalite.parallel.fp8_linear import FP8Linear
from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.precision.recipes import Recipe


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


def enable_fp8(chunk: torch.nn.Module, recipe: Recipe | None, layers) -> int:
    """Give `recipe` to every parallel linear layer inside the transformer layers of `chunk` whose
    number is in `layers`. Returns how many linear layers now run in FP8."""
    count = 0
    if recipe is None:
        return count
    layers = set(layers)
    for layer in chunk.modules():
        if isinstance(layer, TransformerLayer) and layer.layer_number in layers:
            for m in layer.modules():
                if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                    m.use_fp8(recipe)
                    count += 1
    return count


def fp8_states(chunks) -> list[FP8Linear]:
    """Each FP8 linear layer's state in `chunks`, in module order (the same on every rank of a stage)."""
    return [m.fp8 for c in chunks for m in c.modules() if getattr(m, "fp8", None) is not None]


def close_delayed_scaling(chunks, group=None) -> None:
    """Delayed scaling's step end: every layer's amaxes of this step, reduced (MAX) over `group` in
    one all-reduce, enter their histories and choose the next step's scales. No host sync."""
    scalings = [s.scaling for s in fp8_states(chunks) if s.scaling is not None]
    if not scalings:
        return
    amax = torch.stack([s.amax_now for s in scalings])
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
    for s, a in zip(scalings, amax):
        s.update(a)
