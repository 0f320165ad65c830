"""The flags scripts/slurm/*.sbatch put before a job's own: checkpoints on by default, in a
directory a requeued job finds again. The script runs under bash with a stand-in `srun` that
records its command line, so no Slurm is needed (tests/test_slurm.py runs it on a real one)."""
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAKE_SRUN = '#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$SRUN_ARGS"\n'


def training_flags(tmp_path: Path, script: str = "pretrain_gpt.sbatch", **env: str) -> list[str]:
    """The entry point's arguments as the script hands them to srun."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    workdir = tmp_path / "work"
    workdir.mkdir(exist_ok=True)
    job = {"SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "megalite-gpt",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "node0", "MASTER_ADDR": "node0",
           "MEGALITE_NPROC_PER_NODE": "2", "RUN_DIR": str(tmp_path / "run"), "SRUN_ARGS": str(tmp_path / "srun.args")}
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "MEGALITE_")) and k not in ("CKPT_DIR", "RUN_DIR")}
    run = subprocess.run(["bash", str(ROOT / "scripts" / "slurm" / script), "--tp", "2"], cwd=workdir,
                         env={**base, **job, **env, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    srun_args = (tmp_path / "srun.args").read_text().splitlines()
    entry = next(i for i, a in enumerate(srun_args) if a.endswith(("pretrain_gpt.py", "pretrain_bert.py")))
    return srun_args[entry + 1:]


def _value(flags: list[str], name: str) -> str:
    assert flags.count(name) == 1, f"{name} given {flags.count(name)} times in {flags}"
    return flags[flags.index(name) + 1]


@pytest.mark.parametrize("script", ["pretrain_gpt.sbatch", "pretrain_bert.sbatch"])
def test_jobs_checkpoint_by_default_under_their_working_directory(tmp_path, script):
    job_name = "megalite-" + script.removeprefix("pretrain_").removesuffix(".sbatch")
    flags = training_flags(tmp_path, script, SLURM_JOB_NAME=job_name)
    expected = tmp_path / "work" / "checkpoints" / f"{job_name}-77"
    assert _value(flags, "--save") == _value(flags, "--load") == str(expected)
    assert _value(flags, "--save-interval") == "1000"
    assert expected.is_dir()
    assert flags[-2:] == ["--tp", "2"], "the job's own flags come last, so they win"


def test_checkpoint_directory_and_interval_come_from_the_environment(tmp_path):
    flags = training_flags(tmp_path, MEGALITE_CKPT_DIR=str(tmp_path / "mine"), MEGALITE_SAVE_INTERVAL="50")
    assert _value(flags, "--save") == _value(flags, "--load") == str(tmp_path / "mine")
    assert _value(flags, "--save-interval") == "50"


def test_checkpoints_can_be_turned_off(tmp_path):
    flags = training_flags(tmp_path, MEGALITE_CHECKPOINTS="0")
    assert not {"--save", "--load", "--save-interval"} & set(flags)
