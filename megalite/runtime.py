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


from megalite.errors import TrainingStopped, UsageError  # noqa: F401 - re-exported: raised everywhere


# What this rank is doing, so that a collective's time-out can say where it hung.
_PHASE = ["start-up"]
LOST_PEER = 4  # the exit code of a rank that lost contact with another (docs/multinode.md)


def set_phase(name: str) -> None:
    _PHASE[0] = name


# Texts of the errors that gloo, NCCL and the rendezvous store raise when another rank is gone or a
# collective hangs (lower case). Only errors of the types below are read at all: a TypeError that
# mentions a "peer" is a bug with its own traceback, not a lost rank.
_TIMEOUT_TEXTS = ("timed out", "timeout", "deadline exceeded", "watchdog caught collective operation")
_LOST_TEXTS = ("connection closed by peer", "connection reset by peer", "connection refused", "broken pipe",
               "socket", "nccl communicator was aborted", "ncclremoteerror", "remote process exited",
               "ncclsystemerror", "nccl error", "some nccl operations have failed", "process group aborted")
_COMMUNICATION_ERRORS = (RuntimeError, OSError, TimeoutError, getattr(dist, "DistError", RuntimeError))
_NOT_COMMUNICATION = (NotImplementedError, RecursionError)


def _lost_peer(e: BaseException) -> str | None:
    """'timed out' or 'lost contact' when a collective failed because another rank is gone."""
    if not isinstance(e, _COMMUNICATION_ERRORS) or isinstance(e, _NOT_COMMUNICATION):
        return None
    text = f"{type(e).__name__} {e}".lower()
    if any(w in text for w in _TIMEOUT_TEXTS):
        return "timed out"
    if isinstance(e, (ConnectionError, getattr(dist, "DistNetworkError", ConnectionError))) or any(
            w in text for w in _LOST_TEXTS):
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


def select_device() -> torch.device:
    """This rank's device, made current before anything touches CUDA: otherwise the first CUDA
    call (a kernel build, a seed) opens a context on GPU 0 from every local rank."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", env_world()[2] % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def init_distributed(timeout_minutes: float = 10.0) -> torch.device:
    """Join the process group (NCCL when this rank has a GPU, else gloo); return this rank's device."""
    rank, world, _ = env_world()
    device = select_device()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if world == 1:
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        timeout = datetime.timedelta(minutes=timeout_minutes)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, store=_restart_store(world, timeout))
        if world > 1:
            start_heartbeat()
    return device


def _restart_store(world: int, timeout: datetime.timedelta):
    """After torchrun restarts the workers (--max-restarts), its agent's store still holds the keys
    of the attempt before (the dead ranks' addresses, megalite's own records): each later attempt
    uses a prefix of its own. None (the usual env:// store) for a first attempt or outside torchrun."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                         timeout=timeout)
    return dist.PrefixStore(f"megalite/attempt_{attempt}/", base)


_HEARTBEAT_PERIOD_S = 1.0
_heartbeat_stop = threading.Event()
_stop_signal = threading.Event()  # SIGTERM/SIGUSR1 arrived (megalite.exits): waits on peers turn short


def note_stop_signal() -> None:
    _stop_signal.set()


def stop_signal_received() -> bool:
    """A stop signal reached this rank: a preemption (every rank got it and lives on) or torchrun
    tearing the job down because a rank died (waits for a dead rank must end before its grace
    period does)."""
    return _stop_signal.is_set()


def heartbeat_timeout_s() -> float:
    """How long a rank may go without a heartbeat before its neighbour declares it lost."""
    return float(os.environ.get("MEGALITE_HEARTBEAT_TIMEOUT_S", "60"))


def start_heartbeat() -> None:
    """Every rank refreshes megalite/alive/<rank> in the rendezvous store each second, from a
    daemon thread, so that when a collective fails the survivors can tell which ranks are gone.

    The same thread watches one neighbour (rank + 1, a ring, so the store serves O(world) reads):
    a neighbour whose beat is older than `heartbeat_timeout_s()` and that did not finish is lost.
    That catches a dead rank even where collectives never block the host (NCCL queues them and
    its watchdog would abort the process with a message of its own much later): this rank then
    ends with megalite's one line and exit code 4."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store, no names in failure messages
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    key = f"megalite/alive/{rank}"
    store.set(key, repr(time.time()))
    _heartbeat_stop.clear()
    neighbour = (rank + 1) % world
    timeout = heartbeat_timeout_s()

    def beat():
        seen_at, last_beat = time.monotonic(), None
        while not _heartbeat_stop.wait(_HEARTBEAT_PERIOD_S):
            try:
                store.set(key, repr(time.time()))
                if neighbour == rank or store.check([f"megalite/done/{neighbour}"]):
                    continue
                value = store.get(f"megalite/alive/{neighbour}")
            except Exception:  # noqa: BLE001 - the store is gone; the failure path reports it
                return
            if value != last_beat:  # compare to our own clock: hosts' clocks need not agree
                seen_at, last_beat = time.monotonic(), value
            elif time.monotonic() - seen_at > timeout and not _heartbeat_stop.is_set():
                _fail(f"megalite: error: rank {rank} lost contact with another rank in {_PHASE[0]} (lost: rank "
                      f"{neighbour}, no heartbeat for {timeout:.0f} s); limit: MEGALITE_HEARTBEAT_TIMEOUT_S",
                      LOST_PEER, True)
                os._exit(LOST_PEER)

    threading.Thread(target=beat, daemon=True, name="megalite-heartbeat").start()


def stop_heartbeat() -> None:
    """This rank is done (finished or failed on its own): its neighbour must not call it lost."""
    _heartbeat_stop.set()
    try:
        if dist.is_initialized():
            dist.distributed_c10d._get_default_store().set(f"megalite/done/{dist.get_rank()}", "1")
    except Exception:  # noqa: BLE001 - no store: nobody is watching either
        pass


def lost_ranks(wait_s: float = 8.0) -> str:
    """Which ranks stopped beating: 'rank 2, rank 3', or why that cannot be told."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=3))
        world = dist.get_world_size()
    except Exception:  # noqa: BLE001
        return "rank 0 or its host (the rendezvous store there does not answer)"
    deadline, answered = time.monotonic() + wait_s, False
    while True:
        try:
            beats = {r: float(store.get(f"megalite/alive/{r}")) for r in range(world)}
            answered = True
        except Exception:  # noqa: BLE001 - a slow reply on a loaded host: ask again until the deadline
            beats = None
        if beats is not None:
            newest = max(beats.values())
            stale = [r for r, t in beats.items() if newest - t > 3.5 * _HEARTBEAT_PERIOD_S]
            if stale or time.monotonic() > deadline:
                return ", ".join(f"rank {r}" for r in stale) or "none found stale (a rank may hang)"
        elif time.monotonic() > deadline:
            return ("rank 0 or its host (the rendezvous store there does not answer)" if not answered
                    else "none found stale (the rendezvous store stopped answering)")
        time.sleep(0.5)


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


def tell_torchrun(message: str) -> None:
    """torchrun's failure summary shows a worker's error file: put our one line there, not a
    pointer to how to enable tracebacks."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)


_USAGE_ERROR_GRACE_S = 5.0


def _fail(message: str, code: int, show: bool) -> int:
    if show:
        print(message, file=sys.stderr, flush=True)
    tell_torchrun(message)
    return code


_FIRST_ERROR_KEY = "megalite/first_error"


def _store():
    store = dist.distributed_c10d._get_default_store()
    store.set_timeout(datetime.timedelta(seconds=5))
    return store


def _node() -> str:
    """This rank's node: torchrun's GROUP_RANK, else Slurm's SLURM_NODEID, else the host name
    (containers may share one)."""
    import socket

    for name in ("GROUP_RANK", "SLURM_NODEID"):
        if os.environ.get(name) is not None:
            return f"{name}={os.environ[name]}"
    return socket.gethostname()


def _claim_first_error(line: str) -> dict | None:
    """Record `line` in the rendezvous store as the job's first error unless a rank did so before;
    return the record that stands ({"line", "rank", "host": its node}), None without a process group or store."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    mine = json.dumps({"line": line, "rank": dist.get_rank(), "host": _node()})
    try:
        return json.loads(_store().compare_set(_FIRST_ERROR_KEY, "", mine).decode())
    except Exception:  # noqa: BLE001 - no store (or it is gone): each rank decides alone
        return None


def _recorded_first_error() -> dict | None:
    """The job's first error if a rank recorded one (see `_claim_first_error`)."""
    try:
        store = _store()
        return json.loads(store.get(_FIRST_ERROR_KEY).decode()) if store.check([_FIRST_ERROR_KEY]) else None
    except Exception:  # noqa: BLE001
        return None


def _shows(record: dict | None, line: str, fallback: bool) -> bool:
    """Whether this rank prints `line`: the rank that recorded the first error does (whichever rank
    it is); the same line from another rank is printed once on each other node (each node's log
    gets it); another rank's different error is not (the first one is the cause). Without a record,
    `fallback`."""
    if record is None:
        return fallback
    if record["rank"] == dist.get_rank():
        return True
    return record["line"] == line and record["host"] != _node() and env_world()[2] == 0


def _lost_line(e: BaseException, what: str) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if _PHASE[0] == "start-up":  # no heartbeats yet: most often the wrong network interface
        hint = ("check that every node reaches MASTER_ADDR and that GLOO_SOCKET_IFNAME / "
                "NCCL_SOCKET_IFNAME name the interface between nodes")
    else:
        hint = f"lost: {lost_ranks()}"
    from megalite.parallel import traffic

    last = traffic.last_collective()
    during = f", the last collective launched {last}" if last else ""
    return (f"megalite: error: rank {env_world()[0]} {what} in {_PHASE[0]}{during} ({hint}); "
            f"limit: --distributed-timeout-minutes. {first[:300]}")


def run_main(fn, *args) -> int:
    """Run fn(*args) as a rank's whole life: usage errors become one line on stderr and exit code 2,
    whichever rank raised them: the first recorded is printed once (on each node when every rank
    raised it); a rank that stops because another failed prints nothing more. The process group is
    always torn down."""
    code = 0
    try:
        fn(*args)
    except UsageError as e:  # raised by any rank, perhaps by all: its first line, once (per node)
        line = f"megalite: error: {e}"
        show = _shows(_claim_first_error(line), line, env_world()[2] == 0)
        code = _fail(line, 2, show)
        if not show:
            # torchrun stops a node's workers as soon as one exits: the others wait, so that the one
            # that prints (perhaps slower to get here) is not stopped before it does.
            time.sleep(_USAGE_ERROR_GRACE_S)
    except TrainingStopped as e:  # agreed by every rank: once per job, by the rank that recorded it
        line = f"megalite: error: {e}"
        record = _claim_first_error(line)
        code = _fail(line, 3, env_world()[0] == 0 if record is None else record["rank"] == dist.get_rank())
    except Exception as e:
        what = _lost_peer(e)
        if what is None:
            raise
        first_error = _recorded_first_error()
        if first_error is not None:  # another rank's error stopped it: that line is the cause, said there
            code = _fail(first_error["line"], LOST_PEER, _shows(first_error, first_error["line"], False))
        else:
            code = _fail(_lost_line(e, what), LOST_PEER, True)
    finally:
        _tear_down(code, bounded=code == LOST_PEER)
    return code


def exit_process(code: int) -> None:
    """End a rank's process with `code` (what run_main returned). After a lost peer (LOST_PEER) without
    Python's shut-down: the groups' transfers to the dead host may still be pending, and the
    interpreter's exit (the groups' destructors) can wait them out one time-out after another (CI
    saw both ranks of the surviving host print their line, tear down, then not exit in 90 s). The
    line is printed, files are closed (`fn` has returned), so nothing is left to run."""
    if code == LOST_PEER:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


# After a lost peer, tearing the groups down may wait on transfers to the dead host (gloo waits out
# each pending operation's time-out in turn): the rank has said why it stops, so it ends this long
# after at most, whatever is still pending.
TEARDOWN_AFTER_LOSS_S = 10.0


def _tear_down(code: int, bounded: bool) -> None:
    def tear_down():
        from megalite.parallel import destroy_model_parallel

        stop_heartbeat()
        destroy_model_parallel()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group after a failure must not mask it
                pass

    if not bounded:
        tear_down()
        return
    worker = threading.Thread(target=tear_down, daemon=True, name="megalite-teardown")
    worker.start()
    worker.join(TEARDOWN_AFTER_LOSS_S)
    if worker.is_alive():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
