"""The fault soak's jobs (scripts/soak.py): the tiny GPT each track trains, its command line, a job
launched under torchrun and waited for, which runs (sample-log lineages) a job started and which fault
made it start them, and whether the checkpoint it left can be resumed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megalite import checkpoint  # noqa: E402
from megalite.runtime import UsageError  # noqa: E402
from soak_accounting import runs_in_order  # noqa: E402

SAVE_INTERVAL, GLOBAL_BATCH, WORLD = 2, 8, 2
MODEL = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--vocab-size", "128", "--global-batch-size", str(GLOBAL_BATCH),
         "--micro-batch-size", "2", "--log-interval", "1", "--eval-interval", "0", "--save-interval",
         str(SAVE_INTERVAL), "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "5"]
LAYOUTS = {"dp2": [], "dp2-zero1": ["--zero-stage", "1"], "dp2-zero3": ["--zero-stage", "3"], "tp2": ["--tp", "2"],
           "tp2-sp": ["--tp", "2", "--sequence-parallel"], "pp2": ["--pp", "2"], "cp2": ["--cp", "2"]}

KILLS = ("step", "save", "async-save", "gather", "p2p", "outer")  # megalite.faults points: SIGKILL
DAMAGE = ("corrupt", "truncate", "delete", "swap")
CURRENT: list[subprocess.Popen] = []  # the job running now, killed if the soak is


@dataclass
class Fault:
    kind: str
    detail: str = ""
    injected: bool = False
    survived: bool = False


@dataclass
class Track:
    name: str
    layout: str
    extra: list
    root: Path
    iters: int
    faults: list = field(default_factory=list)
    tmpfs: bool = False
    invocations: int = 0
    cause: dict = field(default_factory=dict)  # run -> the fault that made the job start it
    since_last_run: list = field(default_factory=list)  # faults since the last run began

    @property
    def save(self) -> Path:
        return self.root / "disk" / "ckpt"


def say(msg: str) -> None:
    print(msg, flush=True)


def command(track: Track, tag: str, restarts: int = 0, save_async: bool = False, load: Path | None = None,
            save: Path | None = None) -> list[str]:
    save = save or track.save
    metrics = track.root / ("reference-metrics.jsonl" if tag == "reference" else f"metrics-{tag}.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD),
           "--max-restarts", str(restarts), str(ROOT / "pretrain_gpt.py"), *MODEL, *LAYOUTS[track.layout],
           *track.extra, "--train-iters", str(track.iters), "--save", str(save), "--load", str(load or save),
           "--metrics-file", str(metrics)]
    if tag != "reference":
        cmd += ["--sample-log", str(track.root / "samples")]
    return cmd + (["--save-async"] if save_async else [])


def launch(track: Track, cmd: list[str], env_faults: str = "") -> tuple[subprocess.Popen, object]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MEGALITE_FAULTS": env_faults}
    env.pop("MEGALITE_QUIET", None)
    log = open(track.root / f"job-{track.invocations:04d}.log", "w")
    track.invocations += 1
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    CURRENT[:] = [proc]
    return proc, log


def finish(proc: subprocess.Popen, log, timeout: float = 600) -> tuple[int, str]:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    log.close()
    CURRENT.clear()
    return rc, Path(log.name).read_text()


def run_job(track: Track, cmd: list[str], ended_by: list[str], env_faults: str = "") -> tuple[int, str, list[str]]:
    """Run a job to its end; note each run it started with the fault that made the job start it."""
    before = len(runs_in_order(track.root / "samples"))
    rc, out = finish(*launch(track, cmd, env_faults))
    return rc, out, adopt_runs(track, before, ended_by)


def adopt_runs(track: Track, before: int, ended_by: list[str]) -> list[str]:
    """The runs a job started (those past the first `before`): the first was started by the faults
    since the previous run (the costliest named: a damage sends the job back further than the kill
    before it, a kill further than a layout change, which costs what a clean exit does), each later
    one by the fault that ended the run before it."""
    new = runs_in_order(track.root / "samples")[before:]
    for i, run in enumerate(new):
        if i == 0:
            since = track.since_last_run or ["start"]
            rank = [k for group in (DAMAGE, (*KILLS, "anytime", "disk"), ("layout",)) for k in since if k in group]
            track.cause[run] = (rank or since)[0]
        else:
            track.cause[run] = ended_by[i - 1]
    if new:
        track.since_last_run = [ended_by[len(new) - 1]] if len(ended_by) >= len(new) else []
    return new


def latest_iteration(track: Track) -> int | None:
    latest = track.save / "latest"
    return int(latest.read_text().strip().split("_")[-1]) if latest.exists() else None


def resumable(track: Track) -> bool:
    """The job can start again: `latest` names a complete checkpoint, or there is none yet."""
    if latest_iteration(track) is None:
        return True
    try:
        checkpoint.CheckpointReader(track.save)
        return True
    except UsageError:
        return False


def resumed_line(out: str) -> bool:
    return "megalite: resumed from" in out
