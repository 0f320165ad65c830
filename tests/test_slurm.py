"""The Slurm batch scripts on a real one-node Slurm cluster that the test starts itself
(scripts/slurm/local_cluster.sh): a tiny tensor-parallel run to completion, and the requeue path
on USR1. Skipped where Slurm is not installed, except in CI, where .ci/setup_slurm.sh installs it."""
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli import ROOT
from slurm_cluster import SLURM, SlurmTestCluster, free_port

SHELL_SCRIPTS = [SLURM / "local_cluster.sh", SLURM / "cluster_common.sh", SLURM / "two_node_cluster.sh",
                 SLURM / "pretrain_gpt.sbatch", SLURM / "pretrain_bert.sbatch",
                 ROOT / ".ci" / "setup_slurm.sh"]
CPUS = len(os.sched_getaffinity(0))
TRAIN = ["--mock-data", "--tp", "2", "--log-interval", "1", "--seq-length", "32"]


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


class Cluster(SlurmTestCluster):
    script_name = "local_cluster.sh"

    def __init__(self, state: Path):
        super().__init__(state)
        self.env = {
            **os.environ,
            "MEGALITE_SLURM_DIR": str(state),
            # Free ports, so a cluster someone started by hand (default ports) is left alone.
            "MEGALITE_SLURMCTLD_PORT": str(free_port()),
            "MEGALITE_SLURMD_PORT": str(free_port()),
            "SLURM_CONF": str(state / "etc" / "slurm.conf"),
            # The job runs with the interpreter (and packages) of this test run.
            "MEGALITE_PYTHON": sys.executable,
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
            "MEGALITE_NPROC_PER_NODE": "2",
        }
        for knob in ("MEGALITE_QUIET", "MEGALITE_ROOT", "MEGALITE_CHECKPOINTS", "GPUS_PER_NODE", "RUN_DIR",
                     "CKPT_DIR", "MASTER_ADDR", "MASTER_PORT"):
            self.env.pop(knob, None)
        # The script's rendezvous host is Slurm's node name (hostname -s); where that does not
        # resolve (some containers), use loopback rather than fail on a host-setup detail.
        try:
            socket.gethostbyname(socket.gethostname().split(".")[0])
        except OSError:
            self.env["MASTER_ADDR"] = "127.0.0.1"



@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if shutil.which("sbatch") is None:
        if _in_ci():
            pytest.fail("sbatch not found although CI is set: .ci/setup_slurm.sh should have installed "
                        "slurm-wlm and munge before the tests")
        pytest.skip("Slurm is not installed (no sbatch); .ci/setup_slurm.sh installs it")
    c = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        up = c.script("start")
        assert up.returncode == 0, f"local_cluster.sh start failed:\n{up.stdout}\n{up.stderr}"
        yield c
    finally:
        down = c.script("stop")
        assert down.returncode == 0, down.stderr


def _job_log(workdir: Path) -> str:
    logs = sorted((workdir / "logs").glob("*.out"))
    return "\n".join(f"----- {p} -----\n{p.read_text(errors='replace')[-6000:]}" for p in logs) or "(no job log)"


def test_shell_scripts_parse():
    for path in SHELL_SCRIPTS:
        run = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert run.returncode == 0, f"{path}: {run.stderr}"


def test_bert_script_is_the_gpt_script_for_bert():
    # One launcher logic, kept in two files because #SBATCH lines cannot be shared.
    gpt = (SLURM / "pretrain_gpt.sbatch").read_text()
    bert = (SLURM / "pretrain_bert.sbatch").read_text()
    assert bert.replace("bert", "gpt").replace("BERT", "GPT") == gpt


def test_sbatch_trains_with_tensor_parallelism(cluster, tmp_path):
    # Submitted from outside the checkout with the default --output=logs/..., so the script must
    # find the checkout itself and the logs dir must exist beforehand (Slurm does not create it).
    (tmp_path / "logs").mkdir()
    metrics = tmp_path / "m.jsonl"
    cmd = ["sbatch", "--wait", "-N", "1", "--ntasks-per-node", "1", "--cpus-per-task", str(CPUS),
           str(SLURM / "pretrain_gpt.sbatch"), *TRAIN, "--train-iters", "5", "--metrics-file", str(metrics)]
    try:
        job = cluster.run(*cmd, timeout=300, cwd=tmp_path, env={"RUN_DIR": str(tmp_path / "run")})
    except subprocess.TimeoutExpired:
        pytest.fail(f"sbatch --wait ran past 300 s\n{_job_log(tmp_path)}\n{cluster.daemon_logs()}")
    detail = f"{job.stdout}\n{job.stderr}\n{_job_log(tmp_path)}"
    assert job.returncode == 0, f"job failed (exit {job.returncode}):\n{detail}\n{cluster.daemon_logs()}"

    assert metrics.exists(), detail
    # Training records only (evaluation records carry a "split" of their own).
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("split", "train") == "train"]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5], detail
    assert all(math.isfinite(r["loss"]) for r in records), records
    log = _job_log(tmp_path)
    assert "training step ended with exit code 0" in log, log


def test_usr1_stops_the_ranks_and_requeues_the_job(cluster, tmp_path):
    # What --signal=B:USR1@120 does before the time limit, sent now: the batch shell must pass
    # USR1 through srun and torchrun to the ranks, wait for them, and requeue the job.
    (tmp_path / "logs").mkdir()
    metrics = tmp_path / "m.jsonl"
    sub = cluster.run("sbatch", "--parsable", "-N", "1", "--cpus-per-task", str(CPUS),
                      str(SLURM / "pretrain_gpt.sbatch"), *TRAIN, "--train-iters", "100000",
                      "--metrics-file", str(metrics), cwd=tmp_path, env={"RUN_DIR": str(tmp_path / "run")})
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    try:
        _wait_for(lambda: metrics.exists() and metrics.read_text().strip(), 120,
                  lambda: f"no training iteration logged\n{_job_log(tmp_path)}")
        sig = cluster.run("scancel", "--batch", "--signal=USR1", job_id)
        assert sig.returncode == 0, sig.stderr

        def requeued():
            show = cluster.run("scontrol", "show", "job", job_id).stdout
            return "Restarts=1" in show and "JobState=PENDING" in show

        _wait_for(requeued, 120, lambda: f"job not requeued\n{_job_log(tmp_path)}\n{cluster.daemon_logs()}")
        log = _job_log(tmp_path)
        assert "requeueing" in log, log
        assert "closing signal SIGUSR1" in log, f"torchrun did not pass USR1 to the ranks:\n{log}"
    finally:
        cluster.run("scancel", job_id)


def _wait_for(condition, timeout: float, message):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    pytest.fail(message())
