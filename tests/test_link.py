"""megalite.parallel.link (issue #50): an overlapped pair's collectives on gloo go through one thread
that launches each when the one before it has completed, in the order submitted. Claims: the first
is launched at once by the submitting thread, the next only once the one before it is done, and by
the link's thread; a launch or a wait that raises fails that collective and those queued behind it,
and the link goes on serving new ones; in training, the forward and backward lanes' all-to-alls are
launched by the link's thread too, in the same order on every rank (bitwise: tests/
test_overlapped_pairs.py and tests/test_delay_wgrad.py run on gloo, so through the link)."""
import collections
import threading
import time

import pytest

from helpers import fresh_seed
from megalite.parallel import link
from megalite.testing import run_ranks


class _Work:
    """A collective in flight until `finish()`."""

    def __init__(self):
        self.finished = threading.Event()
        self.error = None

    def finish(self, error=None):
        self.error = error
        self.finished.set()

    def wait(self):
        self.finished.wait(10)
        if self.error is not None:
            raise self.error


def _eventually(condition, timeout=10.0):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


def test_each_collective_is_launched_when_the_one_before_it_is_done_in_the_order_submitted():
    launched, works = [], {}

    def collective(name, async_op=False):
        assert async_op
        launched.append((name, threading.current_thread().name))
        works[name] = _Work()
        return works[name]

    a = link.submit(collective, "a")
    b = link.submit(collective, "b")
    c = link.submit(collective, "c")
    assert launched == [("a", threading.current_thread().name)]  # the link was free: launched here
    assert not link.idle() and not a.is_completed()
    works["a"].finish()
    a.wait()
    _eventually(lambda: len(launched) == 2)
    assert launched[1] == ("b", "megalite-link") and not b.is_completed()
    works["b"].finish()
    _eventually(lambda: len(launched) == 3)
    assert launched[2] == ("c", "megalite-link")
    works["c"].finish()
    c.wait()
    assert b.is_completed() and c.is_completed() and link.idle()


def test_a_collective_that_fails_fails_those_behind_it_and_the_link_serves_new_ones():
    works = []

    def collective(async_op=False):
        works.append(_Work())
        return works[-1]

    def refused(async_op=False):
        raise RuntimeError("no such group")

    first, second = link.submit(collective), link.submit(collective)
    works[0].finish(RuntimeError("connection reset"))
    for submitted in (first, second):
        with pytest.raises(RuntimeError, match="connection reset"):
            submitted.wait()
    assert len(works) == 1 and link.idle()  # the second was never launched
    with pytest.raises(RuntimeError, match="no such group"):
        link.submit(refused).wait()
    again = link.submit(collective)
    works[-1].finish()
    again.wait()
    assert again.is_completed() and link.idle()


def _launchers(rank, world, runs, seed):
    """Per run: which threads launched its all-to-alls (how many each), and its parameters."""
    import torch.distributed as dist
    from training_ranks import train_params

    native, out = dist.all_to_all_single, []
    for argv in runs:
        threads = collections.Counter()

        def counted(*args, **kwargs):
            threads[threading.current_thread().name] += 1
            return native(*args, **kwargs)
        dist.all_to_all_single = counted
        try:
            result = train_params(rank, world, argv + ["--seed", str(seed)])
        finally:
            dist.all_to_all_single = native
        out.append({"threads": dict(threads), "params": result["params"], "losses": [
            r["loss"] for r in result["records"]]})
    return out


def test_a_pairs_all_to_alls_go_through_the_link_and_train_bitwise_alike():
    from test_overlapped_pairs import BASE, FLAG
    argv = BASE + ["--ep", "2", "--global-batch-size", "16"]  # 4 micro-batches a rank: 3 pairs a step
    for plain, paired in run_ranks(_launchers, 2, args=([argv, argv + [FLAG]], fresh_seed())):
        assert plain["losses"] == paired["losses"]
        assert all(p.equal(paired["params"][n]) for n, p in plain["params"].items())
        # the same all-to-alls; unpaired all from the main thread, paired some from the link's
        assert sum(plain["threads"].values()) == sum(paired["threads"].values())
        assert set(plain["threads"]) == {"MainThread"} and paired["threads"].get("megalite-link", 0) > 0
