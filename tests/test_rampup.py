"""Megatron-LM's batch ramp-up (--rampup-batch-size START INCREMENT SAMPLES): the global batch grows
as Megatron-LM grows it, every layout trains to the same losses, and a run resumed mid-ramp
continues the unbroken one."""
import pytest
import torch

from helpers import rel_err
from megalite.config import build_parser, model_config, validate
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
