"""tests/netns.py's tools: iproute2's `ip` and `tc`, a host link's token bucket (`LinkLimit`), and
removing namespaces, veths, bridges and /etc/netns files, ours or left by a crashed run (their names
say which process made them: `ml<tag><pid>...`)."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

NETNS_ETC = "/etc/netns"
# ml<tag letter><pid><suffix>: suffix h<i> for namespaces, br for the bridge, v<i> for veths.
_NAME = re.compile(r"^ml[a-z](\d+)(?:h\d+|br|v\d+)$")
_IP_TIMEOUT = 20


class NetnsError(RuntimeError):
    """The hosts could not be set up (no privileges, no `ip`, blocked bridge traffic, ...)."""


def ip_command() -> str | None:
    return shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip")
                                       if os.access(p, os.X_OK)), None)


def _ip(*args: str, check: bool = True, netns: str | None = None) -> subprocess.CompletedProcess:
    ip = ip_command()
    if ip is None:
        raise NetnsError("iproute2's `ip` is not installed (bash .ci/setup_netns.sh installs it)")
    cmd = [ip, *(("-n", netns) if netns else ()), *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=_IP_TIMEOUT)
    if check and run.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed (exit {run.returncode}): {run.stderr.strip()}")
    return run


def tc_command() -> str | None:
    return shutil.which("tc") or next((p for p in ("/usr/sbin/tc", "/sbin/tc", "/usr/bin/tc", "/bin/tc")
                                       if os.access(p, os.X_OK)), None)


def _tc(*args: str, netns: str | None = None) -> subprocess.CompletedProcess:
    tc = tc_command()
    if tc is None:
        raise NetnsError("iproute2's `tc` is not installed (bash .ci/setup_netns.sh installs iproute2)")
    cmd = [tc, *(("-n", netns) if netns else ()), *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=_IP_TIMEOUT)
    if run.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed (exit {run.returncode}): {run.stderr.strip()} "
                         f"(the kernel needs the sch_tbf qdisc)")
    return run


@dataclass(frozen=True)
class LinkLimit:
    """A host's link as a token bucket (tc-tbf), the same in both directions.

    rate_mbit: Mbit/s (10^6 bits) of IP packets, headers included: TCP payload gets ~96% of it
    (200 Mbit/s measured as 24 MB/s here). burst_kib: the bucket, bytes that may pass at once at
    full speed; by default 2 ms of the rate, at least 32 KiB (tbf cuts larger GSO packets down to
    it). queue_ms: tbf's `latency`, the longest a packet waits in the queue before being dropped,
    i.e. the queue's length in time; it adds no delay of its own (tbf cannot add delay: that is
    netem's, missing from this kernel)."""
    rate_mbit: float
    burst_kib: float | None = None
    queue_ms: float = 50.0

    def __post_init__(self):
        if not self.rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0, got {self.rate_mbit}")
        if self.burst_kib is not None and not self.burst_kib >= 2:
            raise ValueError(f"burst_kib must be >= 2 (one packet), got {self.burst_kib}")
        if not self.queue_ms > 0:
            raise ValueError(f"queue_ms must be > 0, got {self.queue_ms}")

    @property
    def bytes_per_s(self) -> float:
        return self.rate_mbit * 1e6 / 8

    @property
    def burst_bytes(self) -> int:
        if self.burst_kib is not None:
            return int(self.burst_kib * 1024)
        return max(32 * 1024, int(self.bytes_per_s * 0.002))

    def tbf_args(self) -> list[str]:
        return ["tbf", "rate", f"{round(self.rate_mbit * 1000)}kbit", "burst", str(self.burst_bytes),
                "latency", f"{round(self.queue_ms * 1000)}us"]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_CREATED_ETC = [False]  # whether this process created /etc/netns (then it removes it when empty)
_ACTIVE: set[str] = set()  # stems (ml<tag><pid>) of this process's networks that are in use


def _stale(name: str) -> bool:
    """Ours by name, and left behind: by a dead process, or by an earlier owner of our pid."""
    m = _NAME.match(name)
    if not m:
        return False
    pid = int(m.group(1))
    if pid == os.getpid():
        return name[:3 + len(m.group(1))] not in _ACTIVE
    return not _pid_alive(pid)


def netns_pids(name: str) -> list[int]:
    run = _ip("netns", "pids", name, check=False)
    return [int(x) for x in run.stdout.split()] if run.returncode == 0 else []


def kill_netns_processes(name: str, sig: int = signal.SIGKILL, timeout: float = 15.0) -> list[int]:
    """Send `sig` to every process in namespace `name` until none is left (bounded: `timeout`
    seconds); returns the pids signalled. Processes that outlive the bound are left as they are."""
    signalled: list[int] = []
    deadline = time.monotonic() + timeout
    for _ in range(200):
        pids = [p for p in netns_pids(name) if p != os.getpid()]
        if not pids or time.monotonic() > deadline:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            if pid not in signalled:
                signalled.append(pid)
        if sig != signal.SIGKILL:
            break
        time.sleep(0.1)
    return signalled


def _remove_netns(name: str) -> None:
    kill_netns_processes(name)
    _ip("netns", "delete", name, check=False)
    shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)


def _remove_link(name: str) -> None:
    _ip("link", "delete", name, check=False)


def clean_stale() -> list[str]:
    """Remove namespaces, links and /etc/netns dirs of this naming left by dead processes."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if _stale(name):
            _remove_netns(name)
            removed.append(name)
    links = _ip("-o", "link", "show", check=False).stdout.splitlines()
    names = [ln.split(":")[1].strip().split("@")[0] for ln in links if ln.count(":") >= 2]
    # veths first (deleting one end deletes its peer), then bridges.
    for name in sorted((n for n in names if _stale(n)), key=lambda n: n.endswith("br")):
        _remove_link(name)
        removed.append(name)
    if os.path.isdir(NETNS_ETC):
        stale = [name for name in os.listdir(NETNS_ETC) if _stale(name)]
        for name in stale:
            shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)
        if stale or removed:  # a crashed run of ours made it: remove it once empty
            with contextlib.suppress(OSError):
                os.rmdir(NETNS_ETC)
    return removed
