"""Automatic restarts: what a restarted job says it lost.

Under `torchrun --max-restarts N` (or a requeued Slurm job) with the restart idiom (`--load` equal to
`--save`), a lost or killed rank makes every rank start again and resume from the latest complete
checkpoint without a person. To say what the fault cost, rank 0 keeps `progress.json` in the save
directory (written atomically after every iteration: the iteration reached and when); the restarted
run compares it with the checkpoint it resumed from and prints one line: the iterations it will
compute again, the seconds of training they took, and the seconds from the last progress to the new
start (detection, restart and loading).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch.distributed as dist

PROGRESS_FILE = "progress.json"


def _restart_idiom(cfg) -> bool:
    c = cfg.checkpoint
    return bool(c.save) and c.load is not None and os.path.abspath(c.load) == os.path.abspath(c.save)


class ProgressRecord:
    """Rank 0's record of how far this run got, in the save directory."""

    def __init__(self, cfg, start_iteration: int):
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        self.path = Path(cfg.checkpoint.save) / PROGRESS_FILE if cfg.checkpoint.save and rank0 else None
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("SLURM_RESTART_COUNT", 0)))
        self.start_iteration, self.started = start_iteration, time.time()

    def after_iteration(self, iteration: int) -> None:
        if self.path is None:
            return
        record = {"iteration": iteration, "time": time.time(), "attempt": self.attempt,
                  "start_iteration": self.start_iteration, "started": self.started}
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)
        except OSError:  # a full disk must not stop training: the checkpoint's own save says so
            pass


def restart_line(cfg, resumed_iteration: int, now: float | None = None) -> str | None:
    """The line a restarted run prints: what the previous attempt reached against where this one
    resumes; None when this is not a restart (no progress record past the checkpoint)."""
    if not _restart_idiom(cfg):
        return None
    try:
        previous = json.loads((Path(cfg.checkpoint.save) / PROGRESS_FILE).read_text())
        reached, last, started, first = (int(previous["iteration"]), float(previous["time"]),
                                         float(previous["started"]), int(previous["start_iteration"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if reached <= resumed_iteration:
        return None
    now = time.time() if now is None else now
    lost = reached - resumed_iteration
    per_iteration = (last - started) / max(reached - first, 1)
    return (f"megalite: restart: the previous attempt reached iteration {reached}; resuming from the checkpoint of "
            f"iteration {resumed_iteration} recomputes {lost} iteration(s) (about {lost * per_iteration:.1f} s of "
            f"training), and {max(now - last, 0.0):.1f} s passed from its last progress to this start")

