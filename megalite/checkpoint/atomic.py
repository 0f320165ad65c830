"""Checkpoints on disk, never half-written: a save's temporary directory (leftovers of a crashed
save removed), rank files written whole or removed, and the commit that makes a checkpoint `latest`.

A crash at any moment leaves `latest` naming a complete checkpoint: the ranks write into
`iter_N.tmp/`, then rank 0 writes the metadata, renames the directory to `iter_N` and replaces
`latest` last, each step fsynced.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from megalite import faults
from megalite.checkpoint.fileformat import write_rank_file
from megalite.checkpoint.layout import (FORMAT_VERSION, ITER_NAME, VOCAB_PARAMS, config_dict, iter_dir,
                                        rank_file_name, split_experts, tmp_dir)
from megalite.checkpoint.sealed import sealed
from megalite.models.config import TransformerConfig


def fresh_tmp_dir(directory, iteration: int) -> Path:
    """An empty `iter_N.tmp/` for a save of `iteration`: what a crashed save left there goes."""
    tmp = tmp_dir(directory, iteration)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


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


def write_rank(path: Path, entries, structure: dict, rank: int, iteration: int, fault_point: str = "save") -> dict:
    """Write this rank's file of a save: {"bytes": its size}, or {"error": what failed} with the
    partial file removed. Never raises: the outcome is the rank's report to the committer.
    `fault_point`: the name under which megalite.faults may strike mid-file."""
    test_hook = _fault_hook(rank, iteration)

    def after_bytes(written: int) -> None:
        faults.point(fault_point, iteration)
        faults.point("enospc", iteration)
        if test_hook is not None:
            test_hook(written)
    try:
        size = write_rank_file(path, entries, structure, after_bytes=after_bytes)
        _crash_hook(rank, iteration)
        return {"bytes": size}
    except OSError as e:
        report = {"error": f"writing {path} failed: [Errno {e.errno}] {e.strerror}"}
    except Exception as e:  # noqa: BLE001 - reported as the save's failure, never lost
        report = {"error": f"writing {path} failed: {type(e).__name__}: {e}"}
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass
    return report


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def commit(directory: Path, iteration: int, metadata: dict) -> None:
    """Rank 0, after every rank wrote its file into iter_N.tmp: metadata, rename, `latest`."""
    directory = Path(directory)
    tmp, final = tmp_dir(directory, iteration), iter_dir(directory, iteration)
    _write_synced(tmp / "metadata.json", json.dumps(sealed(metadata), indent=1))
    _fsync_dir(tmp)
    old = None
    if final.exists():  # saving the same iteration again: keep the old one until the new is in place
        old = final.with_suffix(".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(directory)
    latest_tmp = directory / "latest.tmp"
    _write_synced(latest_tmp, final.name + "\n")
    os.replace(latest_tmp, directory / "latest")
    _fsync_dir(directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _previous(directory: Path) -> str:
    try:
        name = (directory / "latest").read_text().strip()
    except OSError:
        return "there is no earlier checkpoint"
    if not ITER_NAME.match(name):
        return "the previous checkpoint is intact"
    return f"the previous checkpoint ({name}) is intact"


def failure_line(directory: Path, iteration: int, detail: str) -> str:
    return (f"checkpoint of iteration {iteration} was not saved: {detail}; {_previous(directory)}; "
            f"free space, fix the permissions, or use another --save")


def build_metadata(config: TransformerConfig, model_kind: str, iteration: int, consumed_samples: int,
                   layout: dict) -> dict:
    return {"format_version": FORMAT_VERSION, "iteration": iteration, "consumed_samples": consumed_samples,
            "model_kind": model_kind, "config": config_dict(config), "layout": layout}


def save_model_checkpoint(directory, config: TransformerConfig, model_kind: str, state_dict: dict,
                          iteration: int = 0) -> None:
    """A checkpoint from a single-device state dict (names as the tp=1 model's; vocabulary padded or
    not) that `--load` accepts at any layout. Model weights only; no process group needed. A MoE
    layer's experts are stored one tensor each, as a training run stores them."""
    directory = Path(directory)
    entries, model = [], {}
    for name, t in split_experts(state_dict).items():
        t = t.detach().cpu().contiguous()
        if name in VOCAB_PARAMS:
            t = t.narrow(0, 0, config.vocab_size)
        entries.append((f"model/{name}", t))
        model[name] = [{"tensor": f"model/{name}", "dim": None, "start": 0, "full": None}]
    directory.mkdir(parents=True, exist_ok=True)
    tmp = fresh_tmp_dir(directory, iteration)
    token = uuid.uuid4().hex
    size = write_rank_file(tmp / rank_file_name(0), entries,
                           {"iteration": iteration, "writer": {"rank": 0, "coords": {}, "save": token}, "model": model})
    meta = build_metadata(config, model_kind, iteration, 0, {"tp": 1, "pp": 1, "dp": 1, "vpp": None, "world": 1})
    commit(directory, iteration, {**meta, "save": token, "files": {rank_file_name(0): {"bytes": size}}})
