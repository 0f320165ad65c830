"""RNG streams for tensor parallelism.

Two streams per rank:
- the default torch RNG, seeded identically on every TP rank, drives dropout on activations
  that are replicated across TP (after a row-parallel layer), so every rank drops the same units;
- a tracked "model-parallel" stream, seeded differently per TP rank, drives dropout inside the
  TP region (attention probabilities of this rank's heads), so ranks drop different units.
`fork()` swaps the tracked stream in for the duration of a block and saves where it got to.
Forks nest: an inner fork of the stream already forked continues its sequence (it neither
replays the outer fork's draws nor skips them), and an inner fork of another stream hands the
outer one back where it stopped.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from megalite.parallel import state

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718  # any constant that keeps the TP stream apart from the default one


@dataclass(frozen=True)
class _Device:
    """How to read, write and freshly seed one kind of device's global RNG state."""
    get: Callable[[], torch.Tensor]
    set: Callable[[torch.Tensor], None]
    seeded: Callable[[int], torch.Tensor]


def _cpu_seeded(seed: int) -> torch.Tensor:
    return torch.Generator().manual_seed(seed).get_state()


def _cuda_seeded(seed: int) -> torch.Tensor:
    saved = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(seed)
    seeded = torch.cuda.get_rng_state()
    torch.cuda.set_rng_state(saved)
    return seeded


_CPU = _Device(torch.get_rng_state, torch.set_rng_state, _cpu_seeded)
_CUDA = _Device(torch.cuda.get_rng_state, torch.cuda.set_rng_state, _cuda_seeded)


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _devices_in_use() -> dict[str, _Device]:
    """The RNGs a fork swaps: the CPU's always, the current CUDA device's once CUDA is in use.
    Every kind goes through the same code, so the CPU tests cover the CUDA path too."""
    return {"cpu": _CPU, "cuda": _CUDA} if _cuda_in_use() else {"cpu": _CPU}


class RNGStatesTracker:
    """Named RNG states (CPU and, once CUDA is in use, the current CUDA device)."""

    def __init__(self):
        self._seeds: dict[str, int] = {}
        self._states: dict[str, dict[str, torch.Tensor]] = {}
        self._live: list[str] = []  # forked streams, innermost last: the last one is in the global RNGs

    def reset(self) -> None:
        self._seeds.clear()
        self._states.clear()

    def add(self, name: str, seed: int) -> None:
        if name in self._seeds:
            raise ValueError(f"RNG state {name!r} already exists")
        self._seeds[name] = seed
        self._states[name] = {"cpu": _CPU.seeded(seed)}

    def get_states(self) -> dict:
        self._store_live(_devices_in_use())  # a stream forked now has moved on since it was swapped in
        return {name: dict(s) for name, s in self._states.items()} | {"_seeds": dict(self._seeds)}

    def set_states(self, states: dict) -> None:
        states = dict(states)
        self._seeds = dict(states.pop("_seeds"))
        self._states = {name: dict(s) for name, s in states.items()}
        if self._live and self._live[-1] in self._states:  # the forked stream takes the new state too
            self._load(self._live[-1], _devices_in_use())

    def _load(self, name: str, devices: dict[str, _Device]) -> None:
        """Put stream `name` into the global RNGs (a device seen for the first time starts from the seed)."""
        saved = self._states[name]
        for kind, device in devices.items():
            if kind not in saved:
                saved[kind] = device.seeded(self._seeds[name])
            device.set(saved[kind])

    def _store_live(self, devices: dict[str, _Device]) -> None:
        """Record where the stream now in the global RNGs has got to."""
        if self._live and self._live[-1] in self._states:
            self._states[self._live[-1]].update({kind: device.get() for kind, device in devices.items()})

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Draw from stream `name` inside the block; the stream that was live before (the default
        one, or an outer fork's) continues afterwards from where it stopped."""
        if name not in self._states:
            if state.get_tensor_model_parallel_world_size() == 1:
                yield  # one TP rank: the default stream serves; nothing to keep apart
                return
            raise RuntimeError(
                f"RNG state {name!r} is not set: call megalite.parallel.model_parallel_manual_seed(seed) first"
            )
        devices = _devices_in_use()
        default = {kind: device.get() for kind, device in devices.items()} if not self._live else None
        self._store_live(devices)  # an outer fork (of this stream or another) resumes from here
        self._load(name, devices)
        self._live.append(name)
        try:
            yield
        finally:
            self._store_live(devices)
            self._live.pop()
            if default is not None:
                for kind, device in devices.items():
                    device.set(default[kind])
            elif self._live[-1] in self._states:
                self._load(self._live[-1], devices)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default RNG alike on all ranks and the TP stream per TP rank."""
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + state.get_tensor_model_parallel_rank())
