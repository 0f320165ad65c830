"""Saving: the Checkpointer, which writes this rank's slices into one rank file (inline or in the
background) and has rank 0 commit once every rank's file is out.

Each rank writes `iter_N.tmp/rank_RRRRR.safetensors` (inline, or from a background thread with
--save-async) and reports success or its error in the rendezvous store under a key of this save's
token (unique: no earlier save's report can pass for it). Rank 0 (a background thread with
--save-async) waits for every rank's report and commits: metadata, rename to `iter_N`, `latest`
last; or, if any rank failed, removes the partial directory and records the one-line failure,
which `poll()` shows every rank.
No collective runs after the save's start, so the training loop never waits for the disk.
The files and the commit themselves are `atomic`'s; the state written is `rank_state`'s, copied
into `snapshot`'s buffer; the waits on other ranks are `rendezvous`'s.
"""
from __future__ import annotations

import datetime
import json
import shutil
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megalite.checkpoint import lock
from megalite.checkpoint.atomic import commit, failure_line, fresh_tmp_dir, write_rank
from megalite.checkpoint.layout import rank_file_name, tmp_dir
from megalite.checkpoint.rank_state import collect_rank_state
from megalite.checkpoint.rendezvous import default_store, wait_for
from megalite.checkpoint.snapshot import Snapshot
from megalite.optim.low_precision_adam import LowPrecisionAdamW
from megalite.optim.muon import MuonAndAdamW
from megalite.optim.optimizer import moment_dtype, moment_names
from megalite.runtime import TrainingStopped, UsageError


@dataclass
class _Save:
    iteration: int
    metadata: dict
    prefix: str  # store keys of this save
    writer: threading.Thread | None = None
    committer: threading.Thread | None = None
    local: dict = field(default_factory=dict)  # this rank's outcome: {"bytes": n} or {"error": text}
    outcome: dict | None = None  # the save's outcome, once known: {"ok": True} or {"error": line}


class Checkpointer:
    """Owns a --save directory for the job's life; saves (inline or in the background) and commits
    from rank 0 as soon as every rank's file is written. `poll()` says, without a collective, whether
    a save failed; `finalize()` waits for the pending commit; `close()` also gives the directory up."""

    def __init__(self, directory: str, async_save: bool = False, with_optim: bool = True, with_rng: bool = True):
        self.directory = Path(directory)
        self.async_save = async_save
        # Megalite's checkpoints hold both, so a resume is exact; --no-save-optim / --no-save-rng drop them
        self.contents = {"with_optim": with_optim, "with_rng": with_rng}
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
        self._store = default_store()
        self._timeout_s = getattr(self._store, "timeout", datetime.timedelta(minutes=30)).total_seconds()

    # -- the loop's calls

    def save(self, model_chunks, optimizer, iteration: int, metadata: dict, replica: dict | None = None) -> None:
        """Save (inline, or start a background save). `replica`: this rank's own state (local SGD),
        see `collect_rank_state`."""
        self.finalize()
        tmp = tmp_dir(self.directory, iteration)
        # One token per save, in every rank file and the metadata: a file from another save (or run)
        # put in this one's place is refused when read.
        token_key = f"megalite/checkpoint/{self.directory}/{iteration}/{self._saves + 1}/token"
        if self._rank == 0:
            fresh_tmp_dir(self.directory, iteration)  # leftovers of a save that crashed go
            token = uuid.uuid4().hex
            if self._world > 1:
                self._store.set(token_key, token)
        if self._world > 1:
            dist.barrier()
            if self._rank != 0:
                token = self._store.get(token_key).decode()
        # ZeRO-3 parameters are whole only while their unit is gathered: the snapshot copies each one
        # then, one unit at a time (never the whole model at once).
        stage = _zero_stage(optimizer)
        if stage == 3:
            unit_keys = optimizer.unit_storage_keys()
            with optimizer.non_layer_units_gathered():  # the embeddings' padding is cut off while whole
                entries, structure = collect_rank_state(model_chunks, optimizer, iteration, replica=replica, **self.contents)
                entries = self._snapshot.take(entries, unit_keys, optimizer.units_gathered_in_turn())
        else:
            entries, structure = collect_rank_state(model_chunks, optimizer, iteration, replica=replica, **self.contents)
            if self.async_save or any(t.device.type != "cpu" for _, t in entries):
                entries = self._snapshot.take(entries)
        structure["writer"] = {**structure["writer"], "save": token}
        # Recorded for people and tools only: any stage loads a checkpoint of any other.
        metadata = {**metadata, "layout": {**metadata.get("layout", {}), "zero_stage": stage}, "save": token}
        self._saves += 1
        # Keyed by the save's token: a key of an earlier save in this store (another Checkpointer of
        # this directory and iteration in the process) must never pass for this save's report.
        job = _Save(iteration, metadata, f"megalite/checkpoint/{token}/")
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

    def prepare(self, model_chunks, optimizer, replica=None, wait: bool = False) -> None:
        """Allocate the snapshot buffer of a --save-async save now, in a background thread, so that
        no save has to (the first one waits only for what is not done yet). Call it right after
        building the model and optimizer, on every rank (ZeRO-3 gathers the embeddings' units, as a
        save does). Before the first step the buffer is sized for the Adam state that step creates.
        `replica`: a function of the optimizer giving the `replica` a save is handed (local SGD),
        called on that stand-in. `wait`: return only once the buffer is ready (tests, benchmarks).
        A save whose entries outgrow the buffer allocates a bigger one, as without preparing."""
        stand_in = _after_first_step(optimizer) if optimizer is not None else None

        def collect():
            return collect_rank_state(model_chunks, stand_in, replica=replica(stand_in) if replica else None,
                                      **self.contents)[0]

        if _zero_stage(optimizer) == 3:
            optimizer.unit_storage_keys()  # as a save: parked parameters get their shapes back
            with optimizer.non_layer_units_gathered():  # the vocabulary is cut while whole
                entries = collect()
        else:
            entries = collect()
        live = any(t.device.type not in ("cpu", "meta") for _, t in entries) or (
            stand_in is not None and any(piece.master.device.type != "cpu" for piece in optimizer.pieces))
        if self.async_save or live:  # else a save writes the live tensors, without a snapshot
            self._snapshot.prepare(entries, pin=torch.cuda.is_available() and live)
            if wait:
                self._snapshot.wait()

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
            waited = wait_for(self._store, [key], self._timeout_s + 5, [0] if self._world > 1 else None)
            if waited is True:
                job.outcome = json.loads(self._store.get(key))
            elif waited:
                job.outcome = {"error": failure_line(self.directory, job.iteration, "rank 0 stopped during the save "
                                                     "(its heartbeat ended)"), "lost": True}
            else:
                job.outcome = {"error": failure_line(self.directory, job.iteration,
                                                     "rank 0 did not record the outcome (it stopped or hangs)")}
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
        job.local = write_rank(path, entries, structure, self._rank, job.iteration,
                               "async-save" if self.async_save else "save")
        self._store.set(job.prefix + f"rank/{self._rank}", json.dumps(job.local))

    def _commit_when_written(self, job: _Save) -> None:
        tmp = tmp_dir(self.directory, job.iteration)
        keys = [job.prefix + f"rank/{r}" for r in range(self._world)]
        try:
            waited = wait_for(self._store, keys, self._timeout_s, list(range(self._world)) if self._world > 1 else None)
            if waited is not True and waited:
                raise _Lost(f"rank(s) {waited} stopped during the save (their heartbeat ended)")
            if not waited:
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


def _after_first_step(optimizer):
    """The optimizer as a save collects it once a step has run: every master's Adam state as the
    first step creates it (or as it is), in stand-ins of the same shapes and dtypes that hold no
    memory (meta tensors; step counts as host zeros, so nothing is read from the device)."""
    state = {piece.master: _stand_ins(optimizer.inner, piece.master) for piece in optimizer.pieces}
    return _With(optimizer, inner=_With(optimizer.inner, state=state))


class _With:
    """`base` with some attributes replaced."""

    def __init__(self, base, **replaced):
        self._base = base
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(self._base, name)


def _stand_ins(inner, master) -> dict:
    state = inner.state.get(master)
    if not state:  # no step yet: what torch's Adam/AdamW (and apex's FusedAdam, step count aside) create
        moments = moment_names(inner, master) + (("max_exp_avg_sq",) if inner.defaults.get("amsgrad") else ())
        state = {k: master for k in moments}
        if isinstance(inner, (torch.optim.Adam, MuonAndAdamW, LowPrecisionAdamW)):  # AdamW too; Muon counts
            state["step"] = torch.zeros((), dtype=torch.float32)
    return {k: (torch.zeros(v.shape, dtype=v.dtype) if k == "step"
                else torch.empty_like(v, device="meta", dtype=moment_dtype(inner, master, k)))
            if torch.is_tensor(v) else v for k, v in state.items()}


def _zero_stage(optimizer) -> int:
    """The ZeRO stage the run trains at (0 without an optimizer)."""
    return max((b.zero_stage for b in optimizer.buffers), default=0) if optimizer is not None else 0


class _Failed(Exception):
    pass


class _Lost(_Failed):
    pass


class CheckpointRankLost(ConnectionError):
    """Ranks that never reported their file: reported like any lost rank (megalite.runtime)."""
