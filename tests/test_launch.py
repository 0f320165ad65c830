"""`python -m megalite.launch`: torchrun whose SIGTERM / SIGUSR1 reach the workers, which save and
exit 0, and so does the launcher (plain torchrun exits 1 with a traceback of its own)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from cli import ROOT


def _launch(tmp_path, launcher: list[str]):
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", *launcher, "--standalone", "--nproc_per_node", "2", str(ROOT / "pretrain_gpt.py"),
           "--mock-data", "--train-iters", "100000", "--log-interval", "1", "--seq-length", "16",
           "--save", str(tmp_path / "ckpt"), "--metrics-file", str(metrics)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MEGALITE_QUIET", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            return proc
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read()[-3000:])
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("training did not start within 120 s")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_to_the_launcher_saves_and_exits_zero(tmp_path, sig):
    proc = _launch(tmp_path, ["megalite.launch"])
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "stopping after iteration" in out and f"signal {sig.name}" in out, out[-2000:]
    latest = (tmp_path / "ckpt" / "latest").read_text().strip()
    assert latest.startswith("iter_") and int(latest[5:]) >= 3


def test_worker_pids_lists_the_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        from megalite.launch import worker_pids

        assert child.pid in worker_pids()
    finally:
        child.kill()
        child.wait()
