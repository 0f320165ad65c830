"""Megatron-LM's batch ramp-up (--rampup-batch-size START INCREMENT SAMPLES): the global batch grows
as Megatron-LM grows it, every layout trains to the same losses, and a run resumed mid-ramp
continues the unbroken one."""
import pytest
import torch

from helpers import rel_err
from megalite.config import build_parser, model_config, validate
from megalite.config.batch_schedule import batch_schedule
from megalite.config.sections import global_batch_at, steps_for_samples
from megalite.errors import UsageError
from megalite.testing import run_ranks
from training_ranks import gpt_run

# 4 -> 8 samples a step in one increment after 16 samples; micro-batches of 2 (1 or 2 a step on dp 2)
RAMP = ["--rampup-batch-size", "4", "4", "16", "--global-batch-size", "8", "--micro-batch-size", "2",
        "--seq-length", "32", "--log-interval", "1", "--eval-interval", "0"]


def test_the_batch_grows_as_megatron_grows_it():
    gpt3 = [16, 16, 5859375]  # examples/gpt3/train_gpt3_175b_distributed.sh: 95 increments of 61677.6 samples
    assert [global_batch_at(c, 1536, gpt3) for c in (0, 61677, 61678, 123356, 5859375, 5859376)] == [
        16, 16, 32, 48, 1536, 1536]
    assert global_batch_at(10 ** 9, 1536, None) == 1536
    # --train-samples counts the ramp's steps one by one: 4 + 4 + 4 + 4 + 8 (16 samples seen: int(16 / 16) = 1
    # increment) + 8 = 32 samples in 6 steps
    assert steps_for_samples(32, 8, [4, 4, 16]) == 6 and steps_for_samples(32, 8, None) == 4


@pytest.mark.parametrize("argv, world, message", [
    (["--rampup-batch-size", "4", "3", "16", "--global-batch-size", "8"], 1, "is not a multiple of INCREMENT 3"),
    (["--rampup-batch-size", "2", "2", "16", "--global-batch-size", "8", "--micro-batch-size", "2"], 2,
     "every batch of the ramp must be a multiple of --micro-batch-size 2 x data-parallel size 2 = 4"),
    (["--rampup-batch-size", "32", "4", "16", "--global-batch-size", "8"], 1, "START at most --global-batch-size 8"),
])
def test_a_ramp_the_layout_cannot_run_is_refused_naming_it(argv, world, message):
    cfg = build_parser("x", "gpt-tiny").parse_args(["--mock-data", *argv])
    with pytest.raises(UsageError, match=message):
        validate(cfg, world, model_config(cfg))


def _records(rank, world, argv):
    return [(r["consumed_samples"], r["loss"], r["lr"]) for r in gpt_run(argv).records]


def _split(records):
    consumed, losses, lrs = zip(*records)
    return list(consumed), torch.tensor(losses), list(lrs)


@pytest.fixture(scope="module")
def unbroken():
    return _split(run_ranks(_records, 1, args=(RAMP + ["--train-iters", "6"],))[0])


def test_the_ramp_trains_the_same_at_every_layout(unbroken):
    consumed, losses, lrs = unbroken
    assert consumed == [4, 8, 12, 16, 24, 32]  # 4 a step until 16 samples are seen, then 8 (int(16 / 16) = 1)
    assert lrs[4] == pytest.approx(1e-3 * (16 / 8 + 1) / 10)  # the schedule at samples seen / final batch
    for world, layout in ((2, []), (4, ["--tp", "2"]), (2, ["--pp", "2"])):
        got = _split(run_ranks(_records, world, args=(RAMP + ["--train-iters", "6", *layout],))[0])
        assert got[0] == consumed and got[2] == lrs
        assert rel_err(got[1], losses) <= 1e-5, (layout, got[1], losses)


def test_a_run_resumed_mid_ramp_continues_the_unbroken_one(unbroken, tmp_path):
    argv = RAMP + ["--train-iters", "6", "--save", str(tmp_path)]
    run_ranks(_records, 2, args=(argv + ["--exit-interval", "3"],))
    consumed, losses, _ = _split(run_ranks(_records, 2, args=(argv + ["--load", str(tmp_path)],))[0])
    assert consumed == unbroken[0][3:]
    assert rel_err(losses, unbroken[1][3:]) <= 1e-5


# --step-batch-size-schedule: thresholds in tokens (/ --seq-length 32 = samples): 0 -> 4 a step, 512 tokens = 16
# samples -> 8 a step. The same batches as RAMP's ramp, so the same run.
STEPS = ["--step-batch-size-schedule", "0:4 512:8", "--micro-batch-size", "2", "--seq-length", "32",
         "--log-interval", "1", "--eval-interval", "0"]


def test_the_step_schedule_gives_megatrons_batches():
    from megalite.config.batch_schedule import parse_step_schedule

    # thresholds: 0, 128 // 32 = 4, 1000 // 32 = 31 samples; commas, suffixes and any order, as Megatron-LM reads them
    cfg = build_parser("x", "gpt-tiny").parse_args(["--mock-data", "--seq-length", "32", "--train-samples", "100",
                                                     "--step-batch-size-schedule", "1K:16, 0:4 128:8"])
    assert parse_step_schedule("1K:16, 0:4 128:8", 32) == ((0, 4), (4, 8), (31, 16))
    assert cfg.training.global_batch_size == 16  # the last batch: what the learning rate counts in
    eight = build_parser("x", "gpt-tiny").parse_args(["--mock-data", *STEPS])
    assert eight.training.global_batch_size == 8 and "training.global_batch_size" in eight.derived
    schedule = batch_schedule(cfg.training, 32)
    consumed, batches = 0, []
    for _ in range(8):
        batches.append(schedule.at(consumed))
        consumed += batches[-1]
    # the batch of the last threshold the samples consumed before the step reached
    assert batches == [4, 8, 8, 8, 8, 16, 16, 16]
    assert [schedule.at(c) for c in (0, 3, 4, 30, 31, 10 ** 9)] == [4, 4, 8, 8, 16, 16]
    # --train-samples 100: steps one by one until past the last threshold (0, 4, 12, 20, 28 -> 36 samples), then
    # whole final batches: (100 - 36) // 16 = 4
    assert cfg.training.train_iters == 5 + 4
    assert parse_step_schedule("0:1.5K 2.5M:3B", 1000) == ((0, 1500), (2500, 3 * 10 ** 9))


@pytest.mark.parametrize("argv, message", [
    (["--step-batch-size-schedule", "64:4 512:8"], "the first threshold must be 0, got 2 samples"),
    (["--step-batch-size-schedule", "0:4 16:8"], "thresholds must rise strictly"),
    (["--step-batch-size-schedule", "0:4 x:8"], "'x' is not a number"),
    (["--step-batch-size-schedule", "0:4 512"], "entry '512' is not THRESHOLD:BATCH"),
    (["--step-batch-size-schedule", "0:4", "--rampup-batch-size", "4", "4", "16"], "keep one"),
    (["--step-batch-size-schedule", "0:4 512:8", "--global-batch-size", "16"], "drop --global-batch-size"),
])
def test_a_step_schedule_megatron_would_refuse_is_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        build_parser("x", "gpt-tiny").parse(["--mock-data", "--seq-length", "32", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_step_schedule_the_layout_cannot_run_is_refused_naming_the_batch():
    from megalite.config.batch_schedule import check_schedule_layout

    schedule = batch_schedule(build_parser("x", "gpt-tiny").parse_args(
        ["--mock-data", "--seq-length", "32", "--step-batch-size-schedule", "0:2 512:8"]).training, 32)
    check_schedule_layout(schedule, 16, 2, 2)  # past the 2: only batches of 8 are ahead
    with pytest.raises(ValueError, match="a global batch of 2 is not a multiple of --micro-batch-size 2 x "
                                         "data-parallel size 2 = 4"):
        check_schedule_layout(schedule, 0, 2, 2)


def test_the_step_schedule_trains_as_the_same_ramp(unbroken):
    consumed, losses, lrs = _split(run_ranks(_records, 2, args=(STEPS + ["--train-iters", "6"],))[0])
    assert consumed == unbroken[0] == [4, 8, 12, 16, 24, 32]
    assert lrs == unbroken[2]  # the learning rate at samples seen / the last batch (8)
    assert rel_err(losses, unbroken[1]) <= 1e-5


def test_a_run_resumed_mid_step_schedule_continues_the_unbroken_one(unbroken, tmp_path):
    argv = STEPS + ["--train-iters", "6", "--save", str(tmp_path)]
    run_ranks(_records, 2, args=(argv + ["--exit-interval", "3"],))
    consumed, losses, _ = _split(run_ranks(_records, 2, args=(argv + ["--load", str(tmp_path)],))[0])
    assert consumed == unbroken[0][3:]
    assert rel_err(losses, unbroken[1][3:]) <= 1e-5
