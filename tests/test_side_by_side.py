"""A pair's exchanges side by side on gloo (issue #50): each lane launches its collective the moment
it reaches it, beside the other lane's still in flight (megalite.parallel.lanes,
`_Pair.side_by_side`). Claims: the backward lane's exchange is launched while the forward lane's is
still in flight, and each lane gets its own result; a pipeline receive in flight on the other lane is
still waited for before a launch, and a posted exchange still waits for the other lane's collective;
in training at EP 2 some all-to-alls are launched while the other lane's is in flight, as many
all-to-alls as unpaired, and the numbers are bitwise (so are every paired layout's in
tests/test_overlapped_pairs.py, test_delay_wgrad.py and test_moe_dispatch_chunks.py, all on gloo)."""
import threading

from helpers import fresh_seed
from megalite.parallel import lanes
from megalite.testing import run_ranks


class _Work:
    """A collective in flight until `finish()`."""

    def __init__(self, log, name):
        self.log, self.name, self.finished = log, name, threading.Event()

    def finish(self):
        self.finished.set()

    def is_completed(self):
        return self.finished.is_set()

    def wait(self):
        assert self.finished.wait(10), f"{self.name} never finished"
        self.log.append(("done", self.name))


def _pair(monkeypatch, side_by_side: bool):
    """Each lane launches one collective; returns the log of launches (with what was in flight then)
    and completions. The forward's is finished only once the backward's has been launched, or after
    a moment where the backward's launch waits for it (the link one at a time)."""
    monkeypatch.setattr(lanes, "_side_by_side_applies", lambda: side_by_side)
    log, works = [], {}

    def collective(name, async_op=False):
        assert async_op
        log.append(("launch", name, sorted(n for n, w in works.items() if not w.is_completed())))
        works[name] = _Work(log, name)
        if name == "B":
            works["F"].finish()
        return works[name]

    def forward():
        lanes.collective(collective, "F", kind="ep")

    def backward():
        threading.Timer(0.3, lambda: works["F"].finish()).start()
        threading.Timer(0.5, lambda: works["B"].finish()).start()
        lanes.collective(collective, "B", kind="ep")
    lanes.run_pair(forward, backward)
    return log


def test_on_gloo_the_backward_lane_launches_beside_the_forward_lanes_exchange(monkeypatch):
    log = _pair(monkeypatch, side_by_side=True)
    assert log[:2] == [("launch", "F", []), ("launch", "B", ["F"])]  # F still in flight at B's launch
    assert {e[1] for e in log if e[0] == "done"} == {"F", "B"}


def test_elsewhere_a_lane_waits_for_the_other_lanes_exchange_before_launching(monkeypatch):
    log = _pair(monkeypatch, side_by_side=False)
    assert log[:3] == [("launch", "F", []), ("done", "F"), ("launch", "B", [])]


def test_a_pipeline_receive_on_the_other_lane_is_still_waited_for_before_a_launch(monkeypatch):
    monkeypatch.setattr(lanes, "_side_by_side_applies", lambda: True)
    log, receive = [], _Work([], "recv")

    def collective(name, async_op=False):
        log.append(("launch", name, receive.is_completed()))
        work = _Work(log, name)
        work.finish()
        return work

    def forward():
        threading.Timer(0.2, receive.finish).start()
        lanes.wait(receive, "pp")  # hands the turn over with the receive in flight

    def backward():
        lanes.collective(collective, "B", kind="ep")
    lanes.run_pair(forward, backward)
    assert log[0] == ("launch", "B", True)


def _launches(rank, world, runs, seed):
    """Per run: its all-to-alls, how many were launched while another was in flight, and its
    parameters and losses."""
    import torch.distributed as dist
    from training_ranks import train_params

    native, out = dist.all_to_all_single, []
    for argv in runs:
        in_flight, counts = [], {"launched": 0, "beside": 0}

        def counted(*args, async_op=False, **kwargs):
            counts["launched"] += 1
            in_flight[:] = [w for w in in_flight if not w.is_completed()]
            counts["beside"] += bool(in_flight)
            work = native(*args, async_op=async_op, **kwargs)
            if async_op:
                in_flight.append(work)
            return work
        dist.all_to_all_single = counted
        try:
            result = train_params(rank, world, argv + ["--seed", str(seed)])
        finally:
            dist.all_to_all_single = native
        out.append({**counts, "params": result["params"], "losses": [r["loss"] for r in result["records"]]})
    return out


def test_a_pairs_all_to_alls_fly_side_by_side_and_train_bitwise_alike():
    from test_overlapped_pairs import BASE, FLAG
    argv = BASE + ["--ep", "2", "--global-batch-size", "16"]  # 4 micro-batches a rank: 3 pairs a step
    for plain, paired in run_ranks(_launches, 2, args=([argv, argv + [FLAG]], fresh_seed())):
        assert plain["losses"] == paired["losses"]
        assert all(p.equal(paired["params"][n]) for n, p in plain["params"].items())
        assert plain["launched"] == paired["launched"] and plain["beside"] == 0
        assert paired["beside"] > 0  # launched while the other lane's was in flight
