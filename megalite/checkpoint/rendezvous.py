"""How a save's ranks learn of each other through the rendezvous store: its reports polled until
set, and a rank that stopped beating (megalite.runtime's heartbeats) named within seconds."""
from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from megalite.runtime import heartbeat_timeout_s, stop_signal_received

_POLL_S = 0.02
_HEARTBEAT_LOOK_S = 0.5


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


def default_store():
    if dist.is_available() and dist.is_initialized():
        try:
            return dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError, AttributeError):
            pass
    return _LocalStore()


_STALE_AFTER_SIGNAL_S = 5.0  # missed heartbeats that mean "dead" once torchrun is tearing the job down


class _Beats:
    """Watches the heartbeats (megalite.runtime) of the ranks a save waits for, so that a rank that
    died mid-save ends the wait in seconds, not at the store's time-out: a beat unchanged for the
    heartbeat time-out, or for 5 s once a stop signal came (torchrun signals the survivors when a
    rank dies, and kills them after its grace period; in a preemption every rank beats on)."""

    def __init__(self, store, ranks):
        self.store, self.seen = store, {r: (None, time.monotonic()) for r in ranks}

    def dead(self, ranks) -> list[int]:
        limit = _STALE_AFTER_SIGNAL_S if stop_signal_received() else heartbeat_timeout_s()
        out = []
        for r in ranks:
            try:
                beat = self.store.get(f"megalite/alive/{r}") if self.store.check([f"megalite/alive/{r}"]) else None
            except Exception:  # noqa: BLE001 - the store's host is gone: the time-out reports it
                return []
            last, since = self.seen.get(r, (None, time.monotonic()))
            if beat != last or beat is None:
                self.seen[r] = (beat, time.monotonic())
            elif time.monotonic() - since > limit:
                out.append(r)
        return out


def wait_for(store, keys, timeout_s: float, ranks=None) -> bool | list[int]:
    """Poll (store.wait would hold the store client's lock and stall the heartbeat thread) until
    every key is set (True), the time-out (False), or a rank that `ranks[i]` names as the writer of
    the missing `keys[i]` stopped beating (the dead ranks)."""
    deadline = time.monotonic() + timeout_s
    beats = _Beats(store, ranks) if ranks else None
    next_look = time.monotonic() + _HEARTBEAT_LOOK_S
    while not store.check(keys):
        now = time.monotonic()
        if now > deadline:
            return False
        if beats is not None and now >= next_look:
            next_look = now + _HEARTBEAT_LOOK_S
            dead = beats.dead([r for r, k in zip(ranks, keys) if not store.check([k])])
            if dead:
                return dead
        time.sleep(_POLL_S)
    return True
