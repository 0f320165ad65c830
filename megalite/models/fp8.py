"""FP8 applied to a built model: which transformer layers run their linear GEMMs in FP8, and delayed
scaling's once-a-step close (megalite.precision, megalite.parallel.fp8_linear; docs/fp8.md).

Every linear layer inside an FP8 transformer layer takes the recipe: the attention's query/key/value
and output projections (MLA's down- and up-projections too), the MLP, a MoE layer's experts (each
with its own scales) and shared expert. The word embedding, the output layer, the router, norms,
softmax, losses and multi-token prediction's modules stay in the model's dtype, as the recipes
prescribe.
"""
from __future__ import annotations

import torch

from megalite.models.mla import ReplicatedLinear
from megalite.models.moe.experts import GroupedMLP
from megalite.models.transformer import TransformerLayer
from megalite.parallel import traffic
from megalite.parallel.fp8_linear import FP8Linear
from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.precision.recipes import Recipe


def enable_fp8(chunk: torch.nn.Module, recipe: Recipe | None, layers) -> int:
    """Give `recipe` to every parallel linear layer and expert group inside the transformer layers of
    `chunk` whose number is in `layers`. Returns how many modules now run their GEMMs in FP8."""
    count = 0
    if recipe is None:
        return count
    layers = set(layers)
    for layer in chunk.modules():
        if isinstance(layer, TransformerLayer) and layer.layer_number in layers:
            for m in layer.modules():
                if isinstance(m, (ColumnParallelLinear, RowParallelLinear, GroupedMLP, ReplicatedLinear)):
                    m.use_fp8(recipe)
                    count += 1
    return count


def _dense_and_expert_states(chunks):
    """([dense layers' FP8Linear], [(first global expert, [fc1 states], [fc2 states], experts in all)])."""
    dense = [m.fp8 for c in chunks for m in c.modules() if getattr(m, "fp8", None) is not None]
    experts = [(m.first_expert, m.fc1_fp8, m.fc2_fp8, m.num_experts)
               for c in chunks for m in c.modules() if isinstance(m, GroupedMLP) and m.fc1_fp8 is not None]
    return dense, experts


def fp8_states(chunks) -> list[FP8Linear]:
    """Every FP8 state in `chunks`: dense layers', then each local expert's fc1 and fc2."""
    dense, experts = _dense_and_expert_states(chunks)
    return dense + [s for _, fc1, fc2, _ in experts for s in (*fc1, *fc2)]


def close_delayed_scaling(chunks, group=None) -> None:
    """Delayed scaling's step end: every layer's amaxes of this step, reduced (MAX) over `group` (a
    pipeline stage's ranks) in one all-reduce, enter their histories and choose the next step's
    scales. Experts sit in slots by their global number (zeros where another rank holds them: amaxes
    are >= 0), so each expert is reduced only with its own copies and parts. No host sync."""
    dense, experts = _dense_and_expert_states(chunks)
    dense = [s.scaling for s in dense if s.scaling is not None]
    experts = [e for e in experts if e[1] and e[1][0].scaling is not None]
    if not dense and not experts:
        return
    rows = [s.amax_now for s in dense]
    slots = []  # (row of expert e's fc1 in `rows`, its states)
    for first, fc1, fc2, total in experts:
        block = torch.zeros(2 * total, 3, device=fc1[0].scaling.amax_now.device)
        for e, (a, b) in enumerate(zip(fc1, fc2)):
            block[2 * (first + e)] = a.scaling.amax_now
            block[2 * (first + e) + 1] = b.scaling.amax_now
            slots.append((len(rows) + 2 * (first + e), a.scaling, b.scaling))
        rows.extend(block.unbind(0))
    amax = torch.stack(rows)
    if group is not None and torch.distributed.get_world_size(group) > 1:
        traffic.counted_all_reduce("fp8", amax, group=group, op=torch.distributed.ReduceOp.MAX)
    for s, a in zip(dense, amax):
        s.update(a)
    for row, fc1, fc2 in slots:
        fc1.update(amax[row])
        fc2.update(amax[row + 1])
