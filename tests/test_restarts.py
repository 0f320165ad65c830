"""Automatic restarts (issue #34): the line a restarted run prints. The restarts themselves (a rank
killed under `torchrun --max-restarts`, the job resumed from the latest complete checkpoint and
ending bit for bit as the run that never failed) are run by the fault soak: tests/test_soak.py."""
from __future__ import annotations

import json

from megalite.training.restarts import PROGRESS_FILE, restart_line


def test_the_restart_line_counts_iterations_and_seconds(tmp_path):
    class Cfg:
        class checkpoint:
            save = load = str(tmp_path)

    assert restart_line(Cfg, 3) is None  # no record: a first start
    (tmp_path / PROGRESS_FILE).write_text(json.dumps({"iteration": 7, "time": 130.0, "attempt": 0,
                                                      "start_iteration": 0, "started": 60.0}))
    assert restart_line(Cfg, 7) is None  # the checkpoint is where it stopped: nothing lost
    assert restart_line(Cfg, 5, now=150.0) == (
        "megalite: restart: the previous attempt reached iteration 7; resuming from the checkpoint of iteration 5 "
        "recomputes 2 iteration(s) (about 20.0 s of training), and 20.0 s passed from its last progress to this start")
