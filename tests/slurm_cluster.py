"""What the Slurm test clusters (tests/test_slurm.py, tests/test_multinode.py) share: a state
directory, the environment their daemons and jobs see, the scripts/slurm/*.sh that runs them,
and submitting a job and waiting for it."""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cli import ROOT

SLURM = ROOT / "scripts" / "slurm"
# Settings of the calling shell that would change what a job does (where it looks for the checkout
# and checkpoints, where it logs, how it rendezvous), or that torchrun sets for its ranks.
JOB_KNOBS = ("MEGALITE_QUIET", "MEGALITE_ROOT", "MEGALITE_CHECKPOINTS", "GPUS_PER_NODE", "RUN_DIR", "CKPT_DIR",
             "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_port() -> str:
    """A free rendezvous port for a test job. The scripts' default, 20000 + job id, repeats in every
    test cluster (job ids start at 1), so a port still held on the machine would fail the job
    (seen once in CI: EADDRINUSE on 20001)."""
    return str(free_port())


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def job_env(**extra: str) -> dict:
    """This environment without JOB_KNOBS, with this test run's interpreter first on PATH, plus `extra`."""
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
           **extra}
    for knob in JOB_KNOBS:
        env.pop(knob, None)
    return env


def require_slurm():
    """Skips the test where Slurm is not installed; fails it in CI, where it must be."""
    if shutil.which("sbatch") is None:
        if in_ci():
            pytest.fail("sbatch not found although CI is set: .ci/setup_slurm.sh should have installed "
                        "slurm-wlm and munge before the tests")
        pytest.skip("Slurm is not installed (no sbatch); .ci/setup_slurm.sh installs it")


def job_log(workdir: Path, tail: int | None = 6000) -> str:
    """Every job log under workdir/logs (the sbatch scripts' default --output): the last `tail`
    characters of each (for a failure's message), or all of it (tail None: what a test reads; a
    long traceback at the end, torchrun's at its exit barrier say, must not push out the start)."""
    logs = sorted((workdir / "logs").glob("*.out"))
    text = (p.read_text(errors="replace") for p in logs)
    return "\n".join(f"----- {p} -----\n{t if tail is None else t[-tail:]}" for p, t in zip(logs, text)) \
        or "(no job log)"


class SlurmTestCluster:
    """A cluster started by scripts/slurm/`script_name` with state under `state`. `env` (the
    environment of the script, the daemons and every command run) is job_env with the cluster's
    settings, its slurmd port and `extra`; jobs run 2 ranks a node with this test run's Python."""
    script_name: str

    def __init__(self, state: Path, slurmd_port: str, **extra: str):
        self.state = state
        self.env = job_env(MEGALITE_SLURM_DIR=str(state),
                           # A free port, so a cluster someone started by hand (default ports) is left alone.
                           MEGALITE_SLURMCTLD_PORT=str(free_port()),
                           MEGALITE_SLURMD_PORT=slurmd_port,
                           SLURM_CONF=str(state / "etc" / "slurm.conf"),
                           MEGALITE_PYTHON=sys.executable,
                           MEGALITE_NPROC_PER_NODE="2",
                           **extra)

    def script(self, action: str, timeout: float = 120):
        return subprocess.run(["bash", str(SLURM / self.script_name), action], env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    @contextlib.contextmanager
    def started(self):
        """The cluster up for the block, stopped after it whatever happens."""
        try:
            up = self.script("start")
            assert up.returncode == 0, f"{self.script_name} start failed:\n{up.stdout}\n{up.stderr}"
            yield self
        finally:
            down = self.script("stop")
            assert down.returncode == 0, down.stderr

    def run(self, *cmd: str, timeout: float = 30, cwd=None, env=None):
        return subprocess.run(list(cmd), env={**self.env, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout, cwd=cwd)

    def daemon_logs(self) -> str:
        return "\n".join(f"----- {p} -----\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted((self.state / "log").glob("*.log")))

    def sbatch_wait(self, workdir: Path, *sbatch_args: str, timeout: float, env: dict | None = None) -> str:
        """Submits from workdir (job logs in workdir/logs, metrics under workdir/run), waits for the
        job, fails the test unless it ended with exit code 0; returns sbatch's output and the job log.
        `env`: more variables for the job."""
        # Slurm does not create the --output dir; a missing one fails the job silently.
        (workdir / "logs").mkdir()
        try:
            job = self.run("sbatch", "--wait", *sbatch_args, timeout=timeout, cwd=workdir,
                           env={"RUN_DIR": str(workdir / "run"), "MASTER_PORT": job_port(), **(env or {})})
        except subprocess.TimeoutExpired:
            pytest.fail(f"sbatch --wait ran past {timeout:.0f} s\n{job_log(workdir)}\n{self.daemon_logs()}")
        detail = f"{job.stdout}\n{job.stderr}\n{job_log(workdir)}"
        assert job.returncode == 0, f"job failed (exit {job.returncode}):\n{detail}\n{self.daemon_logs()}"
        return detail
