"""Weights & Biases (--wandb-project, --wandb-exp-name, --wandb-save-dir): an offline run's files hold the
scalars TensorBoard gets, at the same iterations, and the resolved configuration; one rank writes them
(rank 0, which the log window gives the last pipeline stage's loss); a missing package is one line.

The run is read back with the wandb package's own reader of its .wandb files (`wandb leet inspect`)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli import records
from megalite.errors import UsageError
from megalite.metrics import TrainingLogger
from megalite.metrics_wandb import INSTALL_LINE, WandbOptions

needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="pip install wandb (the test extra)")

OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}


def _inspect(run_dir: Path, *flags: str):
    """wandb's own view of an offline run: its records (--json), or its summary (--summary --json)."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", *flags, str(run_dir)],
                         capture_output=True, text=True, timeout=60, env={**os.environ, **OFFLINE})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout) if flags else [json.loads(line) for line in out.stdout.splitlines()]


def _runs(save_dir: Path) -> list[Path]:
    return sorted((save_dir / "wandb").glob("offline-run-*"))


def _history(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of the run's history rows (wandb's own keys, `_step` etc., left out)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for rec in _inspect(run_dir):
        if rec["type"] == "history":
            for k, v in rec["history"]["item"].items():
                if not k.startswith("_"):
                    out.setdefault(k, []).append((rec["history"]["item"]["_step"], v))
    return out


def _train(tmp_path: Path, world: int, *extra: str) -> list[dict]:
    from megalite.testing import run_ranks
    from training_ranks import gpt_run

    argv = ["--mock-data", "--train-iters", "4", "--log-interval", "1", "--seq-length", "16", "--eval-interval", "2",
            "--eval-iters", "1", "--metrics-file", str(tmp_path / "m.jsonl"), "--wandb-project", "p",
            "--wandb-exp-name", "e", "--wandb-save-dir", str(tmp_path / "w"), *extra]
    run_ranks(_records, world, args=(gpt_run, argv), env=OFFLINE, timeout=240)
    return records(tmp_path / "m.jsonl")


def _records(rank, world, gpt_run, argv):
    return gpt_run(argv).records


@needs_wandb
def test_an_offline_run_holds_tensorboards_scalars_and_the_configuration(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recs = _train(tmp_path, 1, "--tensorboard-dir", str(tmp_path / "tb"))
    (run_dir,) = _runs(tmp_path / "w")
    history = _history(run_dir)
    assert history["train/loss"] == [(r["iteration"], r["loss"]) for r in recs]  # the metrics file's, exactly
    assert [step for step, _ in history["valid/loss"]] == [2, 4]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert set(history) == set(acc.Tags()["scalars"])  # the same tags as TensorBoard...
    for tag in history:  # ...at the same steps, with the same values (TensorBoard keeps float32)
        tb = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in history[tag]] == [s for s, _ in tb], tag
        assert [v for _, v in history[tag]] == pytest.approx([v for _, v in tb], rel=1e-6), tag
    summary = _inspect(run_dir, "--summary")
    assert (summary["project"], summary["name"], summary["state"], summary["exit_code"]) == ("p", "e", "finished", 0)
    config = summary["config"]  # the run's .config.toml, as tables
    assert config["training"]["train_iters"] == 4 and config["model"]["seq_length"] == 16
    assert config["model"]["num_layers"] == 4 and config["model"]["hidden_size"] == 128  # gpt-tiny, resolved
    assert config["logging"]["wandb_project"] == "p"
    toml = (tmp_path / "m.jsonl.config.toml").read_text()
    assert "[model]" in toml and "seq_length = 16" in toml


@needs_wandb
@pytest.mark.slow
def test_with_two_pipeline_stages_rank_0_alone_logs_the_last_stages_loss(tmp_path):
    recs = _train(tmp_path, 2, "--pp", "2")
    runs = _runs(tmp_path / "w")
    assert len(runs) == 1, runs  # one rank wrote a run
    history = _history(runs[0])
    assert history["train/loss"] == [(r["iteration"], r["loss"]) for r in recs]
    assert all(v > 0 for _, v in history["comm_bytes/pp"])  # rank 0's own traffic: the first stage's sends


def test_without_the_package_the_run_stops_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` fails on, and find_spec reports absent
    with pytest.raises(UsageError) as e:
        TrainingLogger(False, None, None, 1, False, WandbOptions("p", None, None, None))  # every rank checks
    assert str(e.value) == INSTALL_LINE and "pip install wandb" in INSTALL_LINE


RECORD = {"iteration": 1, "train_iters": 1, "consumed_samples": 4, "loss": 2.5, "lr": 1e-3, "grad_norm": 1.0,
          "loss_scale": 1.0, "skipped": 0, "ms_per_iter": 1.0, "tokens_per_sec": 1.0, "tflops_per_gpu": 1.0}


@needs_wandb
def test_a_run_stopped_on_an_error_is_marked_failed(tmp_path, monkeypatch):
    import wandb

    from megalite import metrics_wandb

    for k, v in {**OFFLINE, "MEGALITE_QUIET": "1"}.items():
        monkeypatch.setenv(k, v)
    wandb.teardown()  # settings are read when wandb's service starts: this test's environment
    try:
        stopped = TrainingLogger(True, None, None, 1, False, WandbOptions("p", "stopped", None, str(tmp_path / "a")))
        stopped.configuration("", None, {"training": {"train_iters": 1}})
        stopped.train(RECORD)
        stopped.close(exit_code=3)  # what Progress does when TrainingStopped ends the run
        stopped.close()  # a second close does nothing
        crashed = TrainingLogger(True, None, None, 1, False, WandbOptions("p", "crashed", None, str(tmp_path / "b")))
        crashed.train(RECORD)  # ...and training raises: never closed
        metrics_wandb._finish_left_open()  # what the process's exit (or the next run) does
    finally:
        wandb.teardown()  # the service process these runs started in pytest's own
    summaries = [_inspect(run, "--summary") for run in _runs(tmp_path / "a") + _runs(tmp_path / "b")]
    assert [(s["name"], s["state"], s["exit_code"]) for s in summaries] == [("stopped", "failed", 3),
                                                                           ("crashed", "failed", 1)]
    assert summaries[0]["summary"]["train/loss"] == 2.5 and summaries[0]["config"] == {"training": {"train_iters": 1}}


@needs_wandb
def test_a_run_wandb_cannot_start_is_one_line(tmp_path, monkeypatch):
    import wandb

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for k, v in {"WANDB_MODE": "online", "HOME": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path),
                 "NETRC": str(tmp_path / "netrc"), "MEGALITE_QUIET": "1"}.items():
        monkeypatch.setenv(k, v)
    wandb.teardown()
    try:
        with pytest.raises(UsageError) as e:
            TrainingLogger(True, None, None, 1, False, WandbOptions("p", None, None, str(tmp_path)))
    finally:
        wandb.teardown()
    assert "\n" not in str(e.value) and str(e.value).startswith("--wandb-project p: W&B could not start the run (")
    assert "WANDB_MODE=offline" in str(e.value)


def test_the_flags_are_megatron_lms_and_the_files_go_under_save_by_default():
    from megalite.config import build_parser

    cfg, _ = build_parser("t", "gpt-tiny").parse(["--wandb-project", "p", "--wandb-exp-name", "e", "--save", "ck",
                                                   "--wandb-entity", "team"])
    assert not any(f.startswith("--wandb") for f in cfg.ignored_flags)
    assert WandbOptions.of(cfg.logging, cfg.checkpoint.save) == WandbOptions("p", "e", "team", os.path.join("ck", "wandb"))
    cfg, _ = build_parser("t", "gpt-tiny").parse(["--wandb-project", "", "--wandb-exp-name", "e"])
    assert WandbOptions.of(cfg.logging, None) is None  # an empty project is none (Megatron-LM's scripts pass one)
