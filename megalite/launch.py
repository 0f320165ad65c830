"""`torchrun` that lets the workers save before they stop.

    python -m megalite.launch --nproc_per_node 8 pretrain_gpt.py --tp 4 --save ckpt --load ckpt

Takes torchrun's arguments unchanged. The one difference: SIGTERM and SIGUSR1 sent to the launcher
(Slurm's preemption warning, `kill`, a cluster scheduler) are handed to the workers and the launcher
keeps waiting. The workers finish their iteration, save, and exit 0, so the launcher exits 0.
Plain torchrun instead raises on SIGTERM (exit 1 with a traceback of its own), and kills workers
that are still saving after its 30 s grace period. SIGINT (Ctrl-C) keeps torchrun's behaviour.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

FORWARDED = (signal.SIGTERM, signal.SIGUSR1)


def worker_pids(pid: int | None = None) -> list[int]:
    """The child processes of `pid` (default: this process), from /proc."""
    pid = pid or os.getpid()
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children += [int(c) for c in task.read_text().split()]
        except OSError:  # the thread ended while we read
            continue
    return children


def _forward(signum, frame) -> None:
    name = signal.Signals(signum).name
    print(f"megalite.launch: {name} received: handed to the workers, which save and stop", file=sys.stderr, flush=True)
    for pid in worker_pids():
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # torchrun installs its own handler (raise, then kill the workers) for the signals it is told
    # to handle: not for the ones we forward.
    if not any(a.startswith(("--signals-to-handle", "--signals_to_handle")) for a in argv):
        argv = ["--signals-to-handle", "SIGINT,SIGHUP,SIGQUIT", *argv]
    for sig in FORWARDED:
        signal.signal(sig, _forward)
    from torch.distributed.run import main as torchrun_main

    torchrun_main(argv)


if __name__ == "__main__":
    main()
