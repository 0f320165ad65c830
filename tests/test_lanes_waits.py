"""megalite.parallel.lanes draws each wait of the compute for a collective on the timeline's compute
row (`<kind>-wait`, issue #50): of a collective launched without waiting, the part after its rank
came to wait for it (what compute did not hide); of a blocking one, all of it. Not the pipeline's
receives, whose waits the executor draws itself ("p2p-wait")."""
import time

from megalite.parallel import lanes


class _DoneAt:
    """A collective in flight until a given time."""

    def __init__(self, at: float):
        self.at = at

    def wait(self):
        while time.perf_counter() < self.at:
            time.sleep(0.001)

    def is_completed(self):
        return time.perf_counter() >= self.at


def test_each_wait_for_a_collective_is_drawn_from_when_the_rank_came_to_it():
    spans = []
    with lanes.recording(spans):
        launched = time.perf_counter()
        work = _DoneAt(launched + 0.06)
        time.sleep(0.03)  # compute that hides half of it
        came = time.perf_counter()
        lanes.wait(work, "sp", launched)
        lanes.collective(lambda seconds: time.sleep(seconds), 0.02, kind="tp")  # blocking
        lanes.wait(_DoneAt(time.perf_counter() + 0.01), "pp", time.perf_counter())
    by_cat = {}
    for name, cat, start, duration, *row in spans:
        by_cat.setdefault(cat, []).append((name, start, duration, row))
    (sp_wait,) = by_cat["sp-wait"]
    assert sp_wait[0] == "wait for sp" and sp_wait[3] == []  # on the compute row
    assert abs(sp_wait[1] - came) < 0.005 and 0.02 < sp_wait[2] < 0.05  # not the 30 ms hidden
    (sp_comm,) = by_cat["sp-comm"]
    assert sp_comm[1] == launched and sp_comm[2] > 0.055  # in flight from its launch, on a row of its own
    (tp_wait,) = by_cat["tp-wait"]
    assert 0.018 < tp_wait[2] < 0.05  # a blocking collective: waited for from its launch
    assert "pp-wait" not in by_cat and "pp-comm" in by_cat
    # nothing is drawn when no step records spans
    lanes.wait(_DoneAt(time.perf_counter()), "sp", time.perf_counter())
    assert len(spans) == 5


def test_each_lane_of_a_pair_names_its_waits_apart():
    """Inside an overlapped pair each lane's waits carry the lane in their name (each lane's come in
    one order on every rank, the two lanes' interleaved as the ranks' timing falls:
    scripts/slow_links.py matches them lane by lane); outside a pair, the plain name."""
    spans = []

    def lane_pass(seconds):
        def run():
            for _ in range(2):
                lanes.wait(_DoneAt(time.perf_counter() + seconds), "ep", time.perf_counter())
        return run

    with lanes.recording(spans):
        lanes.run_pair(lane_pass(0.004), lane_pass(0.002))
        lanes.wait(_DoneAt(time.perf_counter() + 0.002), "ep", time.perf_counter())
    names = [name for name, cat, *_ in spans if cat == "ep-wait"]
    assert sorted(names) == ["wait for ep"] + ["wait for ep (B lane)"] * 2 + ["wait for ep (F lane)"] * 2
    assert names[-1] == "wait for ep"
