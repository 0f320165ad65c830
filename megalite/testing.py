"""Run a function on N ranks (gloo, one process each) and collect every rank's result or failure.

    from megalite.testing import run_ranks
    results = run_ranks(my_check, world_size=4, args=(2,), timeout=120)

`my_check(rank, world_size, *args)` must be importable (defined at module level). Each rank
gets a process group (gloo on CPU), 1 intra-op thread, and is torn down cleanly afterwards.
A failure on any rank raises `RankFailure` naming every rank that failed, with its traceback;
a rank that hangs is killed after `timeout` seconds (or a few seconds after another rank failed).
"""
from __future__ import annotations

import contextlib
import io
import os
import queue
import sys
import tempfile
import time
import traceback
from fractions import Fraction

import torch
import torch.multiprocessing as mp

_GRACE_AFTER_FAILURE_S = 10.0


class RankFailure(RuntimeError):
    pass


# gloo's connectFullMesh fails now and then on a loaded machine ("Connection closed by peer" while
# the ranks connect, before any test code ran; torch's own gloo tests see it too: pytorch#53270).
# A failure there is reported with this mark, and run_ranks spawns the ranks once more.
_INIT_FAILED = "megalite.testing: the process group's initialization failed\n"


def _fail_init_for_tests(rank: int, attempt: int) -> None:
    """MEGALITE_TEST_FAIL_INIT=<rank>[,<rank>...]: their initialization fails in the first spawn (tests)."""
    if attempt == 0 and str(rank) in os.environ.get("MEGALITE_TEST_FAIL_INIT", "").split(","):
        raise RuntimeError("Gloo connectFullMesh failed (injected by MEGALITE_TEST_FAIL_INIT)")


def _rank_main(fn, rank, world_size, store_path, backend, args, results, env, attempt=0):
    import torch
    import torch.distributed as dist

    from megalite.parallel import destroy_model_parallel

    torch.set_num_threads(1)  # many ranks share few cores
    os.environ.setdefault("MEGALITE_QUIET", "1")
    os.environ.update(env or {})  # forked from the fork server, ranks do not see later changes
    faults = sys.modules.get("megalite.faults")
    if faults is not None:  # preloaded: it read MEGALITE_FAULTS at import, before `env` was added
        faults._SPEC = os.environ.get("MEGALITE_FAULTS", "")
    try:
        try:
            _fail_init_for_tests(rank, attempt)
            dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        except Exception:  # noqa: BLE001 - reported as an init failure: run_ranks spawns the ranks again
            results.put((rank, False, _INIT_FAILED + traceback.format_exc()))
            return
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


# The fork server imports these once; every rank of every later call forks from it. Dynamo (about
# 1 s) and the training loop's modules (torch.distributed.checkpoint among them, about 0.3 s on a
# quiet core, 1 s on a busy one): else every rank of every call that trains pays for them.
_PRELOAD = ["torch", "torch._dynamo", "megalite", "megalite.arguments", "megalite.training"]
# What a test module a rank unpickles its function from imports: preloaded when the caller has it.
_PRELOAD_IF_LOADED = ["pytest"]


def process_context():
    """The multiprocessing context ranks start from: the one fork server, its imports preloaded. Other
    processes a test starts should come from it too: a fork server started without the preload list
    would serve every later `run_ranks` without it (there is one per session)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD + [m for m in _PRELOAD_IF_LOADED if m in sys.modules])
    return ctx


def run_ranks(fn, world_size: int, args: tuple = (), timeout: float = 180.0, backend: str = "gloo",
              env: dict | None = None) -> list:
    """Run fn(rank, world_size, *args) on `world_size` ranks, with `env` added to their environment;
    return the per-rank results. If a rank's process group failed to initialize (gloo's connect
    flakes under load: `_INIT_FAILED`), the spawn proves nothing, whatever the other ranks did: all
    the ranks are spawned once more."""
    done = _spawn(fn, world_size, args, timeout, backend, env, attempt=0)
    failed = [out for ok, out in done.values() if not ok and out.startswith(_INIT_FAILED)]
    if failed:
        print(f"megalite.testing: {fn.__name__}: the process group failed to initialize on {len(failed)} "
              f"rank(s); spawning the ranks again", file=sys.stderr)
        done = _spawn(fn, world_size, args, timeout, backend, env, attempt=1)
    failures = {r: out for r, (ok, out) in done.items() if not ok}
    missing = [r for r in range(world_size) if r not in done]
    if failures or missing:
        # The arguments name the case, and the random seed where a test drew one: enough to replay it.
        shown = repr(args) if len(repr(args)) <= 500 else repr(args)[:500] + "..."
        lines = [f"{len(failures) + len(missing)} of {world_size} ranks failed running {fn.__name__}{shown}:"]
        for r in sorted(failures):
            lines.append(f"--- rank {r} ---\n{failures[r]}")
        for r in missing:
            lines.append(f"--- rank {r} --- hung: killed after the timeout ({timeout:.0f} s) or another rank's failure")
        raise RankFailure("\n".join(lines))
    return [torch.load(io.BytesIO(done[r][1]), weights_only=False) for r in range(world_size)]


def _spawn(fn, world_size: int, args: tuple, timeout: float, backend: str, env: dict | None,
           attempt: int) -> dict[int, tuple[bool, object]]:
    """One spawn of the ranks: {rank: (ok, result bytes or traceback)}; a rank that hung is absent."""
    ctx = process_context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="megalite-ranks-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank_main, args=(fn, r, world_size, store, backend, args, results, env, attempt),
                        daemon=True)
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
    return done


# ---------------------------------------------------------------------------------------------
# host synchronizations


_SYNC_METHODS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")


def mark_host_side(t: torch.Tensor) -> torch.Tensor:
    """Mark a tensor that lives on the host even in a GPU run (e.g. flags exchanged over gloo), so
    `count_host_syncs` does not count reading it."""
    t._megalite_host_side = True
    return t


class HostSyncs:
    """What `count_host_syncs` saw: (label, what) per call; `label()` names the moment (a phase)."""

    def __init__(self, label):
        self.label, self.calls = label, []

    def during(self, predicate) -> list[tuple[str, str]]:
        return [c for c in self.calls if predicate(c[0])]


def _megalite_caller() -> str | None:
    """file:line of the innermost megalite frame calling, or None when the call comes from the data
    loader (`megalite/data/`: host tensors by design, built before they move to the device)."""
    frame, where = sys._getframe(2), None
    while frame is not None:
        filename = frame.f_code.co_filename
        if f"{os.sep}megalite{os.sep}data{os.sep}" in filename:
            return None
        if where is None and f"{os.sep}megalite{os.sep}" in filename and not filename.endswith("testing.py"):
            where = f"{os.path.basename(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return where or "outside megalite"


@contextlib.contextmanager
def count_host_syncs(label=lambda: ""):
    """Count the calls that, on a GPU, make the host wait for the device: reading a tensor's value
    (`.item()`, `.tolist()`, `bool(t)`, `float(t)`, ...), `.cpu()`, `torch.cuda.synchronize()`.
    On CPU nothing waits, but the same calls run, so the count is the GPU run's. Tensors marked
    with `mark_host_side` are not counted."""
    seen = HostSyncs(label)
    originals = {name: getattr(torch.Tensor, name) for name in (*_SYNC_METHODS, "cpu")}
    original_sync = torch.cuda.synchronize

    def wrap(name, fn):
        def counted(self, *a, **k):
            if not getattr(self, "_megalite_host_side", False) and not counting[0]:
                where = _megalite_caller()
                if where is not None:
                    seen.calls.append((seen.label(), f"Tensor.{name} at {where}"))
            counting[0] += 1  # nested calls (tolist -> item) count once
            try:
                return fn(self, *a, **k)
            finally:
                counting[0] -= 1
        return counted

    counting = [0]
    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    torch.cuda.synchronize = lambda *a, **k: seen.calls.append((seen.label(), f"torch.cuda.synchronize at "
                                                                             f"{_megalite_caller()}"))
    try:
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        torch.cuda.synchronize = original_sync


# ---------------------------------------------------------------------------------------------
# bytes on the wire


def ring_bytes(kind: str, nbytes: int, group_size: int) -> Fraction:
    """Bytes one rank sends in a ring collective over `nbytes` (all-reduce = reduce-scatter +
    all-gather, each sending (n-1)/n of the data)."""
    share = Fraction(group_size - 1, group_size) * nbytes
    return 2 * share if kind == "all_reduce" else share


@contextlib.contextmanager
def counting_collectives(record, dp_buffers_only: bool = False):
    """Inside the block, every collective megalite's gradient and parameter paths call (bucket
    all-reduces, reduce-scatters, all-gathers of the DP buffers, and, unless `dp_buffers_only`,
    any `dist.all_reduce`) also calls `record(kind, bytes of the whole tensor, group size)`."""
    import torch.distributed as dist

    from megalite.optim import buffers as buffers_module

    def counted(kind, fn, nbytes_of):
        def wrapper(*a, group=None, **kw):
            record(kind, nbytes_of(*a), dist.get_world_size(group))
            return fn(*a, group=group, **kw)
        return wrapper

    names = ("_all_reduce", "_reduce_scatter_single", "_all_gather_single")
    saved = dist.all_reduce, *(getattr(buffers_module, n) for n in names)
    if not dp_buffers_only:
        dist.all_reduce = counted("all_reduce", saved[0], lambda t: t.nbytes)
    buffers_module._all_reduce = counted("all_reduce", saved[1], lambda t: t.nbytes)
    buffers_module._reduce_scatter_single = counted("reduce_scatter", saved[2], lambda out, inp: inp.nbytes)
    buffers_module._all_gather_single = counted("all_gather", saved[3], lambda out, inp: out.nbytes)
    try:
        yield
    finally:
        dist.all_reduce = saved[0]
        for name, fn in zip(names, saved[1:]):
            setattr(buffers_module, name, fn)


def gradient_traffic(cfg, world: int) -> tuple[Fraction, Fraction, bool]:
    """(bytes this rank sends, the minimum for its layout, whether it holds a tied-embedding
    bucket) in one step's gradient reduction and,
    with the distributed optimizer, the parameter all-gather: collectives wrapped and counted.
    The minimum: each buffer's gradients reduced once (reduce-scatter with the distributed
    optimizer, else all-reduce), its parameters all-gathered once (distributed optimizer), and the
    tied embedding summed once over the embedding group. Call inside a process group."""
    import torch.distributed as dist

    from megalite import parallel, training
    from megalite.models import GPTModel
    from megalite.optim import finalize_grads
    from megalite.optim.grads import SAME_RANK

    def build_gpt(config, cfg, device, pre_process=True, post_process=True, layer_numbers=None):
        return GPTModel(config, pre_process, post_process, layer_numbers, seed=cfg.training.seed, device=device)

    config, _, device = training.setup(cfg, world)
    task = training.Task(build_gpt, build_data=None, forward_step=training.gpt_forward_step)
    chunks = training.build_model_chunks(task, config, cfg, device)
    buffers, optimizer = training.build_optimizer(cfg, chunks)
    embedding_group = training.tied_embedding_group(cfg)
    sent: list[Fraction] = []
    with counting_collectives(lambda kind, nbytes, n: sent.append(ring_bytes(kind, nbytes, n))):
        for buf in buffers:
            buf.enable_sync()
        finalize_grads(buffers, embedding_group)
        optimizer.publish()
    dp = parallel.get_data_parallel_world_size()
    minimum = Fraction(0)
    for buf in buffers:
        if cfg.data_parallel.use_distributed_optimizer:
            minimum += ring_bytes("reduce_scatter", buf.grad_data.nbytes, dp)
            minimum += ring_bytes("all_gather", buf.param_data.nbytes, dp)
        else:
            minimum += ring_bytes("all_reduce", buf.grad_data.nbytes, dp)
        if embedding_group not in (None, SAME_RANK):
            emb = sum(b.numel for b in buf.buckets if b.deferred) * buf.grad_data.element_size()
            minimum += ring_bytes("all_reduce", emb, dist.get_world_size(embedding_group))
    return sum(sent, Fraction(0)), minimum, any(b.deferred for buf in buffers for b in buf.buckets)
