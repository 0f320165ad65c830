"""The link of an overlapped pair on gloo: one thread that launches the two lanes' collectives one
after the other, each the moment the one before it has completed (megalite.parallel.lanes).

A pair keeps one exchange on the link at a time (the second of two would share the link with the
first and delay the lane that waits for the first). Without this thread the lane about to launch
waits for the other lane's exchange itself, and launches when it is done; if it is doing
weight-gradient work meanwhile (--delay-wgrad-compute), it launches only when the piece it is in
ends, and the link stands idle, on this rank and on every peer of the exchange. Here the lane
submits its collective and goes on: the link thread launches it when the link is free, as a CUDA
device launches the collectives queued on one NCCL stream in order, with no host thread involved.

Launch order is submission order, and submissions are made by whichever lane holds the turn, so
every rank launches the same collectives in the same order, as without the thread. Only gloo
(CPU tensors: once `wait()` returns on any thread the results are in memory); a CUDA collective's
`wait()` orders the waiting thread's stream, so there the lanes launch their own.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable


class Submitted:
    """A collective submitted to the link: launched when those before it are done; `wait()` for it."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        self.call: tuple | None = (fn, args, kwargs)
        self.launched: float | None = None
        self.done = False
        self.error: BaseException | None = None

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> None:
        _link.wait_for(self)


class _Link:
    def __init__(self):
        self.cv = threading.Condition()
        self.queue: deque[Submitted] = deque()  # submitted and not done; the head is launched
        self.work = None  # the head's torch.distributed work
        self.thread: threading.Thread | None = None

    def submit(self, fn: Callable, args: tuple, kwargs: dict) -> Submitted:
        entry = Submitted(fn, args, kwargs)
        with self.cv:
            self.queue.append(entry)
            if len(self.queue) == 1:  # the link is free: launched here, now
                self._launch_head()
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="megalite-link", daemon=True)
                self.thread.start()
            self.cv.notify_all()
        return entry

    def _launch_head(self) -> None:
        """Launch the queue's head (under the lock); a launch that raises fails it and those after."""
        head = self.queue[0]
        fn, args, kwargs = head.call
        head.call = None
        head.launched = time.perf_counter()
        try:
            self.work = fn(*args, async_op=True, **kwargs)
        except BaseException as e:  # noqa: BLE001 - raised again by the waiting lane
            self._fail(e)

    def _fail(self, error: BaseException) -> None:
        for entry in self.queue:
            entry.error, entry.done = error, True
        self.queue.clear()
        self.work = None
        self.cv.notify_all()

    def _run(self) -> None:
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self.work is not None)
                work = self.work
            try:
                work.wait()  # (the GIL is released meanwhile)
            except BaseException as e:  # noqa: BLE001
                with self.cv:
                    self._fail(e)
                continue
            with self.cv:
                self.queue.popleft().done = True
                self.work = None
                if self.queue:
                    self._launch_head()
                self.cv.notify_all()

    def wait_for(self, entry: Submitted) -> None:
        with self.cv:
            self.cv.wait_for(lambda: entry.done)
        if entry.error is not None:
            raise entry.error

    def idle(self) -> bool:
        with self.cv:
            return not self.queue

    def wait_idle(self) -> None:
        with self.cv:
            self.cv.wait_for(lambda: not self.queue)


_link = _Link()


def submit(fn: Callable, *args, **kwargs) -> Submitted:
    """Launch the torch.distributed collective `fn(*args, async_op=True, **kwargs)` when every
    collective submitted before it has completed (now if none is in flight)."""
    return _link.submit(fn, args, kwargs)


def idle() -> bool:
    """Nothing submitted is still in flight or waiting to launch."""
    return _link.idle()


def wait_idle() -> None:
    """Wait until everything submitted has completed (before launching past the link)."""
    _link.wait_idle()
