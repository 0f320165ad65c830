"""Process start-up and shut-down: torch.distributed from torchrun's (or Slurm's) environment,
device choice, and turning usage errors into one clear line and a non-zero exit."""
from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist


class UsageError(ValueError):
    """A problem with the user's arguments, data or files: reported as one line, no traceback."""


class TrainingStopped(RuntimeError):
    """Training cannot go on (e.g. gradients inf/NaN too many times): one line, non-zero exit."""


# What this rank is doing, so that a collective's time-out can say where it hung.
_PHASE = ["start-up"]


def set_phase(name: str) -> None:
    _PHASE[0] = name


def _lost_peer(e: BaseException) -> str | None:
    """'timed out' or 'lost contact' when a collective failed because another rank is gone."""
    text = f"{type(e).__name__} {e}".lower()
    if "timed out" in text or "timeout" in text or "deadline" in text:
        return "timed out"
    if any(w in text for w in ("connection closed", "connection reset", "broken pipe", "peer", "socket")):
        return "lost contact with another rank"
    return None


def env_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's variables, else Slurm's, else one process."""
    env = os.environ
    if dist.is_initialized():  # already in a group (tests, notebooks): that is the truth
        return dist.get_rank(), dist.get_world_size(), int(env.get("LOCAL_RANK", dist.get_rank()))
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "MASTER_ADDR" in env:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    return 0, 1, 0


def init_distributed(timeout_minutes: float = 10.0) -> torch.device:
    """Join the process group (NCCL when this rank has a GPU, else gloo); return this rank's device."""
    rank, world, local_rank = env_world()
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if world == 1:
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=timeout_minutes)
        )
        if world > 1:
            start_heartbeat()
    return device


_HEARTBEAT_PERIOD_S = 1.0
_heartbeat_stop = threading.Event()


def start_heartbeat() -> None:
    """Every rank refreshes megalite/alive/<rank> in the rendezvous store each second, from a
    daemon thread, so that when a collective fails the survivors can tell which ranks are gone."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store, no names in failure messages
        return
    rank = dist.get_rank()
    key = f"megalite/alive/{rank}"
    store.set(key, repr(time.time()))
    _heartbeat_stop.clear()

    def beat():
        while not _heartbeat_stop.wait(_HEARTBEAT_PERIOD_S):
            try:
                store.set(key, repr(time.time()))
            except Exception:  # noqa: BLE001 - the store is gone; the failure path reports it
                return

    threading.Thread(target=beat, daemon=True, name="megalite-heartbeat").start()


def lost_ranks(wait_s: float = 8.0) -> str:
    """Which ranks stopped beating: 'rank 2, rank 3', or why that cannot be told."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=3))
        world = dist.get_world_size()
        deadline = time.monotonic() + wait_s
        while True:
            beats = {r: float(store.get(f"megalite/alive/{r}")) for r in range(world)}
            newest = max(beats.values())
            stale = [r for r, t in beats.items() if newest - t > 3.5 * _HEARTBEAT_PERIOD_S]
            if stale or time.monotonic() > deadline:
                return ", ".join(f"rank {r}" for r in stale) or "none found stale (a rank may hang)"
            time.sleep(0.5)
    except Exception:  # noqa: BLE001
        return "rank 0 or its host (the rendezvous store there does not answer)"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def say(*parts, all_ranks: bool = False) -> None:
    """Print from global rank 0 (or every rank), flushed, unless MEGALITE_QUIET is set."""
    if os.environ.get("MEGALITE_QUIET"):
        return
    rank = dist.get_rank() if dist.is_initialized() else env_world()[0]
    if all_ranks or rank == 0:
        print(*parts, flush=True)


def _tell_torchrun(message: str) -> None:
    """torchrun's failure summary shows a worker's error file: put our one line there, not a
    pointer to how to enable tracebacks."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)


def _fail(message: str, code: int, show: bool) -> int:
    if show:
        print(message, file=sys.stderr, flush=True)
    _tell_torchrun(message)
    return code


def run_main(fn, *args) -> int:
    """Run fn(*args) as a rank's whole life: usage errors become one line on stderr (printed once
    per node) and exit code 2; the process group is always torn down."""
    code = 0
    try:
        fn(*args)
    except UsageError as e:  # the same on every rank: once per node
        code = _fail(f"megalite: error: {e}", 2, env_world()[2] == 0)
    except TrainingStopped as e:  # agreed by every rank: once per job
        code = _fail(f"megalite: error: {e}", 3, env_world()[0] == 0)
    except Exception as e:
        what = _lost_peer(e)
        if what is None:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if _PHASE[0] == "start-up":  # no heartbeats yet: most often the wrong network interface
            hint = ("check that every node reaches MASTER_ADDR and that GLOO_SOCKET_IFNAME / "
                    "NCCL_SOCKET_IFNAME name the interface between nodes")
        else:
            hint = f"lost: {lost_ranks()}"
        code = _fail(f"megalite: error: rank {env_world()[0]} {what} in {_PHASE[0]} ({hint}); "
                     f"limit: --distributed-timeout-minutes. {first[:300]}", 4, True)
    finally:
        from megalite.parallel import destroy_model_parallel

        _heartbeat_stop.set()
        destroy_model_parallel()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group after a failure must not mask it
                pass
    return code
