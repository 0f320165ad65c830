"""Caches next to the data: index arrays built once, shared by every run and rank.

Many ranks start together: one builds under a file lock, the others wait (at most
MEGALITE_CACHE_LOCK_TIMEOUT_S seconds, default 600, or the job's --distributed-timeout-minutes) and
then load. The lock file names its holder (host and pid), so a wait that runs out says who held it.

A set of arrays is one `.npy` file per array and a JSON manifest (shapes, dtypes, sizes, CRC-32),
each written under a name of its own and renamed into place, the manifest last. Loading
memory-maps the arrays (pages are shared by the ranks of a node, not copied into each) and checks
them against the manifest: a truncated or corrupt cache is rebuilt with a one-line note.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import sys
import time
import zlib
from pathlib import Path

import numpy as np

from megalite.data.errors import DatasetError

LOCK_TIMEOUT_ENV = "MEGALITE_CACHE_LOCK_TIMEOUT_S"
DEFAULT_LOCK_TIMEOUT_S = 600.0


def lock_timeout_s(default: float | None = None) -> float:
    """Seconds to wait for a cache lock: the environment variable if set, else `default`, else 600."""
    text = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_LOCK_TIMEOUT_S if default is None else float(default)
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise DatasetError(f"{LOCK_TIMEOUT_ENV}={text!r} must be a positive number of seconds")
    return value


def _holder(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        text = ""
    return text or "an unknown process"


def _acquire(f, path: Path, timeout_s: float) -> bool:
    """Take the lock, polling; False where the file system has no flock. Raises when the wait runs out."""
    deadline, pause = time.monotonic() + timeout_s, 0.01
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError:
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            raise DatasetError(f"waited {timeout_s:g} s for the cache lock {path}, held by {_holder(path)}: if that "
                               f"process is gone or stuck, delete the lock file; to wait longer, set "
                               f"{LOCK_TIMEOUT_ENV} (seconds)")
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.5)


@contextlib.contextmanager
def file_lock(path: Path, timeout_s: float | None = None):
    """An exclusive lock on `path`, waited for at most lock_timeout_s(timeout_s). Where the file
    system has no flock (some Lustre mounts), everyone goes ahead: writes are still atomic."""
    timeout_s = lock_timeout_s(timeout_s)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+", encoding="utf-8") as f:
        if not _acquire(f, path, timeout_s):
            yield
            return
        try:
            f.truncate(0)
            f.write(f"host {socket.gethostname()} pid {os.getpid()}\n")
            f.flush()
            yield
        finally:
            f.truncate(0)  # a waiter that times out later must not name a process that has left
            fcntl.flock(f, fcntl.LOCK_UN)


class CorruptCache(Exception):
    """A cached file is truncated, unreadable or fails its checksum."""


def _array_path(manifest: Path, name: str) -> Path:
    return manifest.with_name(f"{manifest.stem}.{name}.npy")


def _write_atomic(path: Path, write) -> None:
    """write(f) into a file of this process's own (a lock may not span nodes), fsync, rename into place."""
    tmp = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_arrays(manifest: Path, arrays: dict[str, np.ndarray]) -> None:
    """One .npy per array, then the manifest that describes them (its presence means complete)."""
    manifest.parent.mkdir(parents=True, exist_ok=True)
    entries = {}
    for name, array in arrays.items():
        array = np.ascontiguousarray(array)
        path = _array_path(manifest, name)
        _write_atomic(path, lambda f: np.save(f, array, allow_pickle=False))
        entries[name] = {"file": path.name, "dtype": array.dtype.str, "shape": list(array.shape),
                         "bytes": path.stat().st_size, "crc32": zlib.crc32(array)}
    text = json.dumps({"arrays": entries}, indent=1) + "\n"
    _write_atomic(manifest, lambda f: f.write(text.encode()))


def load_arrays(manifest: Path) -> dict[str, np.ndarray] | None:
    """The arrays, memory-mapped read-only; None when not built yet; CorruptCache when damaged."""
    try:
        entries = json.loads(manifest.read_text(encoding="utf-8"))["arrays"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptCache(f"its manifest is unreadable: {type(e).__name__}") from None
    try:
        return {name: _load_array(manifest.with_name(entry["file"]), entry) for name, entry in entries.items()}
    except (KeyError, TypeError, AttributeError) as e:
        raise CorruptCache(f"its manifest is malformed: {type(e).__name__} {e}") from None


def _load_array(path: Path, entry: dict) -> np.ndarray:
    try:
        size = path.stat().st_size
        mapped = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise CorruptCache(f"{path.name} is unreadable: {str(e)[:120]}") from None
    if size != entry["bytes"] or mapped.dtype.str != entry["dtype"] or list(mapped.shape) != entry["shape"]:
        raise CorruptCache(f"{path.name} has {size} bytes, shape {list(mapped.shape)}, dtype {mapped.dtype.str}; "
                           f"the manifest says {entry['bytes']}, {entry['shape']}, {entry['dtype']}")
    if zlib.crc32(mapped) != entry["crc32"]:
        raise CorruptCache(f"{path.name} fails its checksum")
    return mapped.view(np.ndarray)  # plain-array indexing speed, still backed by the mapping


def cached_arrays(cache_dir: Path, key: dict, build, lock_timeout: float | None = None) -> dict[str, np.ndarray]:
    """The arrays cached under `key` (memory-mapped), built by build() -> {name: array} when missing
    or damaged. Readers need no lock: files are only ever replaced whole, the manifest last."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    manifest = cache_dir / f"{key['kind']}-{digest}.json"
    with contextlib.suppress(CorruptCache):  # reported and rebuilt under the lock
        arrays = load_arrays(manifest)
        if arrays is not None:
            return arrays
    with file_lock(cache_dir / f".{digest}.lock", lock_timeout):
        try:
            arrays = load_arrays(manifest)
        except CorruptCache as e:
            print(f"megalite: note: the dataset cache {manifest} is damaged ({e}); rebuilding it", file=sys.stderr,
                  flush=True)
            arrays = None
        if arrays is None:
            write_arrays(manifest, build())
            try:
                arrays = load_arrays(manifest)
            except CorruptCache as e:
                raise DatasetError(f"the dataset cache {manifest} reads back damaged right after writing ({e}): "
                                   f"check the file system, or delete {cache_dir}") from None
    return arrays
