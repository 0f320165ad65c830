"""Which layers each pipeline stage (and virtual stage) holds, and which rank holds each virtual stage."""
from __future__ import annotations

# Schedules that place two model chunks per rank in a V: chunk 0 of rank r is virtual stage r, chunk 1
# is stage 2p-1-r, so rank 0 holds the first and the last layers and rank p-1 hands its chunk 0's
# output to its own chunk 1 (Qi et al. 2023, section 6).
V_SCHEDULES = ("zb-v", "dualpipev")


def virtual_stage(p: int, rank: int, chunk: int, v_shape: bool = False) -> int:
    """The virtual stage that `chunk` of pipeline rank `rank` runs: chunk*p + rank (1F1B and the
    interleaved schedule), or in a V, rank for chunk 0 and 2p-1-rank for chunk 1."""
    if v_shape:
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def stage_rank(p: int, stage: int, v_shape: bool = False) -> int:
    """The pipeline rank that holds virtual stage `stage` (see `virtual_stage`)."""
    if v_shape:
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def stage_layer_counts(num_layers: int, pp: int, vpp: int | None = None,
                       explicit: list[int] | None = None) -> list[int]:
    """Layer count of each virtual stage, in virtual-stage order (chunk c of rank r is stage c*pp + r).

    Without an explicit split the layers must divide evenly; an explicit split lists one count per
    virtual stage (pp * vpp of them), each >= 0 (a stage may hold only the embedding or the loss),
    summing to num_layers.
    """
    v = vpp or 1
    stages = pp * v
    if explicit is not None:
        if len(explicit) != stages:
            raise ValueError(f"--pipeline-layers lists {len(explicit)} stages but the layout has {stages} "
                             f"(--pp {pp} x --vpp {v}): give one layer count per virtual stage")
        if any(n < 0 for n in explicit) or sum(explicit) != num_layers:
            raise ValueError(f"--pipeline-layers {','.join(map(str, explicit))} must be counts >= 0 summing to "
                             f"the number of layers ({num_layers})")
        return list(explicit)
    if pp > num_layers:
        raise ValueError(f"--pp {pp} is larger than the number of layers ({num_layers}): every stage needs a layer")
    if num_layers % pp:
        raise ValueError(f"the number of layers ({num_layers}) is not divisible by --pp ({pp}): choose another "
                         f"--pp or give an explicit split with --pipeline-layers (e.g. one count per stage)")
    per_stage = num_layers // pp
    if per_stage % v:
        raise ValueError(f"--vpp {v} does not divide the layers per pipeline stage ({per_stage} = {num_layers} "
                         f"layers / --pp {pp}): choose a --vpp among the divisors of {per_stage}")
    return [num_layers // stages] * stages


def uneven_stage_counts(num_layers: int, pp: int, vpp: int | None, first: int | None, last: int | None) -> list[int]:
    """Megatron-LM's --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers as one
    count per virtual stage: the first (last) pipeline rank holds `first` (`last`) layers, every other
    rank an even share of the rest, and each rank's layers split evenly over its `vpp` chunks (chunk c
    of rank r is virtual stage c*pp + r)."""
    flags = "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers"
    if pp < 2:
        raise ValueError(f"{flags} size the first and last pipeline stages: they need --pp 2 or more")
    ends = {0: first, pp - 1: last}
    rest = num_layers - sum(n for n in ends.values() if n is not None)
    middle = pp - sum(n is not None for n in ends.values())
    if rest < 0 or (middle and (rest < middle or rest % middle)) or (not middle and rest):
        raise ValueError(f"{flags}: the {max(rest, 0)} layers left of {num_layers} do not split evenly over the "
                         f"{middle} other pipeline stages: change the two counts (or give --pipeline-layers)")
    per_rank = [ends.get(r) if ends.get(r) is not None else rest // middle for r in range(pp)]
    v = vpp or 1
    if any(n < 1 or n % v for n in per_rank):
        raise ValueError(f"{flags}: the stages would hold {','.join(map(str, per_rank))} layers; each needs at least "
                         f"one{f' and a multiple of --vpp {v}' if v > 1 else ''}")
    return [per_rank[s % pp] // v for s in range(pp * v)]


def layers_of(counts: list[int], virtual_stage: int) -> range:
    """Global layer numbers held by one virtual stage."""
    start = sum(counts[:virtual_stage])
    return range(start, start + counts[virtual_stage])
