"""Faults injected on purpose, at named points of a run: the fault soak (scripts/soak.py) and tests.

    MEGALITE_FAULTS="<attempt>:<rank>@<iteration>:<point>[,...]"

fires `point` on global rank `rank` during iteration `iteration` (1-based) of restart attempt
`attempt` (torchrun's TORCHELASTIC_RESTART_COUNT; 0 for the first start), once. `+k` for the
iteration means the first time the point is reached at k or more iterations past the iteration the
attempt resumed from (what a soak needs: it cannot know which checkpoint a restart finds). Points:

| point | where | what |
| --- | --- | --- |
| `step` | after the iteration (and its save) | SIGKILL |
| `term` | after the iteration | SIGTERM to this rank (every rank then saves and stops) |
| `save` | inside a save, after this rank wrote its first tensor | SIGKILL |
| `async-save` | the same, in a --save-async writer thread | SIGKILL |
| `enospc` | the same, in any save | the write fails with ENOSPC (a full disk) |
| `gather` | at the start of a ZeRO-3 parameter gather (its peers are inside it or on their way) | SIGKILL |
| `p2p` | at the start of a pipeline send/receive | SIGKILL |
| `outer` | at the launch of a local SGD outer all-reduce | SIGKILL |

Before it strikes, the rank prints `megalite: fault injected: <point> on rank R in iteration I
(attempt A)` to stderr: the soak counts what fired, not what was asked. With MEGALITE_FAULTS unset,
`point()` is one test of a module global.
"""
from __future__ import annotations

import errno
import os
import signal
import sys

POINTS = ("step", "term", "save", "async-save", "enospc", "gather", "p2p", "outer")
_SPEC = os.environ.get("MEGALITE_FAULTS", "")
_iteration = _start = 0
_fired: set[tuple[str, str]] = set()
_this_process: list[tuple[str, str]] | None = None  # parsed once, at the first iteration


def parse(spec: str) -> list[tuple[int, int, str, str]]:
    """[(attempt, rank, iteration, point)] of a MEGALITE_FAULTS value; the iteration as written
    ("7" or "+3")."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            attempt, where, point = item.split(":")
            rank, iteration = where.split("@")
            fault = (int(attempt), int(rank), iteration, point)
            if int(iteration) < (0 if iteration.startswith("+") else 1):
                raise ValueError
        except ValueError:
            raise ValueError(f"MEGALITE_FAULTS item {item!r} is not <attempt>:<rank>@<iteration>:<point>") from None
        if point not in POINTS:
            raise ValueError(f"MEGALITE_FAULTS point {point!r} is not one of {', '.join(POINTS)}")
        faults.append(fault)
    return faults


def _rank_and_attempt() -> tuple[int, int]:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _mine() -> list[tuple[str, str]]:
    """This process's faults: [(iteration as written, point)] (a bad spec raises here, at the
    loop's first iteration, not inside a hook or a save)."""
    global _this_process
    if _this_process is None:
        rank, attempt = _rank_and_attempt()
        _this_process = [(i, p) for a, r, i, p in parse(_SPEC) if a == attempt and r == rank]
    return _this_process


def set_iteration(iteration: int, start: int | None = None) -> None:
    """The loop says which iteration runs now (the points inside it fire for that iteration) and
    where the run resumed (`+k` counts from there)."""
    global _iteration, _start
    _iteration = iteration
    if start is not None:
        _start = start
    if _SPEC:
        _mine()


def _due(written: str, iteration: int) -> bool:
    return iteration >= _start + int(written[1:]) if written.startswith("+") else iteration == int(written)


def point(name: str, iteration: int | None = None) -> None:
    """Fire the fault named for this rank, iteration and point, if one is (once)."""
    if not _SPEC:
        return
    at = _iteration if iteration is None else iteration
    due = [key for key in _mine() if key[1] == name and key not in _fired and _due(key[0], at)]
    if not due:
        return
    _fired.add(due[0])
    rank, attempt = _rank_and_attempt()
    print(f"megalite: fault injected: {name} on rank {rank} in iteration {at} (attempt {attempt})", file=sys.stderr,
          flush=True)
    if name == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    os.kill(os.getpid(), signal.SIGTERM if name == "term" else signal.SIGKILL)
