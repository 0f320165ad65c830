"""The fault soak (issue #34): fault points fire where and when they are named, the sample log's
lineage counts lost and repeated samples, and a short soak survives every fault it injects."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from cli import ROOT
from megalite import faults
from megalite.training.sample_log import lineage


@pytest.fixture
def armed(monkeypatch):
    def arm(spec: str, start: int = 0):
        monkeypatch.setattr(faults, "_SPEC", spec)
        monkeypatch.setattr(faults, "_fired", set())
        monkeypatch.setattr(faults, "_this_process", None)
        faults.set_iteration(start + 1, start)
    yield arm
    faults.set_iteration(0, 0)


def test_fault_specs_parse_and_bad_ones_are_named():
    assert faults.parse("0:1@5:step, 2:0@+3:p2p") == [(0, 1, "5", "step"), (2, 0, "+3", "p2p")]
    with pytest.raises(ValueError, match="'0:1:step' is not <attempt>:<rank>@<iteration>:<point>"):
        faults.parse("0:1:step")
    with pytest.raises(ValueError, match="point 'boom' is not one of step, term"):
        faults.parse("0:0@1:boom")
    for never in ("0:0@0:step", "0:0@-2:step", "0:0@+-1:step"):  # could never fire
        with pytest.raises(ValueError, match="is not <attempt>"):
            faults.parse(never)


def test_a_point_fires_once_for_its_rank_attempt_and_iteration(armed, monkeypatch, capsys):
    sent = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(sig))
    armed("0:0@3:step,1:0@2:step,0:1@2:step")  # attempt 1 and rank 1 are not this process
    for i in (1, 2, 3, 3, 4):
        faults.set_iteration(i)
        faults.point("step")
        faults.point("p2p")  # not named: never fires
    assert sent == [signal.SIGKILL]
    assert capsys.readouterr().err == "megalite: fault injected: step on rank 0 in iteration 3 (attempt 0)\n"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    armed("0:0@3:step,1:0@2:term")
    faults.set_iteration(2)
    faults.point("term")
    assert sent == [signal.SIGKILL, signal.SIGTERM]


def test_a_relative_iteration_counts_from_the_resume_and_fires_at_the_first_point_after(armed, monkeypatch):
    sent = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(sig))
    armed("0:0@+3:save", start=10)
    for i in (11, 12):
        faults.point("save", i)
    assert sent == []
    faults.point("save", 14)  # no save at 13: the first one at or after 10 + 3
    faults.point("save", 16)
    assert sent == [signal.SIGKILL]


def test_enospc_raises_a_full_disk_error_in_the_writer(armed):
    armed("0:0@+1:enospc", start=4)
    with pytest.raises(OSError, match="No space left on device"):
        faults.point("enospc", 6)


def _write_log(directory, records):
    directory.mkdir(exist_ok=True)
    by_rank = {}
    for rank, r in records:
        by_rank.setdefault(rank, []).append(json.dumps(r))
    for rank, lines in by_rank.items():
        (directory / f"samples-rank{rank}.jsonl").write_text("\n".join(lines) + "\n{\"cut short")


def _consumed(run, iteration, dp, dp_size=2, batch=4):
    per = batch // dp_size
    first = (iteration - 1) * batch + dp * per
    return {"run": run, "iteration": iteration, "dp": dp, "samples": list(range(first, first + per)), "t": 0.0}


def test_lineage_follows_the_runs_back_through_a_rollback(tmp_path):
    # run a: iterations 1-5 (killed in 5); b resumed from a's checkpoint 4, ran 5-7 (killed);
    # c resumed from a's checkpoint 4 again (b's 6 was damaged) and at dp 1 ran 5-8.
    records = [(d, _consumed("a", i, d)) for i in range(1, 6) for d in (0, 1)]
    records += [(0, {"run": "b", "resumed": 4, "from_run": "a"})]
    records += [(d, _consumed("b", i, d)) for i in range(5, 8) for d in (0, 1)]
    records += [(0, {"run": "c", "resumed": 4, "from_run": "a"})]
    records += [(0, _consumed("c", i, 0, dp_size=1)) for i in range(5, 9)]
    _write_log(tmp_path / "s", records)
    line = lineage(tmp_path / "s", "c", 8)
    assert line.runs == [("a", 1, 4), ("c", 5, 8)] and not line.missing
    assert line.counts(range(32)) == (0, 0)
    assert line.samples[5] == [16, 17, 18, 19]


def test_lost_and_repeated_samples_and_missing_iterations_are_counted(tmp_path):
    records = [(d, _consumed("a", i, d)) for i in (1, 2, 4) for d in (0, 1)]  # iteration 3 never logged
    records += [(1, {**_consumed("a", 5, 1), "samples": [16, 17]})]  # dp 1 re-read dp 0's samples
    records += [(0, _consumed("a", 5, 0))]
    _write_log(tmp_path / "s", records)
    line = lineage(tmp_path / "s", "a", 5)
    assert line.missing == [("a", 3)]
    assert line.counts(range(20)) == (4 + 2, 2)  # 8-11 (iteration 3) and 18-19 lost; 16-17 twice


def _save_then_resume(rank, world, save, samples):
    """Train 3 iterations and save; resume and train to 5; (the run ids the checkpoints record)."""
    from megalite import checkpoint
    from training_ranks import gpt_run

    common = ["--seq-length", "16", "--global-batch-size", "4", "--micro-batch-size", "1", "--eval-interval", "0",
              "--save", save, "--load", save, "--sample-log", samples, "--save-interval", "3"]
    gpt_run(common + ["--train-iters", "5", "--exit-interval", "3"])
    first = checkpoint.CheckpointReader(save).metadata["run"]
    gpt_run(common + ["--train-iters", "5"])
    return first, checkpoint.CheckpointReader(save).metadata["run"]


def test_the_loop_logs_samples_steps_and_resumes_and_checkpoints_name_their_run(tmp_path):
    from megalite.testing import run_ranks

    samples = tmp_path / "samples"
    first, second = run_ranks(_save_then_resume, 2, args=(str(tmp_path / "ckpt"), str(samples)))[0]
    assert first != second and len(first) == 16
    records = [json.loads(x) for f in sorted(samples.glob("*.jsonl")) for x in f.read_text().splitlines()]
    assert {"run": second, "resumed": 3, "from_run": first} in records
    consumed = {(r["run"], r["iteration"], r["dp"]): r["samples"] for r in records if "samples" in r}
    assert consumed[(first, 1, 1)] == [2, 3] and consumed[(second, 4, 0)] == [12, 13]
    assert sorted(r["done"] for r in records if "done" in r) == [1, 2, 3, 4, 5]
    held = lineage(samples, second, 5)
    assert held.runs == [(first, 1, 3), (second, 4, 5)] and held.counts(range(20)) == (0, 0)


@pytest.mark.slow
def test_a_short_soak_survives_every_fault_with_nothing_lost(tmp_path):
    """A few faults of the seeded schedule (a full disk as injected ENOSPC: the CI machine need not
    mount a tmpfs); the 200-fault run is in docs/BENCHMARKS.md. Seed 160 draws, on track `fixed`
    (ZeRO-3), one job of three attempts under torchrun's restarts: a kill after a step, a kill inside
    a save, a SIGTERM; then the last job. A job start costs seconds, so one track (4 starts fewer
    than two): local SGD's resume, bit for bit, is tests/test_local_sgd.py's."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--faults", "3", "--seed", "160",
                          "--tracks", "fixed", "--no-tmpfs", "--workdir", str(tmp_path), "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"soak: (\d+) faults injected, (\d+) survived, 0 samples lost, 0 repeated, "
                     r"final loss gap 0 vs the uninterrupted run", last)
    assert m and m.group(1) == m.group(2) == "3", last
    tracks = json.loads((tmp_path / "r.json").read_text())["tracks"]
    assert all(t["final_state_gap"] == 0 and t["max_loss_gap"] == 0 for t in tracks)
    assert sorted(k for t in tracks for k in t["kinds"]) == ["save", "step", "term"]  # what seed 160 draws
    # torchrun's automatic restarts said what each kill cost (megalite.training.restarts)
    logs = "".join(p.read_text() for p in tmp_path.glob("*/job-*.log"))
    assert re.search(r"megalite: restart: the previous attempt reached iteration \d+; resuming from the checkpoint "
                     r"of iteration \d+ recomputes \d+ iteration\(s\)", logs)
