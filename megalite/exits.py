"""When to stop: signals, time limits, --exit-interval and failed background saves, agreed by every
rank without stalling the device.

The flags travel in a host-side all-reduce over a gloo group of their own, started after
iteration i and read after iteration i+1: the GPU never waits for it and the host rarely does
(the all-reduce had a whole iteration to finish). Every rank reads the same all-reduce, so every
rank stops after the same iteration, one iteration after the first rank raised a flag.
"""
from __future__ import annotations

import signal
import time
from typing import Callable

import torch
import torch.distributed as dist

from megalite.parallel import traffic
from megalite.parallel.state import built_group
from megalite.runtime import TrainingStopped, note_stop_signal

_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # SIGUSR1: Slurm's `--signal=B:USR1@120` preemption warning


class ExitWatch:
    """`reason(iteration)` after each iteration: why every rank stops now, or None."""

    def __init__(self, cfg, checkpoint_error: Callable[[], str | None] = lambda: None,
                 watch_checkpoints: bool = False):
        self.cfg, self.start = cfg, time.monotonic()
        self.checkpoint_error = checkpoint_error
        self.signal_name: str | None = None
        if not cfg.training.no_exit_signal_handler:
            for sig in _SIGNALS:
                signal.signal(sig, self._on_signal)
        # Nothing can raise a flag without a signal handler, a time limit or background saves.
        self.needed = (not cfg.training.no_exit_signal_handler or cfg.training.exit_duration_in_mins is not None
                       or watch_checkpoints)
        # collective: every rank; the next run in this process (tests) takes the same group again
        self.group = (built_group("exit_flags", list(range(dist.get_world_size())), backend="gloo")
                      if self.needed else None)
        self._pending: tuple[torch.Tensor, dist.Work] | None = None
        self.exchanges = 0  # flag all-reduces started (tests count them)

    def _on_signal(self, signum, frame):
        self.signal_name = signal.Signals(signum).name
        note_stop_signal()

    def _local_flags(self) -> torch.Tensor:
        a = self.cfg
        limit = a.training.exit_duration_in_mins
        late = limit is not None and time.monotonic() - self.start >= 60 * limit
        flags = torch.tensor([self.signal_name is not None, late, self.checkpoint_error() is not None],
                             dtype=torch.float32)
        flags._megalite_host_side = True  # a CPU tensor in every run: reading it never waits on a GPU
        return flags

    def _agreed_flags(self) -> list[float] | None:
        """The flags all-reduced since the previous call (None the first time); starts the next."""
        agreed = None
        if self._pending is not None:
            flags, work = self._pending
            work.wait()
            agreed = flags.tolist()
        flags = self._local_flags()
        self._pending = (flags, traffic.counted_all_reduce("metrics", flags, self.group, op=dist.ReduceOp.MAX,
                                                           async_op=True))
        self.exchanges += 1
        return agreed

    def reason(self, iteration: int) -> str | None:
        """Why to stop after `iteration` (1-based), the same on every rank; None to go on. A failed
        background save raises TrainingStopped on every rank instead."""
        a = self.cfg
        agreed = self._agreed_flags() if self.needed else None
        if agreed is not None and agreed[2] > 0:
            error = self.checkpoint_error() or "a background checkpoint save failed on another rank (see its error)"
            raise TrainingStopped(error)
        if a.training.exit_interval and iteration % a.training.exit_interval == 0:
            return f"--exit-interval {a.training.exit_interval}"
        if agreed is not None and agreed[0] > 0:
            return f"signal {self.signal_name or 'received by another rank'}"
        if agreed is not None and agreed[1] > 0:
            return f"--exit-duration-in-mins {a.training.exit_duration_in_mins}"
        return None

    def close(self) -> None:
        """Wait for the last flag exchange, so every rank leaves the group with nothing in flight."""
        if self._pending is not None:
            self._pending[1].wait()
            self._pending = None
