"""RNG streams for tensor parallelism.

Two streams per rank:
- the default torch RNG, seeded identically on every TP rank, drives dropout on activations
  that are replicated across TP (after a row-parallel layer), so every rank drops the same units;
- a tracked "model-parallel" stream, seeded differently per TP rank, drives dropout inside the
  TP region (attention probabilities of this rank's heads), so ranks drop different units.
`fork()` swaps the tracked stream in for the duration of a block and saves where it got to.
"""
from __future__ import annotations

import contextlib

import torch

from megalite.parallel import state

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718  # any constant that keeps the TP stream apart from the default one


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class RNGStatesTracker:
    """Named RNG states (CPU and, once CUDA is in use, the current CUDA device)."""

    def __init__(self):
        self._seeds: dict[str, int] = {}
        self._states: dict[str, dict[str, torch.Tensor]] = {}

    def reset(self) -> None:
        self._seeds.clear()
        self._states.clear()

    def add(self, name: str, seed: int) -> None:
        if name in self._seeds:
            raise ValueError(f"RNG state {name!r} already exists")
        self._seeds[name] = seed
        self._states[name] = {"cpu": torch.Generator().manual_seed(seed).get_state()}

    def _cuda_state(self, name: str) -> torch.Tensor:
        if "cuda" not in self._states[name]:
            saved = torch.cuda.get_rng_state()
            torch.cuda.manual_seed(self._seeds[name])
            self._states[name]["cuda"] = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(saved)
        return self._states[name]["cuda"]

    def get_states(self) -> dict:
        return {name: dict(s) for name, s in self._states.items()} | {"_seeds": dict(self._seeds)}

    def set_states(self, states: dict) -> None:
        states = dict(states)
        self._seeds = dict(states.pop("_seeds"))
        self._states = {name: dict(s) for name, s in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self._states:
            if state.get_tensor_model_parallel_world_size() == 1:
                yield  # one TP rank: the default stream serves; nothing to keep apart
                return
            raise RuntimeError(
                f"RNG state {name!r} is not set: call megalite.parallel.model_parallel_manual_seed(seed) first"
            )
        use_cuda = _cuda_in_use()
        saved_cpu = torch.get_rng_state()
        torch.set_rng_state(self._states[name]["cpu"])
        if use_cuda:
            saved_cuda = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(self._cuda_state(name))
        try:
            yield
        finally:
            self._states[name]["cpu"] = torch.get_rng_state()
            torch.set_rng_state(saved_cpu)
            if use_cuda:
                self._states[name]["cuda"] = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(saved_cuda)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default RNG alike on all ranks and the TP stream per TP rank."""
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + state.get_tensor_model_parallel_rank())
