"""ZeRO stages 2 and 3 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models"): the data-parallel buffers of `buffers.py`, the same layout, less of it
stored on each rank. Stage 1 is `ParamAndGradBuffer(reduce_scatter=True)` with the distributed
optimizer.

Stage 2, `ShardedGradBuffer`, is in `zero2.py`; stage 3, `ShardedParamBuffer`, in `zero3.py`, and the
module hooks that gather its units in `zero3_hooks.py`. Callers import both from here, with `whole_parameters`.
"""
from __future__ import annotations

from contextlib import contextmanager

# The stages live in their own modules; this one is where callers (and tests) import them from.
from megalite.optim.zero2 import MAX_IN_FLIGHT, ShardedGradBuffer
from megalite.optim.zero3 import FREE, GATHERING, WHOLE, ShardedParamBuffer
from megalite.optim.zero3_hooks import _in_backward, attach_unit_hooks, layer_units

__all__ = [
    "FREE", "GATHERING", "MAX_IN_FLIGHT", "WHOLE", "ShardedGradBuffer", "ShardedParamBuffer", "_in_backward",
    "attach_unit_hooks", "layer_units", "whole_parameters",
]


@contextmanager
def whole_parameters(buffers):
    """Every buffer's parameters whole on this rank inside the block (ZeRO-3 gathers; a checkpoint
    save, an export). Collective over the data-parallel group: every DP rank enters it."""
    pinned = [b for b in buffers if not getattr(b, "pinned", False)]
    for b in pinned:
        b.pin()
    try:
        yield
    finally:
        for b in pinned:
            b.unpin()
