"""Run a function on N ranks (gloo, one process each) and collect every rank's result or failure.

    from megalite.testing import run_ranks
    results = run_ranks(my_check, world_size=4, args=(2,), timeout=120)

`my_check(rank, world_size, *args)` must be importable (defined at module level). Each rank
gets a process group (gloo on CPU), 1 intra-op thread, and is torn down cleanly afterwards.
A failure on any rank raises `RankFailure` naming every rank that failed, with its traceback;
a rank that hangs is killed after `timeout` seconds (or a few seconds after another rank failed).
"""
from __future__ import annotations

import io
import os
import queue
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

_GRACE_AFTER_FAILURE_S = 10.0


class RankFailure(RuntimeError):
    pass


def _rank_main(fn, rank, world_size, store_path, backend, args, results, env):
    import torch
    import torch.distributed as dist

    from megalite.parallel import destroy_model_parallel

    torch.set_num_threads(1)  # many ranks share few cores
    os.environ.setdefault("MEGALITE_QUIET", "1")
    os.environ.update(env or {})  # forked from the fork server, ranks do not see later changes
    try:
        dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        # By value: tensors sent as shared memory would vanish with this process.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _context():
    ctx = mp.get_context("forkserver")
    # The fork server imports torch once; every rank of every later call forks from it.
    ctx.set_forkserver_preload(["torch", "megalite"])
    return ctx


def run_ranks(fn, world_size: int, args: tuple = (), timeout: float = 180.0, backend: str = "gloo",
              env: dict | None = None) -> list:
    """Run fn(rank, world_size, *args) on `world_size` ranks, with `env` added to their environment;
    return the per-rank results."""
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="megalite-ranks-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank_main, args=(fn, r, world_size, store, backend, args, results, env), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        done: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(done) < world_size and time.monotonic() < deadline:
                try:
                    rank, ok, out = results.get(timeout=0.2)
                    done[rank] = (ok, out)
                    if not ok:  # the others are likely stuck in a collective now
                        deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
                except queue.Empty:
                    for r, p in enumerate(procs):
                        if r not in done and p.exitcode not in (None, 0):
                            done[r] = (False, f"process exited with code {p.exitcode} before reporting")
                            deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
        finally:
            for p in procs:
                p.join(timeout=5 if len(done) == world_size else 0)
                if p.is_alive():
                    p.kill()
                    p.join()
    failures = {r: out for r, (ok, out) in done.items() if not ok}
    missing = [r for r in range(world_size) if r not in done]
    if failures or missing:
        lines = [f"{len(failures) + len(missing)} of {world_size} ranks failed running {fn.__name__}:"]
        for r in sorted(failures):
            lines.append(f"--- rank {r} ---\n{failures[r]}")
        for r in missing:
            lines.append(f"--- rank {r} --- hung: killed after the timeout ({timeout:.0f} s) or another rank's failure")
        raise RankFailure("\n".join(lines))
    return [torch.load(io.BytesIO(done[r][1]), weights_only=False) for r in range(world_size)]
