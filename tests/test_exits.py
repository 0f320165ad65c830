"""ExitWatch: every rank stops after the same iteration, agreed through a host-side all-reduce that
never waits on the device, and none at all when nothing can ask for an exit."""
from __future__ import annotations

import pytest

from megalite.testing import run_ranks
from training_ranks import parse


def watch_until_stop(rank, world, argv, signal_rank, signal_at, failing_rank=None):
    from megalite.exits import ExitWatch
    from megalite.runtime import TrainingStopped

    failed = {"text": None}
    watch = ExitWatch(parse(argv), checkpoint_error=lambda: failed["text"], watch_checkpoints=failing_rank is not None)
    out = None
    for iteration in range(1, 20):
        if rank == signal_rank and iteration == signal_at:
            watch.signal_name = "SIGTERM"  # what the handler records
        if rank == failing_rank and iteration == signal_at:
            failed["text"] = "checkpoint of iteration 2 was not saved: disk full"
        try:
            reason = watch.reason(iteration)
        except TrainingStopped as e:
            out = (iteration, f"stopped: {e}")
            break
        if reason:
            out = (iteration, reason)
            break
    watch.close()
    return out, watch.exchanges


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_iteration():
    results = run_ranks(watch_until_stop, 3, args=([], 2, 5))
    assert [r[0] for r in results] == [(6, "signal received by another rank")] * 2 + [(6, "signal SIGTERM")], \
        "one iteration after the flag was raised, on every rank"


def test_a_failed_background_save_stops_every_rank_with_its_message():
    results = run_ranks(watch_until_stop, 2, args=(["--no-exit-signal-handler"], None, 3, 1))
    assert [r[0][0] for r in results] == [4, 4]
    assert results[1][0][1] == "stopped: checkpoint of iteration 2 was not saved: disk full"
    assert results[0][0][1].startswith("stopped: a background checkpoint save failed on another rank")


def test_exit_interval_needs_no_communication():
    results = run_ranks(watch_until_stop, 2, args=(["--no-exit-signal-handler", "--exit-interval", "4"], None, 99))
    assert [r[0] for r in results] == [(4, "--exit-interval 4")] * 2
    assert [r[1] for r in results] == [0, 0], "no signal handler, no time limit, no async save: no all-reduce"


@pytest.mark.parametrize("argv", [[], ["--exit-duration-in-mins", "60", "--no-exit-signal-handler"]])
def test_flags_are_exchanged_once_per_iteration_when_something_can_raise_one(argv):
    results = run_ranks(watch_until_stop, 2, args=(argv, None, 99))
    assert [r[0] for r in results] == [None, None]
    assert [r[1] for r in results] == [19, 19]
