"""RNGStatesTracker.fork: nested forks continue a stream's sequence instead of replaying it, on
every kind of device the tracker swaps, at tp=1 and on two TP ranks."""
import torch

from helpers import fresh_seed
from megalite import parallel
from megalite.parallel import random as rng
from megalite.testing import run_ranks

STREAM = "stream"


def _tracker(seed: int, *names: str) -> rng.RNGStatesTracker:
    tracker = rng.RNGStatesTracker()
    for i, name in enumerate(names or (STREAM,)):
        tracker.add(name, seed + i)
    return tracker


def _outer_inner_outer(tracker, draw, name=STREAM):
    with tracker.fork(name):
        before = draw(3)
        with tracker.fork(name):
            inner = draw(4)
        after = draw(5)
    return torch.cat([before, inner, after])


def _unbroken(tracker, draw, name=STREAM):
    with tracker.fork(name):
        return draw(12)


def test_nested_fork_of_the_same_stream_continues_its_sequence():
    seed = fresh_seed()
    nested = _outer_inner_outer(_tracker(seed), torch.rand)
    assert torch.equal(nested, _unbroken(_tracker(seed), torch.rand)), "the inner fork replayed or skipped draws"


def test_nested_forks_leave_the_default_stream_untouched():
    seed = fresh_seed()
    torch.manual_seed(seed)
    _outer_inner_outer(_tracker(seed + 1), torch.rand)
    after_forks = torch.rand(6)
    torch.manual_seed(seed)
    assert torch.equal(after_forks, torch.rand(6))


def test_fork_of_another_stream_inside_a_fork_hands_the_outer_stream_back_where_it_stopped():
    seed = fresh_seed()
    tracker = _tracker(seed, "a", "b")
    with tracker.fork("a"):
        before = torch.rand(3)
        with tracker.fork("b"):
            other = torch.rand(4)
        after = torch.rand(5)
    alone = _tracker(seed, "a", "b")
    assert torch.equal(torch.cat([before, after]), _unbroken(alone, lambda n: torch.rand(8), "a"))
    assert torch.equal(other, _unbroken(alone, lambda n: torch.rand(4), "b"))


def test_nested_forks_follow_one_sequence_on_every_device_kind(monkeypatch):
    # The CUDA RNG goes through the same per-device code as the CPU's; a second device kind,
    # backed by its own generator and seeded lazily like CUDA, stands in for it here.
    fake_global = torch.Generator()
    fake = rng._Device(fake_global.get_state, fake_global.set_state, rng._cpu_seeded)
    monkeypatch.setattr(rng, "_devices_in_use", lambda: {"cpu": rng._CPU, "fake": fake})

    def draw(n):
        return torch.cat([torch.rand(n), torch.rand(n, generator=fake_global)])

    seed = fresh_seed()
    nested = _outer_inner_outer(_tracker(seed), draw)
    unbroken = _unbroken(_tracker(seed), draw)
    cpu, fake_drawn = unbroken.split(12)
    expected = torch.cat([cpu[:3], fake_drawn[:3], cpu[3:7], fake_drawn[3:7], cpu[7:], fake_drawn[7:]])
    assert torch.equal(nested, expected)


def test_states_read_inside_a_fork_are_where_the_stream_has_got_to():
    # What a checkpoint (or activation recomputation) saves mid-fork must resume the stream there.
    tracker = _tracker(fresh_seed())
    with tracker.fork(STREAM):
        torch.rand(3)
        saved = tracker.get_states()
        expected = torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork(STREAM):
        assert torch.equal(torch.rand(4), expected)


def _nested_and_unbroken_on_tp_ranks(rank, world, seed):
    parallel.initialize_model_parallel(world)
    parallel.model_parallel_manual_seed(seed)
    tracker = parallel.get_rng_tracker()
    nested = _outer_inner_outer(tracker, torch.rand, rng.MODEL_PARALLEL_RNG)
    parallel.model_parallel_manual_seed(seed)
    return nested, _unbroken(tracker, torch.rand, rng.MODEL_PARALLEL_RNG)


def test_nested_fork_continues_the_tp_stream_on_each_of_two_tp_ranks():
    (nested0, unbroken0), (nested1, unbroken1) = run_ranks(_nested_and_unbroken_on_tp_ranks, 2,
                                                           args=(fresh_seed(),))
    assert torch.equal(nested0, unbroken0) and torch.equal(nested1, unbroken1)
    assert not torch.equal(unbroken0, unbroken1), "TP ranks must draw from different streams"
