"""What the MoE layers report at log lines: the load-balancing and z-loss terms as they enter the
training loss, each layer's load (tokens per expert: max over mean) and the fraction of assignments
dropped over capacity. Each layer adds its figures on the device in every first forward (not in
recomputation) to a tensor of its own (`MoELayer.figures`), so nothing is read between log lines and
two models in one process keep theirs apart; `take()` sums a model's figures over every rank (each
holds its own tokens, stages hold different layers) at a log line and starts anew."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from megalite.models.rng import is_recomputing
from megalite.parallel import traffic

# a layer's figures: [aux, z, dropped, assignments, tokens with non-finite logits, tokens per expert...]
_FIXED = 5


@torch.compiler.disable  # runs eagerly from a compiled layer too, so --torch-compile reports the same
def record(layer: torch.nn.Module, num_experts: int, counts: torch.Tensor, assignments: int,
           aux: torch.Tensor | None = None, z: torch.Tensor | None = None, dropped: torch.Tensor | None = None,
           nonfinite: torch.Tensor | None = None) -> None:
    """One forward of MoE layer `layer` on this rank: its routed counts per expert, the assignments it
    routed, its shares of the loss terms, the dropped assignments, the tokens whose router logits
    were not all finite."""
    if is_recomputing():
        return
    s = layer.figures
    if s is None:
        s = layer.figures = torch.zeros(_FIXED + num_experts, dtype=torch.float32, device=counts.device)
    with torch.no_grad():
        for i, v in enumerate((aux, z, dropped, None, nonfinite)):
            if v is not None:
                s[i] += v.detach().float()
        s[3] += assignments
        s[_FIXED:] += counts.float()


def take(models: Iterable[torch.nn.Module], num_layers: int, moe_layers: list[int], num_experts: int, device,
         steps: int = 1) -> dict:
    """The log line's MoE figures of `models` (a rank's model chunks) since the last take (`steps`
    optimizer steps: the loss terms are per step), over every rank (a collective: every rank calls it
    at the same log line)."""
    table = torch.zeros(num_layers, _FIXED + num_experts, dtype=torch.float32, device=device)
    for model in models:
        for layer in model.modules():
            if getattr(layer, "figures", None) is not None:
                table[layer.layer_number] += layer.figures
                layer.figures = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        traffic.counted_all_reduce("metrics", table)
    table = table[moe_layers].cpu()
    loads = table[:, _FIXED:]
    per_layer = (loads.max(1).values / loads.mean(1).clamp_min(1e-12)).tolist()
    assigned = float(table[:, 3].sum())
    return {"moe_aux_loss": float(table[:, 0].sum()) / steps, "moe_z_loss": float(table[:, 1].sum()) / steps,
            "moe_load_imbalance": max(per_layer, default=0.0), "moe_load_imbalance_per_layer": per_layer,
            "moe_dropped_fraction": float(table[:, 2].sum()) / assigned if assigned else 0.0,
            # layer number -> tokens whose router logits were NaN or inf (none: empty)
            "moe_nonfinite_router_logits": {layer: int(n) for layer, n in zip(moe_layers, table[:, 4].tolist()) if n}}


def nonfinite_logits_line(iteration: int, counts: dict[int, int]) -> str:
    """The one line that stops training when routers saw NaN/inf logits (`take`'s figure)."""
    where = ", ".join(f"layer {layer} ({n} tokens)" for layer, n in sorted(counts.items()))
    return (f"stopping at iteration {iteration}: NaN/inf router logits in {where}: the layer's input or router "
            f"weights are not finite (diverged, or a bad checkpoint or data); lower --lr, check the data, or resume "
            f"from an earlier checkpoint. The last checkpoint is intact.")
