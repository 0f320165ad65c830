"""Exclusive ownership of a --save directory: `DIR/.megalite.lock`, flock-ed for the job's life.

The OS drops a flock when its holder dies, so a restart after a crash just takes the lock again.
Where the file system does not support flock, a lock whose owner ran on this host under a pid
that no longer exists is taken over as stale.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".megalite.lock"
_HELD: dict[str, "DirectoryLock"] = {}  # this process's locks, by directory: a second Checkpointer reuses it


def _owner_record() -> dict:
    env = os.environ
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "job": env.get("SLURM_JOB_ID") or env.get("TORCHELASTIC_RUN_ID"),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _describe(owner: dict) -> str:
    job = f", job {owner['job']}" if owner.get("job") else ""
    return f"host {owner.get('host')}, pid {owner.get('pid')}{job}, since {owner.get('started')}"


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError):
        return True
    return True


class DirectoryLocked(Exception):
    """Another live job owns the directory; the message names it and the fix."""


class DirectoryLock:
    def __init__(self, directory: Path, fd: int):
        self.directory, self.fd = directory, fd

    def release(self) -> None:
        if self.fd < 0:
            return
        _HELD.pop(str(self.directory), None)
        try:  # unlink while still holding it, so no one takes a lock on a file about to vanish
            os.unlink(self.directory / LOCK_NAME)
        except OSError:
            pass
        os.close(self.fd)  # closing drops the flock
        self.fd = -1


def _refusal(directory: Path, owner: dict) -> DirectoryLocked:
    return DirectoryLocked(
        f"--save directory {directory} is in use by another running job ({_describe(owner)}): "
        f"give this job another --save directory, or stop that job first")


def _read_owner(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def acquire(directory) -> DirectoryLock:
    """Own `directory` (created if need be) or raise DirectoryLocked naming the owner."""
    directory = Path(directory).resolve()
    if str(directory) in _HELD:
        return _HELD[str(directory)]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise _refusal(directory, _read_owner(path)) from None
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                os.close(fd)
                raise
            owner = _read_owner(path)  # no flock here: judge the recorded owner
            if owner and not (owner.get("host") == socket.gethostname() and not _pid_alive(owner.get("pid"))) \
                    and owner.get("pid") != os.getpid():
                os.close(fd)
                raise _refusal(directory, owner) from None
        try:  # the file we locked may have been unlinked by its releasing owner meanwhile: retry
            if os.fstat(fd).st_ino != os.stat(path).st_ino:
                os.close(fd)
                continue
        except FileNotFoundError:
            os.close(fd)
            continue
        break
    record = json.dumps(_owner_record()).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)
    os.fsync(fd)
    lock = DirectoryLock(directory, fd)
    _HELD[str(directory)] = lock
    return lock
