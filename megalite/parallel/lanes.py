"""Overlapped pairs: one micro-batch's forward and another's backward run on two lanes (threads)
that hand the device back and forth at every collective, so that one lane's communication is in
flight while the other computes (DeepSeek-V3 report section 3.2.1: a forward chunk and a backward
chunk overlapped; Megatron-Core's `--overlap-moe-expert-parallel-comm`).

Exactly one lane runs at a time: a lane keeps the turn until it has launched a collective
(`async_op=True`), then hands the turn over and waits for it back before it waits for the
collective's result. So the order in which every rank launches collectives on a group is fixed
by the two passes alone, the same on every rank, and the two lanes share megalite's process
groups, its Python state and the global RNG without races. The two passes share no data (one
writes gradients, the other reads weights), so each computes what it computes run alone: the
numbers are bitwise those of running them one after the other.

On gloo the two lanes' exchanges run side by side: a lane launches its collective the moment it
reaches it, whatever the other lane's is doing, and goes on (gloo's two worker threads a process
group run both; on one connection they share the link). So an exchange whose peer rank is late
holds up only the lane that waits for it, not the other lane's next exchange. Elsewhere a lane
about to launch first waits for the other lane's exchange (`_Pair.drain_other`), so that the link
carries one at a time.

A pass may also post exchanges and wait for them later (`post`, for the MoE dispatcher's groups):
a lane's posts go on the link one at a time, in order, each launched when the one before it has
been waited for; inside a pair each wait hands the turn over like a collective.

While a lane waits for an exchange still in flight it may do weight-gradient work a backward has
recorded (`set_filler`: megalite.parallel.weight_grad's, under --delay-wgrad-compute), one item at
a time, until the exchange is done. That work launches no collective, so it does not change the
order of any rank's collectives, only what the CPU does while it would wait.

Module state a pass sets for itself (the virtual pipeline rank, a backward's deferred weight
gradients) is swapped at each hand-over (`register_lane_local`). A lane's collectives are drawn
on the timeline while in flight, and each wait for one on the compute row (`<kind>-wait`: what
nothing hid; `recording`).

On a CUDA device both lanes launch onto the device's current stream: the hand-over still lets a
lane launch its compute while the other's collective is queued, but kernels of the two lanes do
not yet run side by side (a second stream needs every tensor that crosses lanes recorded on it).
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import torch

_local = threading.local()
_lane_locals: list[tuple[Callable[[], object], Callable[[object], None]]] = []
_spans: list | None = None  # where in-flight collectives are drawn while a step records spans
_handovers: list | None = None  # (lane, kind) at each hand-over, for tests (`log_handovers`)
_filler: tuple[Callable[[], bool], Callable[[], bool]] | None = None  # (any work lent?, run one item)


def set_filler(ready: Callable[[], bool], run_one: Callable[[], bool]) -> None:
    """Work to do while an exchange is in flight: `ready()` says whether there is any now,
    `run_one()` does one item of it and says whether it did."""
    global _filler
    _filler = (ready, run_one)


def _fill_while(work) -> None:
    """Do lent work (`set_filler`) while `work` is in flight; a piece of it that tried to launch a
    collective would change the order of this rank's collectives, so that raises."""
    done = getattr(work, "is_completed", None)
    if _filler is None or done is None or not _filler[0]():
        return
    start = time.perf_counter()
    _local.filling = True
    try:
        while not done() and _filler[1]():
            pass
    finally:
        _local.filling = False
    if _spans is not None:
        row = 3 if lane() == "F" else None
        _spans.append(("W while waiting", "weight-grad", start, time.perf_counter() - start)
                      + ((row,) if row else ()))


def _check_not_filling() -> None:
    if getattr(_local, "filling", False):
        raise RuntimeError("weight-gradient work done while an exchange was in flight launched a collective; "
                           "drop --delay-wgrad-compute and report it")


def register_lane_local(get: Callable[[], object], put: Callable[[object], None]) -> None:
    """Module state that belongs to the pass that set it: saved when a lane hands the turn over,
    put back when it gets it again."""
    _lane_locals.append((get, put))


def lane() -> str | None:
    """"F" or "B" inside an overlapped pair's forward or backward lane, else None."""
    pair = getattr(_local, "pair", None)
    return pair and _local.lane


def _other(me: str) -> str:
    return "B" if me == "F" else "F"


class _Pair:
    def __init__(self):
        self.cv = threading.Condition()
        self.turn = "F"
        self.finished: set[str] = set()
        self.saved: dict[str, list] = {}
        self.in_flight: dict[str, object] = {}  # lane -> the collective it handed over on
        self.side_by_side = _side_by_side_applies()  # the lanes' collectives in flight at once

    def drain_other(self, me: str, side_by_side: bool = False) -> None:
        """Wait for the other lane's collective still in flight before launching one, so the link
        carries one lane's exchange while the other lane computes. `side_by_side` (on gloo: the
        lanes' collectives fly side by side): only for other work in flight, a pipeline receive or
        a posted exchange, which is still waited for first (as it was before the two flew side by
        side: not measured otherwise)."""
        work = self.in_flight.get(_other(me))
        if work is not None and not (side_by_side and isinstance(work, _Beside)):
            self.in_flight.pop(_other(me))
            _fill_while(work)
            work.wait()

    def _save(self, me: str) -> None:
        self.saved[me] = [get() for get, _ in _lane_locals]

    def _restore(self, me: str) -> None:
        for (_, put), value in zip(_lane_locals, self.saved.get(me, ())):
            put(value)

    def hand_over(self, me: str, kind: str) -> None:
        """Give the turn to the other lane (if it still runs) and wait until it is given back."""
        with self.cv:
            if _other(me) in self.finished:
                return
            if _handovers is not None:
                _handovers.append((me, kind))
            self._save(me)
            self.turn = _other(me)
            self.cv.notify_all()
            self.cv.wait_for(lambda: self.turn == me)
            self._restore(me)

    def begin(self, me: str) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.turn == me)
            self._restore(me)

    def end(self, me: str) -> None:
        with self.cv:
            self._save(me)
            self.finished.add(me)
            self.turn = _other(me)
            self.cv.notify_all()


def run_pair(forward: Callable[[], None], backward: Callable[[], None]) -> None:
    """Run `forward` on a second thread and `backward` on this one, handing the turn over at each
    collective (`wait`); the forward starts. Returns when both are done; an exception in either
    is raised here (the other lane runs on alone to its end: its collectives are its peers' too)."""
    pair = _Pair()
    pair._save("F")
    pair.saved["B"] = list(pair.saved["F"])
    errors: dict[str, BaseException] = {}
    grad_mode, threads = torch.is_grad_enabled(), torch.get_num_threads()

    def run(me: str, fn: Callable[[], None]) -> None:
        _local.pair, _local.lane = pair, me
        try:
            pair.begin(me)
            fn()
            flush()  # (a pass waits for what it posts: nothing is left here)
        except BaseException as e:  # noqa: BLE001 - raised again on the calling thread
            errors[me] = e
        finally:
            _local.pair = None
            pair.end(me)

    def forward_lane() -> None:
        torch.set_grad_enabled(grad_mode)  # thread-local in torch: the forward lane takes the caller's
        torch.set_num_threads(threads)
        run("F", forward)

    worker = threading.Thread(target=forward_lane, name="megalite-forward-lane", daemon=True)
    worker.start()
    run("B", backward)
    worker.join()
    pair._restore("B")
    for me in ("B", "F"):
        if me in errors:
            raise errors[me]


def _side_by_side_applies() -> bool:
    """A pair's collectives may be in flight at once: on gloo (CPU tensors: whichever thread waits,
    the results are in memory when `wait()` returns). A CUDA collective's `wait()` orders the
    waiting thread's stream, and one NCCL stream runs them one at a time anyway."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"


def wait(work, kind: str, launched: float | None = None) -> None:
    """Wait for a collective launched with `async_op=True` (`work`), handing the turn to the other
    lane of an overlapped pair first. `kind`: its traffic kind ("ep", "tp", "sp", "cp", ...)."""
    _check_not_filling()
    pair = getattr(_local, "pair", None)
    if pair is not None:
        if not isinstance(work, _Once):
            work = _Once(work)  # the other lane may wait for it first (`drain_other`)
        pair.in_flight[_local.lane] = work
        pair.hand_over(_local.lane, kind)
        pair.in_flight.pop(_local.lane, None)
    _await(work, kind, launched)


def _await(work, kind: str, launched: float | None = None) -> None:
    """Wait for `work` here, doing lent work while it is in flight; drawn from its launch, and the
    wait itself (what nothing hid) as a `<kind>-wait` span on the compute row."""
    _fill_while(work)
    waited = time.perf_counter() if _spans is not None else None  # (no clock read while nothing records)
    work.wait()
    _record_wait(kind, waited)
    _record(kind, launched)


_WAITS_DRAWN_ELSEWHERE = {"pp"}  # the pipeline executor draws its own waits ("p2p-wait")


def _record_wait(kind: str, start: float | None) -> None:
    """Draw the wait for a collective of `kind` from `start` to now on the compute row, while a step
    records spans; named with its lane inside a pair, since each lane's waits come in one order on
    every rank while the two lanes' interleave as the ranks' timing falls (scripts/slow_links.py
    matches a wait across ranks by its name and place among those of its name)."""
    if _spans is not None and start is not None and kind not in _WAITS_DRAWN_ELSEWHERE:
        where = lane()
        name = f"wait for {kind}" + (f" ({where} lane)" if where else "")
        _spans.append((name, f"{kind}-wait", start, time.perf_counter() - start))


def _record(kind: str, launched: float | None) -> None:
    """Draw a collective from launch to now, while a step records spans: beside the compute row,
    the backward (or only) lane's on row 2, the forward lane's on row 4."""
    if _spans is not None and launched is not None:
        row = 4 if lane() == "F" else 2
        _spans.append((f"{kind} collective", f"{kind}-comm", launched, time.perf_counter() - launched, row))


def wait_all(works, kind: str) -> None:
    """Wait for every request of a batch of point-to-point ops (`batch_isend_irecv`), handing the
    turn over first (see `wait`)."""
    if works:
        wait(_All(works), kind)


class _Once:
    """A request waited for at most once, by whichever lane comes first: waiting twice for a gloo
    receive waits for a second message."""

    def __init__(self, work):
        self.work, self.done = work, False

    def wait(self) -> None:
        if not self.done:
            self.work.wait()
            self.done = True

    def is_completed(self) -> bool:
        return self.done or self.work.is_completed()


class _Beside(_Once):
    """A pair's collective launched beside the other lane's (`_Pair.side_by_side`)."""


class _All:
    def __init__(self, works):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


class Posted:
    """A collective posted to this lane's queue (`post`); `wait()` for its result."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, kind: str):
        self.call, self.kind = (fn, args, kwargs), kind
        self.work: _Once | None = None  # once launched
        self.launched: float | None = None
        self.done = False

    def wait(self) -> None:
        _wait_posted(self)


def _queue() -> list[Posted]:
    q = getattr(_local, "queue", None)
    if q is None:
        q = _local.queue = []
    return q


def post(fn: Callable, *args, kind: str, **kwargs) -> Posted:
    """Post the torch.distributed collective `fn(*args, **kwargs)` and return at once. A lane's posts
    go on the link one at a time, in order (as on one NCCL stream): each is launched when the one
    before it has been waited for, so the second of two rides the link alone instead of sharing it
    with the first (gloo runs two launched collectives side by side). Inside a pair, a wait hands
    the turn over, as `collective` does. Launches happen only at a post or a wait, never on a
    clock, so every rank launches in the same order."""
    _check_not_filling()
    posted = Posted(fn, args, kwargs, kind)
    if torch.compiler.is_compiling():
        fn(*args, **kwargs)
        posted.done = True
        return posted
    q = _queue()
    q.append(posted)
    if len(q) == 1:
        _launch(posted)
    return posted


def _launch(posted: Posted) -> None:
    pair = getattr(_local, "pair", None)
    if pair is not None:
        pair.drain_other(_local.lane)
    fn, args, kwargs = posted.call
    posted.launched = time.perf_counter()
    posted.work = _Once(fn(*args, async_op=True, **kwargs))
    posted.call = None
    if pair is not None:
        pair.in_flight[_local.lane] = posted.work


def _wait_posted(posted: Posted) -> None:
    """Wait for `posted` and for every post before it, launching each in turn."""
    q = _queue()
    while not posted.done:
        head = q[0]
        if head.work is None:
            _launch(head)
        pair = getattr(_local, "pair", None)
        if pair is not None:
            pair.hand_over(_local.lane, head.kind)
            if pair.in_flight.get(_local.lane) is head.work:
                pair.in_flight.pop(_local.lane)
        _await(head.work, head.kind, head.launched)
        head.done = True
        q.pop(0)
        if q:
            _launch(q[0])


def drop_posts() -> None:
    """Forget this lane's posts not yet waited for: left by a pass that raised, they must never be
    launched (every rank's next collectives would not match)."""
    _queue().clear()


def flush() -> None:
    """Wait for everything this lane has posted."""
    q = _queue()
    if q:
        q[-1].wait()


def collective(fn: Callable, *args, kind: str, hand_over: bool = True, **kwargs) -> None:
    """Run the torch.distributed collective `fn(*args, **kwargs)`: at once outside a pair; inside
    one, launched without waiting, the turn handed over while it is in flight. hand_over=False
    (an exchange of a few bytes, all latency): inside a pair too it runs at once, the turn kept.
    Handing over for it would cost more than it hides: the other lane computes up to its next
    exchange and launches it, and this lane's next exchange must wait for that one to drain with
    nothing left to compute (megalite.tools.plan.pair_play plays both)."""
    if torch.compiler.is_compiling():
        fn(*args, **kwargs)
        return
    _check_not_filling()
    pair = getattr(_local, "pair", None)
    if pair is not None and pair.side_by_side:  # launched now, beside the other lane's exchange
        pair.drain_other(_local.lane, side_by_side=True)
        launched = time.perf_counter()
        work = _Beside(fn(*args, async_op=True, **kwargs))
        if hand_over:
            wait(work, kind, launched)
        else:  # (few bytes: the turn kept; lent work while it is in flight)
            _await(work, kind, launched)
        return
    if pair is not None:
        pair.drain_other(_local.lane)
        if not hand_over:
            pair = None
    fill = pair is None and hand_over and _filler is not None and _filler[0]()  # alone, with work to do meanwhile
    launched = time.perf_counter() if _spans is not None or pair is not None or fill else None
    if pair is None and not fill:
        fn(*args, **kwargs)
        _record_wait(kind, launched)  # a blocking collective: waited for from its launch
        _record(kind, launched)
    else:
        wait(fn(*args, async_op=True, **kwargs), kind, launched)


class recording:
    """Inside: every collective launched through `collective` is added to `spans` as
    (name, "<kind>-comm", start, duration[, row]) from launch to completion."""

    def __init__(self, spans: list | None):
        self.spans = spans

    def __enter__(self):
        global _spans
        self.before, _spans = _spans, self.spans
        return self

    def __exit__(self, *exc):
        global _spans
        _spans = self.before


class log_handovers:
    """Inside: every hand-over is appended to the yielded list as (lane, kind) (tests)."""

    def __enter__(self):
        global _handovers
        _handovers = []
        return _handovers

    def __exit__(self, *exc):
        global _handovers
        _handovers = None
