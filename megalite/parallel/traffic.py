"""Bytes on the wire: what this rank sends for each collective megalite calls, summed by kind.

Every collective call site in megalite adds its volume here as it launches, from tensor sizes
alone (host arithmetic: no device sync, so it is always on). Volumes are those of the
bandwidth-optimal ring algorithms, per rank, over a group of n ranks and a tensor of B bytes:
all-reduce 2 (n-1)/n B; reduce-scatter and all-gather (n-1)/n B of the whole tensor; all-to-all
(n-1)/n B; broadcast (n-1)/n B (the group's n-1 copies shared evenly); a point-to-point send B.
A group of one rank sends nothing. `take()` returns the sums since the last take and starts anew;
the training loop takes them at step boundaries (docs/communication.md).

Kinds: "tp" (tensor-parallel all-reduces, vocab-parallel cross-entropy), "sp" (sequence-parallel
all-gathers / reduce-scatters and the all-reduce of sequence-parallel gradients), "cp" (context
parallelism), "ep" (expert parallelism's token dispatch: the rows an all-to-all sends to other ranks,
the padded rows of its variable all-gathers), "pp" (stage-to-stage sends), "dp" (gradient reduction, parameter all-gathers of
the distributed optimizer and ZeRO), "embedding" (the tied word embedding's gradient summed over
the first and last stage), "metrics" (token counts, loss, grad norm, exit flags), "fp8" (FP8's amax
reductions: megalite.parallel.fp8_linear, megalite.models.fp8).
"""
from __future__ import annotations

from contextlib import contextmanager
from fractions import Fraction

KINDS = ("tp", "sp", "cp", "ep", "pp", "dp", "embedding", "metrics", "fp8")

# (kind, group size) -> multiplier x bytes; group size 0 stands for a point-to-point send (factor 1).
# Integers keep the sums exact; the ring factor (n-1)/n is applied once, in `take`.
_sums: dict[tuple[str, int], int] = {}
_excluded = 0  # > 0 inside `excluded()`: nothing is counted


# (kind, group size) of the last collective megalite launched, counted or not: a failure message
# names it (a lost rank inside a ZeRO-3 gather is not a pipeline send).
_last: list = [None]
_NAMES = {"tp": "a tensor-parallel all-reduce", "sp": "a sequence-parallel all-gather or reduce-scatter",
          "cp": "a context-parallel exchange", "ep": "an expert-parallel all-to-all", "pp": "a pipeline send/recv",
          "dp": "a data-parallel collective (gradient reduction, or the optimizer's or ZeRO's parameter gather)",
          "embedding": "the tied embedding's gradient sum over the first and last stage",
          "metrics": "an all-reduce of metrics (token counts, loss, grad norm, exit flags)",
          "fp8": "an FP8 amax reduction"}


def last_collective() -> str | None:
    """The last collective megalite launched on this rank, in words ('... over 4 ranks'); None yet."""
    if _last[0] is None:
        return None
    kind, size = _last[0]
    return _NAMES.get(kind, kind) + (f" over {size} ranks" if size else "")


def _add(kind: str, group_size: int, nbytes: int) -> None:
    _last[0] = (kind, group_size)
    if _excluded:
        return
    key = (kind, group_size)
    _sums[key] = _sums.get(key, 0) + nbytes


def all_reduce(kind: str, nbytes: int, group_size: int) -> None:
    """An all-reduce of a `nbytes` tensor over `group_size` ranks: 2 (n-1)/n of it sent."""
    if group_size > 1:
        _add(kind, group_size, 2 * nbytes)


def counted_all_reduce(kind: str, tensor, group=None, **kwargs):
    """`torch.distributed.all_reduce(tensor, group=group, **kwargs)`, its bytes counted as `kind`
    (looked up at call time, so megalite.testing.counting_collectives still sees it)."""
    import torch.distributed as dist

    all_reduce(kind, tensor.nbytes, dist.get_world_size(group))
    return dist.all_reduce(tensor, group=group, **kwargs)


def gather_or_scatter(kind: str, whole_nbytes: int, group_size: int) -> None:
    """An all-gather, reduce-scatter, all-to-all or broadcast whose whole tensor (the gathered
    output, the scattered input) holds `whole_nbytes`: (n-1)/n of it sent."""
    if group_size > 1:
        _add(kind, group_size, whole_nbytes)


def send(kind: str, nbytes: int) -> None:
    """A point-to-point send of `nbytes`."""
    _add(kind, 0, nbytes)


def record(kind: str, nbytes_on_wire: int) -> None:
    """Bytes on the wire this rank sends, already reduced to its own share."""
    _add(kind, 0, nbytes_on_wire)


def _volume(group_size: int, total: int) -> Fraction:
    return Fraction(total) if group_size == 0 else Fraction(group_size - 1, group_size) * total


def take() -> dict[str, int]:
    """{kind: bytes sent} since the last take (kinds with nothing sent left out), rounded to whole
    bytes after summing; starts the next count."""
    exact: dict[str, Fraction] = {}
    for (kind, n), total in _sums.items():
        exact[kind] = exact.get(kind, Fraction(0)) + _volume(n, total)
    _sums.clear()
    return {kind: round(exact[kind]) for kind in sorted(exact, key=_order) if exact[kind]}


def _order(kind: str):
    return (KINDS.index(kind), "") if kind in KINDS else (len(KINDS), kind)


@contextmanager
def excluded():
    """Collectives inside the block are not counted (validation, checkpoint saves: they would
    otherwise land in the next training step's count)."""
    global _excluded
    _excluded += 1
    try:
        yield
    finally:
        _excluded -= 1
