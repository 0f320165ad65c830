"""ZeRO-3's per-layer gathers with FP8 weights (`--fp8-param-gather`): a weight whose GEMMs run in FP8
with delayed scaling crosses the wire as its FP8 values, 1 byte an element instead of the model
dtype's 2 (or 4), and the GEMM takes them as gathered.

Each rank quantizes its shard's part of each such weight with the weight's delayed scale (the scale
the GEMM would use; known before the gather, so no reduction precedes it) and records the part's
amax (delayed scaling's step end takes the maximum over the stage's ranks: the whole weight's). The
values are those the GEMM would make from the gathered weight, element for element: the same
numbers, half the bytes. A rank's chunk on the wire is its shard's other elements in the model dtype,
then its FP8 bytes, padded to the largest rank's chunk; after the gather each rank places every
rank's runs (`unpack`): the other parameters into the unit's whole buffer as before, the FP8 bytes
into the weights' `fp8_gathered` (megalite.parallel.fp8_linear reads them). The model-dtype values of
those weights are not filled by such a gather: only the training passes' gathers use it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.precision.quantize import Quantized
from megalite.precision.recipes import E4M3, FP8_MAX


@dataclass
class PackPlan:
    """How one unit crosses the wire, as runs of contiguous elements (a few per weight and rank)."""
    chunk_bytes: int  # every rank's chunk, padded (a multiple of the model dtype's size)
    # per rank: (model-dtype elements in its chunk, [(unit position, chunk element offset, n)],
    #            [(unit position, chunk byte offset, n, weight index)])
    ranks: list
    weights: list  # (parameter, FP8 state, first element in the unit, shape, offset in the FP8 buffer)
    fp8_numel: int  # the unit's FP8 weights' elements together


def plan_unit(numel: int, dp: int, fp8_weights: list, element_size: int) -> PackPlan:
    """`fp8_weights`: (parameter, FP8 state, first element in the unit, shape) of the unit's weights
    that gather in FP8; the unit's `numel` elements are split into `dp` equal shards."""
    shard = numel // dp
    weights, offset = [], 0
    for p, state, lo, shape in sorted(fp8_weights, key=lambda w: w[2]):
        weights.append((p, state, lo, shape, offset))
        offset += shape.numel()
    ranks, widest = [], 0
    for r in range(dp):
        a, b = r * shard, (r + 1) * shard
        cuts = sorted({a, b, *(x for _, _, lo, shape, _ in weights for x in (lo, lo + shape.numel()) if a < x < b)})
        others, fp8, n_other = [], [], 0
        for lo, hi in zip(cuts, cuts[1:]):
            owner = next((i for i, (_, _, wlo, shape, _) in enumerate(weights) if wlo <= lo < wlo + shape.numel()),
                         None)
            if owner is None:
                others.append((lo, n_other, hi - lo))
                n_other += hi - lo
            else:
                fp8.append((lo, hi - lo, owner))
        fp8_runs, byte = [], element_size * n_other
        for lo, n, owner in fp8:
            fp8_runs.append((lo, byte, n, owner))
            byte += n
        widest = max(widest, byte)
        ranks.append((n_other, others, fp8_runs))
    chunk_bytes = -(-widest // element_size) * element_size
    return PackPlan(chunk_bytes, ranks, weights, offset)


def pack(plan: PackPlan, shard: torch.Tensor, rank: int, record: bool) -> torch.Tensor:
    """This rank's chunk: its other elements' bytes, then its FP8 weights' runs quantized with their
    delayed scales (each run's amax recorded when `record`: a training forward)."""
    chunk = torch.zeros(plan.chunk_bytes, dtype=torch.uint8, device=shard.device)
    n_other, others, fp8_runs = plan.ranks[rank]
    base = rank * shard.numel()
    other_view = chunk[:n_other * shard.element_size()].view(shard.dtype)
    for lo, off, n in others:
        other_view[off:off + n] = shard[lo - base:lo - base + n]
    for lo, byte, n, owner in fp8_runs:
        state = plan.weights[owner][1]
        part = shard[lo - base:lo - base + n].float()
        amax = part.abs().amax()
        scale = state.scaling.record("weight", amax) if record else state.scaling.current("weight")
        scale = scale * (amax * 0 + 1)  # an inf or NaN makes the run NaN, as quantize does
        chunk[byte:byte + n] = (part * scale).clamp(-FP8_MAX[E4M3], FP8_MAX[E4M3]).to(E4M3).view(torch.uint8)
    return chunk


def unpack(plan: PackPlan, gathered: torch.Tensor, whole: torch.Tensor) -> None:
    """Place every rank's runs: the model-dtype elements into `whole`, the FP8 weights into their
    `fp8_gathered` (with the scale they were quantized with)."""
    fp8 = torch.empty(plan.fp8_numel, dtype=torch.uint8, device=whole.device)
    for r, (n_other, others, fp8_runs) in enumerate(plan.ranks):
        chunk = gathered[r * plan.chunk_bytes:(r + 1) * plan.chunk_bytes]
        other_view = chunk[:n_other * whole.element_size()].view(whole.dtype)
        for lo, off, n in others:
            whole[lo:lo + n] = other_view[off:off + n]
        for lo, byte, n, owner in fp8_runs:
            _, _, wlo, _, at = plan.weights[owner]
            fp8[at + lo - wlo:at + lo - wlo + n] = chunk[byte:byte + n]
    for p, state, _, shape, at in plan.weights:
        data = fp8[at:at + shape.numel()].view(E4M3).view(shape)
        p.fp8_gathered = Quantized(data, (1.0 / state.scaling.current("weight")).float())


def forget(plan: PackPlan) -> None:
    """The unit is freed (or gathered in the model dtype): its FP8 weights are gone."""
    for p, *_ in plan.weights:
        p.fp8_gathered = None
