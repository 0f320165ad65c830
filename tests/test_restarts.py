"""Automatic restarts (issue #34): under `torchrun --max-restarts 1` with `--load` equal to `--save`,
a rank killed mid-run restarts the job from the latest complete checkpoint without a person; the
restarted run says what the fault cost (iterations recomputed, seconds) and ends with the losses
of the run that never failed, bit for bit."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cli import ROOT
from megalite.training.restarts import PROGRESS_FILE, restart_line

ARGS = ["--mock-data", "--train-iters", "8", "--log-interval", "1", "--seq-length", "16", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--eval-interval", "0", "--save-interval", "3"]


def _run(tmp_path, name, extra_env=None, restarts=0):
    d, metrics = tmp_path / name, tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", str(restarts), str(ROOT / "pretrain_gpt.py"), *ARGS, "--save", str(d), "--load", str(d),
           "--metrics-file", str(metrics)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    env.pop("MEGALITE_QUIET", None)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return out, {r["iteration"]: r["loss"] for r in records if r.get("split", "train") == "train"}


@pytest.mark.slow
def test_a_killed_rank_restarts_the_job_from_the_latest_checkpoint_and_ends_as_the_unbroken_run(tmp_path):
    unbroken, want = _run(tmp_path, "unbroken")
    assert unbroken.returncode == 0, unbroken.stderr[-3000:]
    out, got = _run(tmp_path, "killed", {"MEGALITE_FAULTS": "0:1@5:step"}, restarts=1)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("megalite: restart:")]
    assert len(lines) == 1 and ("the previous attempt reached iteration 5; resuming from the checkpoint of iteration "
                                "3 recomputes 2 iteration(s)") in lines[0], out.stdout[-3000:]
    assert "resumed from" in out.stdout
    assert [got[i] for i in range(4, 9)] == [want[i] for i in range(4, 9)]  # bit for bit


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
