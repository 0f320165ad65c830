"""Bytes per GPU: the totals of the fullest pipeline stage (`Memory`). The components' models:
parameters, gradient buffers and optimizer states exactly as megalite allocates them, and the
transient peak of the build (states.py; ZeRO stages 2-3's transient peak of a step: zero_replay.py);
activations held by the schedule, the output layer and multi-token prediction (activations.py).
Their names stay importable from here."""
from __future__ import annotations

from dataclasses import dataclass

from megalite.tools.plan.activations import (
    in_flight_chunks,
    kept_activations,
    mtp_bytes,
    output_layer_bytes,
    stored_activations,
)
from megalite.tools.plan.inputs import GIB
from megalite.tools.plan.states import StateBytes, rank_state_bytes
from megalite.tools.plan.zero_replay import chunk_units

__all__ = [
    "Memory",
    "StateBytes",
    "chunk_units",
    "in_flight_chunks",
    "kept_activations",
    "mtp_bytes",
    "output_layer_bytes",
    "over",
    "rank_state_bytes",
    "stored_activations",
]


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU on the fullest pipeline stage."""
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    output_layer: float
    overhead: float
    total: float
    zero_transient: float = 0.0  # ZeRO stages 2-3: whole-bucket gradients and gathered units (StateBytes.transient)
    experts: float = 0.0  # of parameters + gradients + optimizer: the expert weights' (sharded over EDP)
    mtp: float = 0.0  # of output_layer: the multi-token prediction modules' activations (mtp_bytes)

    @property
    def states(self) -> float:
        """Parameters, gradients and optimizer states: what no micro-batch size changes."""
        return self.parameters + self.gradients + self.optimizer


def over(need: float, capacity: float) -> str:
    """GiB with enough digits to show that it exceeds the capacity."""
    for digits in (1, 2, 3):
        text = f"{need / GIB:.{digits}f}"
        if float(text) > capacity / GIB:
            return text
    return f"{need / GIB:.4f}"
