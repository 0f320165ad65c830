"""The failure path where collectives do not block the host (NCCL): a lost rank still ends the
others with megalite's one line and exit code 4, found by the heartbeat monitor."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from cli import ROOT, records

TESTS = ROOT / "tests"


def _launch(world, argv, script, env_extra):
    port = 30000 + os.getpid() % 1000
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{ROOT}:{TESTS}", **env_extra}
        env.pop("MEGALITE_QUIET", None)
        procs.append(subprocess.Popen([sys.executable, str(script), *argv], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=ROOT))
    return procs


def test_a_lost_rank_is_named_even_when_collectives_never_block(tmp_path):
    metrics = tmp_path / "m.jsonl"
    procs = _launch(2, ["--mock-data", "--train-iters", "100000", "--log-interval", "1", "--seq-length", "16",
                        "--metrics-file", str(metrics)], TESTS / "nonblocking_rank.py",
                    {"MEGALITE_HEARTBEAT_TIMEOUT_S": "4"})
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(records(metrics)) >= 3):
        assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].communicate()[1][-3000:]
        time.sleep(0.2)
    procs[1].kill()
    out, err = procs[0].communicate(timeout=60)
    procs[1].communicate()
    assert procs[0].returncode == 4, err[-3000:]
    lines = [x for x in err.splitlines() if x.startswith("megalite: error:")]
    assert len(lines) == 1, err[-3000:]
    assert "rank 0 lost contact with another rank in iteration" in lines[0]
    assert "(lost: rank 1, no heartbeat for 4 s)" in lines[0]


def test_a_rank_that_finished_is_not_called_lost(tmp_path):
    """Ranks finish at slightly different moments; a finished neighbour stops beating on purpose."""
    procs = _launch(2, ["--mock-data", "--train-iters", "3", "--seq-length", "16"], ROOT / "pretrain_gpt.py",
                    {"MEGALITE_HEARTBEAT_TIMEOUT_S": "2"})
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
