"""Saving: this rank's slices into one rank file, committed by rank 0 once every rank's file is out.

Each rank writes `iter_N.tmp/rank_RRRRR.safetensors` (inline, or from a background thread with
--save-async) and reports success or its error in the rendezvous store under a key of this
directory, iteration and save. Rank 0 (a background thread with --save-async) waits for every
rank's report and commits: metadata, rename to `iter_N`, `latest` last; or, if any rank failed,
removes the partial directory and records the one-line failure, which `poll()` shows every rank.
No collective runs after the save's start, so the training loop never waits for the disk.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megalite import parallel
from megalite.checkpoint import lock
from megalite.checkpoint.fileformat import write_rank_file
from megalite.checkpoint.layout import (FORMAT_VERSION, ITER_NAME, VOCAB_PARAMS, config_dict, full_size,
                                        global_name, is_writer, iter_name, placement, rank_file_name)
from megalite.models.config import TransformerConfig
from megalite.parallel.random import get_rng_tracker
from megalite.runtime import TrainingStopped, UsageError

_POLL_S = 0.02
_ALIGN = 64


# ---------------------------------------------------------------------------------------------
# this rank's state as (key, tensor) entries plus a JSON structure


def encode_plain(obj, key: str, add):
    """Nested dicts/lists of tensors and plain values -> JSON, tensors replaced by {"tensor": key}."""
    if torch.is_tensor(obj):
        return {"tensor": add(key, obj)}
    if isinstance(obj, dict):
        return {"dict": {str(k): encode_plain(v, f"{key}/{k}", add) for k, v in obj.items()}}
    if isinstance(obj, (list, tuple)):
        return {"list": [encode_plain(v, f"{key}/{i}", add) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"value": obj}
    raise TypeError(f"{key}: a checkpoint holds tensors and plain data, not {type(obj).__name__}")


def master_is_the_param(piece) -> bool:
    """fp32 training: the master is the parameter's own memory, already stored with the model."""
    return (piece.master.dtype == piece.param.dtype
            and piece.master.data_ptr() == piece.buffer.param_data[piece.lo:piece.hi].data_ptr())


def collect_rank_state(model_chunks, optimizer=None, iteration: int = 0, with_rng: bool = True):
    """This rank's slices: ([(key, tensor)], structure). The tensors are the live ones (no copies):
    write them before training goes on, or snapshot them."""
    tensors: list[tuple[str, torch.Tensor]] = []

    def add(key: str, t: torch.Tensor) -> str:
        tensors.append((key, t.detach()))
        return key

    model: dict = {}
    if parallel.get_data_parallel_rank() == 0:
        for chunk in model_chunks:
            for local, p in chunk.named_parameters():
                if not is_writer(p):
                    continue
                dim, start, keep = placement(chunk, local, p)
                t = p.detach() if keep is None else p.detach().narrow(dim, 0, keep)
                name = global_name(chunk, local)
                model.setdefault(name, []).append({"tensor": add(f"model/{name}", t), "dim": dim, "start": start,
                                                   "full": full_size(chunk, local, p)})
    meta: dict = {"iteration": iteration, "model": model}
    if optimizer is not None:
        meta.update(_collect_optimizer(model_chunks, optimizer, add))
    if with_rng:
        rng = {"cpu": torch.get_rng_state(), "tracker": get_rng_tracker().get_states(),
               "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
        meta["rng"] = encode_plain(rng, "rng", add)
    return tensors, meta


def _collect_optimizer(model_chunks, optimizer, add) -> dict:
    names = {id(p): (chunk, local) for chunk in model_chunks for local, p in chunk.named_parameters()}
    optim: dict = {}
    for piece in optimizer.pieces:
        p = piece.param
        if not is_writer(p) or (not optimizer.distributed and parallel.get_data_parallel_rank() != 0):
            continue
        chunk, local = names[id(p)]
        dim, start, _ = placement(chunk, local, p)
        p_lo, _ = piece.buffer.param_range(p)
        name = global_name(chunk, local)
        st = optimizer.inner.state.get(piece.master, {})
        values = {"master": "model" if master_is_the_param(piece)
                  else add(f"optim/{name}/master", piece.master.reshape(-1))}
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                values[k] = add(f"optim/{name}/{k}", st[k].reshape(-1))
        tp = parallel.get_tensor_model_parallel_world_size()
        optim.setdefault(name, []).append({
            "dim": dim, "start": start, "shard": list(p.shape), "full": None if dim is None else p.shape[dim] * tp,
            "lo": piece.lo - p_lo, "hi": piece.hi - p_lo, "values": values})
    # Fused AdamW keeps each step count on the device: one read for all of them, not one per tensor.
    steps = [torch.as_tensor(s["step"]).float().reshape(()) for s in optimizer.inner.state.values() if "step" in s]
    step = int(torch.stack(steps).max()) if steps else 0
    return {"optim": optim, "step": step, "loss_scaler": optimizer.loss_scaler.state_dict()}


class Snapshot:
    """One contiguous (pinned, with CUDA) host buffer, reused across saves: one copy per tensor."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None

    def take(self, entries):
        offsets, total = [], 0
        for _, t in entries:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        if self.buffer is None or self.buffer.numel() < total:
            self.buffer = None  # let the old one go first
            pin = torch.cuda.is_available() and any(t.is_cuda for _, t in entries)
            self.buffer = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
        out = []
        for (key, t), off in zip(entries, offsets):
            n = t.numel() * t.element_size()
            dst = self.buffer[off:off + n].view(t.dtype).view(t.shape)
            dst.copy_(t, non_blocking=True)
            out.append((key, dst))
        if any(t.is_cuda for _, t in entries):
            torch.cuda.synchronize()
        return out


# ---------------------------------------------------------------------------------------------
# committing


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def iter_dir(directory: Path, iteration: int) -> Path:
    return Path(directory) / iter_name(iteration)


def commit(directory: Path, iteration: int, metadata: dict) -> None:
    """Rank 0, after every rank wrote its file into iter_N.tmp: metadata, rename, `latest`."""
    directory = Path(directory)
    tmp, final = iter_dir(directory, iteration).with_suffix(".tmp"), iter_dir(directory, iteration)
    with open(tmp / "metadata.json", "w") as f:
        json.dump(metadata, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    old = None
    if final.exists():  # saving the same iteration again: keep the old one until the new is in place
        old = final.with_suffix(".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(directory)
    latest_tmp = directory / "latest.tmp"
    with open(latest_tmp, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, directory / "latest")
    _fsync_dir(directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _previous(directory: Path) -> str:
    try:
        name = (directory / "latest").read_text().strip()
    except OSError:
        return "there is no earlier checkpoint"
    return f"the previous checkpoint ({name}) is intact" if ITER_NAME.match(name) else "the previous checkpoint is intact"


def failure_line(directory: Path, iteration: int, detail: str) -> str:
    return (f"checkpoint of iteration {iteration} was not saved: {detail}; {_previous(directory)}; "
            f"free space, fix the permissions, or use another --save")


class _LocalStore:
    """The rendezvous store's few calls, for a process without a process group."""

    def __init__(self):
        self._d: dict[str, bytes] = {}
        self.timeout = datetime.timedelta(minutes=30)

    def set(self, key, value):
        self._d[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self._d[key]

    def check(self, keys):
        return all(k in self._d for k in keys)


def _default_store():
    if dist.is_available() and dist.is_initialized():
        try:
            return dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError, AttributeError):
            pass
    return _LocalStore()


def _wait_for(store, keys, timeout_s: float) -> bool:
    """Poll (store.wait would hold the store client's lock and stall the heartbeat thread)."""
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


@dataclass
class _Save:
    iteration: int
    metadata: dict
    prefix: str  # store keys of this save
    writer: threading.Thread | None = None
    committer: threading.Thread | None = None
    local: dict = field(default_factory=dict)  # this rank's outcome: {"bytes": n} or {"error": text}
    outcome: dict | None = None  # the save's outcome, once known: {"ok": True} or {"error": line}


def _fault_hook(rank: int, iteration: int):
    """Tests make a rank's write fail: MEGALITE_TEST_FAIL_IN_SAVE=<rank>@<iteration>:<errno>."""
    spec = os.environ.get("MEGALITE_TEST_FAIL_IN_SAVE", "")
    where, _, code = spec.partition(":")
    if where != f"{rank}@{iteration}":
        return None

    def fail(_written: int):
        raise OSError(int(code or 28), os.strerror(int(code or 28)))
    return fail


def _crash_hook(rank: int, iteration: int) -> None:
    """Tests kill a rank in the middle of a save: MEGALITE_TEST_CRASH_IN_SAVE=<rank>@<iteration>."""
    if os.environ.get("MEGALITE_TEST_CRASH_IN_SAVE") == f"{rank}@{iteration}":
        os._exit(17)


class Checkpointer:
    """Owns a --save directory for the job's life; saves (inline or in the background) and commits
    from rank 0 as soon as every rank's file is written. `poll()` says, without a collective, whether
    a save failed; `finalize()` waits for the pending commit; `close()` also gives the directory up."""

    def __init__(self, directory: str, async_save: bool = False):
        self.directory = Path(directory)
        self.async_save = async_save
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._world = dist.get_world_size() if dist.is_initialized() else 1
        self._pending: _Save | None = None
        self._saves = 0
        self._snapshot = Snapshot()
        self._lock = None
        refusal = None
        if self._rank == 0:
            try:
                self._lock = lock.acquire(self.directory)
            except lock.DirectoryLocked as e:
                refusal = str(e)
            except OSError as e:
                refusal = f"cannot use --save directory {self.directory}: {e}; give a writable --save directory"
        if self._world > 1:  # every rank raises the same error, or none does
            box = [refusal]
            dist.broadcast_object_list(box, src=0)
            refusal = box[0]
        if refusal:
            raise UsageError(refusal)
        self._store = _default_store()
        self._timeout_s = getattr(self._store, "timeout", datetime.timedelta(minutes=30)).total_seconds()

    # -- the loop's calls

    def save(self, model_chunks, optimizer, iteration: int, metadata: dict) -> None:
        self.finalize()
        tmp = iter_dir(self.directory, iteration).with_suffix(".tmp")
        if self._rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that crashed
            tmp.mkdir(parents=True)
        if self._world > 1:
            dist.barrier()
        entries, structure = collect_rank_state(model_chunks, optimizer, iteration)
        if self.async_save or any(t.device.type != "cpu" for _, t in entries):
            entries = self._snapshot.take(entries)
        self._saves += 1
        # The directory as given: every rank got the same string, whatever its node mounts.
        job = _Save(iteration, metadata, f"megalite/checkpoint/{self.directory}/{iteration}/{self._saves}/")
        self._pending = job
        path = tmp / rank_file_name(self._rank)
        if self.async_save:
            job.writer = threading.Thread(target=self._write, args=(job, path, entries, structure), daemon=True,
                                          name="megalite-checkpoint-writer")
            job.writer.start()
            if self._rank == 0:
                job.committer = threading.Thread(target=self._commit_when_written, args=(job,), daemon=True,
                                                 name="megalite-checkpoint-commit")
                job.committer.start()
        else:
            self._write(job, path, entries, structure)
            if self._rank == 0:
                self._commit_when_written(job)
            self.finalize()

    def poll(self) -> str | None:
        """None while saving goes well (or nothing is pending), else the failed save's one line.
        Cheap and local: a look at this rank's writer and one store lookup."""
        job = self._pending
        if job is None:
            return None
        if job.outcome is None and self._store.check([job.prefix + "outcome"]):
            job.outcome = json.loads(self._store.get(job.prefix + "outcome"))
        if job.outcome is not None:
            return job.outcome.get("error")
        if "error" in job.local:
            return failure_line(self.directory, job.iteration, job.local["error"])
        return None

    def finalize(self) -> None:
        """Wait until the pending save is committed; raise TrainingStopped if it failed."""
        job, self._pending = self._pending, None
        if job is None:
            return
        for thread in (job.writer, job.committer):
            if thread is not None:
                thread.join()
        if job.outcome is None:
            key = job.prefix + "outcome"
            if not _wait_for(self._store, [key], self._timeout_s + 5):
                job.outcome = {"error": failure_line(self.directory, job.iteration,
                                                     "rank 0 did not record the outcome (it stopped or hangs)")}
            else:
                job.outcome = json.loads(self._store.get(key))
        if job.outcome.get("lost"):  # a rank is gone: the lost-rank report (exit 4), not a save error
            raise CheckpointRankLost(job.outcome["error"])
        if "error" in job.outcome:
            raise TrainingStopped(job.outcome["error"])

    def close(self) -> None:
        """finalize() and give the directory up; safe to call twice."""
        try:
            self.finalize()
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    # -- the threads' work

    def _write(self, job: _Save, path: Path, entries, structure) -> None:
        try:
            size = write_rank_file(path, entries, structure, after_bytes=_fault_hook(self._rank, job.iteration))
            _crash_hook(self._rank, job.iteration)
            job.local = {"bytes": size}
        except OSError as e:
            job.local = {"error": f"writing {path} failed: [Errno {e.errno}] {e.strerror}"}
        except Exception as e:  # noqa: BLE001 - reported as the save's failure, never lost
            job.local = {"error": f"writing {path} failed: {type(e).__name__}: {e}"}
        if "error" in job.local:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
        self._store.set(job.prefix + f"rank/{self._rank}", json.dumps(job.local))

    def _commit_when_written(self, job: _Save) -> None:
        tmp = iter_dir(self.directory, job.iteration).with_suffix(".tmp")
        keys = [job.prefix + f"rank/{r}" for r in range(self._world)]
        try:
            if not _wait_for(self._store, keys, self._timeout_s):
                missing = [r for r, k in enumerate(keys) if not self._store.check([k])]
                raise _Lost(f"rank(s) {missing} did not report their file within {self._timeout_s:.0f} s "
                            f"(stopped or hang)")
            reports = [json.loads(self._store.get(k)) for k in keys]
            errors = [r["error"] for r in reports if "error" in r]
            if errors:
                more = f" (and {len(errors) - 1} more rank(s) failed)" if len(errors) > 1 else ""
                raise _Failed(errors[0] + more)
            files = {rank_file_name(r): {"bytes": rep["bytes"]} for r, rep in enumerate(reports)}
            commit(self.directory, job.iteration, {**job.metadata, "files": files})
            outcome = {"ok": True}
        except _Failed as e:
            outcome = {"error": failure_line(self.directory, job.iteration, str(e)), "lost": isinstance(e, _Lost)}
        except Exception as e:  # noqa: BLE001 - metadata/rename failures too
            outcome = {"error": failure_line(self.directory, job.iteration, f"committing {tmp} failed: "
                                             f"{type(e).__name__}: {e}")}
        if "error" in outcome:
            shutil.rmtree(tmp, ignore_errors=True)
        job.outcome = outcome
        self._store.set(job.prefix + "outcome", json.dumps(outcome))


class _Failed(Exception):
    pass


class _Lost(_Failed):
    pass


class CheckpointRankLost(ConnectionError):
    """Ranks that never reported their file: reported like any lost rank (megalite.runtime)."""


# ---------------------------------------------------------------------------------------------
# metadata and single-device checkpoints


def build_metadata(config: TransformerConfig, model_kind: str, iteration: int, consumed_samples: int,
                   layout: dict) -> dict:
    return {"format_version": FORMAT_VERSION, "iteration": iteration, "consumed_samples": consumed_samples,
            "model_kind": model_kind, "config": config_dict(config), "layout": layout}


def save_model_checkpoint(directory, config: TransformerConfig, model_kind: str, state_dict: dict,
                          iteration: int = 0) -> None:
    """A checkpoint from a single-device state dict (names as the tp=1 model's; vocabulary padded or
    not) that `--load` accepts at any layout. Model weights only; no process group needed."""
    directory = Path(directory)
    entries, model = [], {}
    for name, t in state_dict.items():
        t = t.detach().cpu().contiguous()
        if name in VOCAB_PARAMS:
            t = t.narrow(0, 0, config.vocab_size)
        entries.append((f"model/{name}", t))
        model[name] = [{"tensor": f"model/{name}", "dim": None, "start": 0, "full": None}]
    tmp = iter_dir(directory, iteration).with_suffix(".tmp")
    directory.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    size = write_rank_file(tmp / rank_file_name(0), entries, {"iteration": iteration, "model": model})
    meta = build_metadata(config, model_kind, iteration, 0, {"tp": 1, "pp": 1, "dp": 1, "vpp": None, "world": 1})
    commit(directory, iteration, {**meta, "files": {rank_file_name(0): {"bytes": size}}})
