"""The Slurm batch scripts on a real one-node Slurm cluster that the test starts itself
(scripts/slurm/local_cluster.sh): a tiny tensor-parallel run to completion, and the requeue path
on USR1. Skipped where Slurm is not installed, except in CI, where .ci/setup_slurm.sh installs it."""
import json
import math
import os
import socket
import subprocess
from pathlib import Path

import pytest

from cli import ROOT
from helpers import wait_for
from slurm_cluster import SLURM, SlurmTestCluster, free_port, job_log, job_port, require_slurm

SHELL_SCRIPTS = [SLURM / "local_cluster.sh", SLURM / "cluster_common.sh", SLURM / "two_node_cluster.sh",
                 SLURM / "pretrain_gpt.sbatch", SLURM / "pretrain_bert.sbatch",
                 ROOT / ".ci" / "setup_slurm.sh"]
CPUS = len(os.sched_getaffinity(0))
# Global batch 4 (2 micro-batches a step at tp 2, dp 1) and validation on one batch: a quarter of the
# defaults' compute a step; what these tests prove is the launch, restart and requeue around it.
TRAIN = ["--mock-data", "--tp", "2", "--log-interval", "1", "--seq-length", "32", "--global-batch-size", "4",
         "--eval-iters", "1"]


class Cluster(SlurmTestCluster):
    script_name = "local_cluster.sh"

    def __init__(self, state: Path):
        super().__init__(state, slurmd_port=str(free_port()))
        # The script's rendezvous host is Slurm's node name (hostname -s); where that does not
        # resolve (some containers), use loopback rather than fail on a host-setup detail.
        try:
            socket.gethostbyname(socket.gethostname().split(".")[0])
        except OSError:
            self.env["MASTER_ADDR"] = "127.0.0.1"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require_slurm()
    with Cluster(tmp_path_factory.mktemp("slurm")).started() as c:
        yield c


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
    metrics = tmp_path / "m.jsonl"
    detail = cluster.sbatch_wait(tmp_path, "-N", "1", "--ntasks-per-node", "1", "--cpus-per-task", str(CPUS),
                                 str(SLURM / "pretrain_gpt.sbatch"), *TRAIN, "--train-iters", "5",
                                 "--metrics-file", str(metrics), timeout=300)

    assert metrics.exists(), detail
    # Training records only (evaluation records carry a "split" of their own).
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("split", "train") == "train"]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5], detail
    assert all(math.isfinite(r["loss"]) for r in records), records
    log = job_log(tmp_path, tail=None)
    assert "training step ended with exit code 0" in log, log[-6000:]


@pytest.mark.slow
def test_a_killed_rank_restarts_in_place_and_says_what_it_cost(cluster, tmp_path):
    # MEGALITE_MAX_RESTARTS=1: torchrun --max-restarts 1; rank 1 is killed after iteration 4 (the
    # fault soak's MEGALITE_FAULTS); the ranks start again from the checkpoint of iteration 3.
    metrics = tmp_path / "m.jsonl"
    detail = cluster.sbatch_wait(tmp_path, "-N", "1", "--ntasks-per-node", "1", "--cpus-per-task", str(CPUS),
                                 str(SLURM / "pretrain_gpt.sbatch"), *TRAIN, "--train-iters", "6",
                                 "--save-interval", "3", "--metrics-file", str(metrics), timeout=300,
                                 env={"MEGALITE_MAX_RESTARTS": "1", "MEGALITE_FAULTS": "0:1@4:step",
                                      "MEGALITE_CKPT_DIR": str(tmp_path / "ckpt")})
    log = job_log(tmp_path, tail=None)
    assert "megalite: fault injected: step on rank 1 in iteration 4 (attempt 0)" in log, detail + log
    assert ("megalite: restart: the previous attempt reached iteration 4; resuming from the checkpoint of "
            "iteration 3 recomputes 1 iteration(s)") in log, log[-6000:]
    assert "training step ended with exit code 0" in log, log[-6000:]


def test_usr1_stops_the_ranks_and_requeues_the_job(cluster, tmp_path):
    # What --signal=B:USR1@120 does before the time limit, sent now: the batch shell must pass
    # USR1 through srun and torchrun to the ranks, wait for them, and requeue the job.
    (tmp_path / "logs").mkdir()
    metrics = tmp_path / "m.jsonl"
    sub = cluster.run("sbatch", "--parsable", "-N", "1", "--cpus-per-task", str(CPUS),
                      str(SLURM / "pretrain_gpt.sbatch"), *TRAIN, "--train-iters", "100000",
                      "--metrics-file", str(metrics), cwd=tmp_path,
                      env={"RUN_DIR": str(tmp_path / "run"), "MASTER_PORT": job_port()})
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    try:
        wait_for(lambda: metrics.exists() and metrics.read_text().strip(), 120,
                 lambda: f"no training iteration logged\n{job_log(tmp_path)}", poll=0.5)
        sig = cluster.run("scancel", "--batch", "--signal=USR1", job_id)
        assert sig.returncode == 0, sig.stderr

        def requeued():
            show = cluster.run("scontrol", "show", "job", job_id).stdout
            return "Restarts=1" in show and "JobState=PENDING" in show

        wait_for(requeued, 120, lambda: f"job not requeued\n{job_log(tmp_path)}\n{cluster.daemon_logs()}", poll=0.5)
        log = job_log(tmp_path, tail=None)
        assert "requeueing" in log, log[-6000:]
        assert "closing signal SIGUSR1" in log, f"torchrun did not pass USR1 to the ranks:\n{log}"
    finally:
        cluster.run("scancel", job_id)

