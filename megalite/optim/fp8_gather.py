"""ZeRO-3's per-layer gathers with FP8 weights (`--fp8-param-gather`): a weight whose GEMMs run in FP8
with delayed scaling crosses the wire as its FP8 values, 1 byte an element instead of the model
dtype's 2 (or 4), and the GEMM takes them as gathered.

Each rank quantizes its shard's part of each such weight with the weight's delayed scale (the scale
the GEMM would use; known before the gather, so no reduction precedes it) and records the part's
amax (delayed scaling's step end takes the maximum over the stage's ranks: the whole weight's). The
values are those the GEMM would make from the gathered weight, element for element: the same
numbers, half the bytes. A rank's chunk on the wire is its shard's other elements in the model dtype,
then its FP8 bytes, padded to the largest rank's chunk; after the gather each rank places every
rank's elements (`unpack`): the other parameters into the unit's whole buffer as before, the FP8
bytes into the weights' `fp8_gathered` (megalite.parallel.fp8_linear reads them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.precision.quantize import Quantized
from megalite.precision.recipes import E4M3, FP8_MAX


@dataclass
class PackPlan:
    """How one unit crosses the wire: index tensors computed once from the layout."""
    chunk_bytes: int  # every rank's chunk, padded (a multiple of the model dtype's size)
    mine_other: torch.Tensor  # positions in this rank's shard of elements sent in the model dtype
    mine_fp8: torch.Tensor  # ... and of elements sent in FP8, in order
    runs: list  # (FP8 state, run length) of this rank's FP8 elements, in order
    other_to: torch.Tensor  # positions in the whole unit of every rank's model-dtype elements
    other_from: torch.Tensor  # their positions in the gathered chunks (as model-dtype elements)
    fp8_to: torch.Tensor  # positions in the whole unit of every rank's FP8 elements
    fp8_from: torch.Tensor  # their byte positions in the gathered chunks
    weights: list  # (parameter, FP8 state, first element in the unit, shape) of the unit's FP8 weights


def plan_unit(numel: int, dp: int, rank: int, fp8_weights: list, element_size: int, device) -> PackPlan:
    """`fp8_weights`: (parameter, FP8 state, first element in the unit, shape) of the unit's weights
    that gather in FP8; the unit's `numel` elements are split into `dp` equal shards."""
    shard = numel // dp
    is_fp8 = torch.zeros(numel, dtype=torch.bool)
    for _, _, lo, shape in fp8_weights:
        is_fp8[lo:lo + shape.numel()] = True
    chunks = []
    for r in range(dp):
        mask = is_fp8[r * shard:(r + 1) * shard]
        chunks.append((torch.nonzero(~mask).flatten(), torch.nonzero(mask).flatten()))
    width = max(element_size * len(o) + len(f) for o, f in chunks)
    chunk_bytes = -(-width // element_size) * element_size
    other_to = torch.cat([o + r * shard for r, (o, _) in enumerate(chunks)])
    other_from = torch.cat([torch.arange(len(o)) + r * chunk_bytes // element_size for r, (o, _) in enumerate(chunks)])
    fp8_to = torch.cat([f + r * shard for r, (_, f) in enumerate(chunks)])
    fp8_from = torch.cat([torch.arange(len(f)) + r * chunk_bytes + element_size * len(o)
                          for r, (o, f) in enumerate(chunks)])
    runs = []
    lo_mine, hi_mine = rank * shard, (rank + 1) * shard
    for _, state, lo, shape in sorted(fp8_weights, key=lambda w: w[2]):
        n = max(0, min(hi_mine, lo + shape.numel()) - max(lo_mine, lo))
        if n:
            runs.append((state, n))
    mine_other, mine_fp8 = chunks[rank]
    return PackPlan(chunk_bytes, mine_other.to(device), mine_fp8.to(device), runs, other_to.to(device),
                    other_from.to(device), fp8_to.to(device), fp8_from.to(device), fp8_weights)


def pack(plan: PackPlan, shard: torch.Tensor, record: bool) -> torch.Tensor:
    """This rank's chunk: its other elements' bytes, then its FP8 weights' part quantized with their
    delayed scales (each part's amax recorded when `record`: a training forward)."""
    chunk = torch.zeros(plan.chunk_bytes, dtype=torch.uint8, device=shard.device)
    others = shard[plan.mine_other]
    chunk[:others.nbytes] = others.view(torch.uint8)
    if plan.runs:
        values = shard[plan.mine_fp8].float()
        scales = []
        for part, (state, n) in zip(values.split([n for _, n in plan.runs]), plan.runs):
            amax = part.abs().amax()
            scale = state.scaling.record("weight", amax) if record else state.scaling.current("weight")
            scales.append((scale * (amax * 0 + 1)).expand(n))  # an inf or NaN makes the part NaN, as quantize does
        fp8 = (values * torch.cat(scales)).clamp(-FP8_MAX[E4M3], FP8_MAX[E4M3]).to(E4M3)
        chunk[others.nbytes:others.nbytes + fp8.numel()] = fp8.view(torch.uint8)
    return chunk


def unpack(plan: PackPlan, gathered: torch.Tensor, whole: torch.Tensor) -> None:
    """Place every rank's chunk: the model-dtype elements into `whole`, the FP8 weights into their
    `fp8_gathered` (with the scale they were quantized with)."""
    whole[plan.other_to] = gathered.view(whole.dtype)[plan.other_from]
    fp8 = torch.empty(whole.numel(), dtype=torch.uint8, device=whole.device)
    fp8[plan.fp8_to] = gathered[plan.fp8_from]
    for p, state, lo, shape in plan.weights:
        data = fp8[lo:lo + shape.numel()].view(E4M3).view(shape)
        p.fp8_gathered = Quantized(data, (1.0 / state.scaling.current("weight")).float())


def forget(plan: PackPlan) -> None:
    """The unit is freed (or gathered in the model dtype): its FP8 weights are gone."""
    for p, _, _, _ in plan.weights:
        p.fp8_gathered = None
