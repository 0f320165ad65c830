"""Megatron-LM's uneven pipeline split (--decoder-first-pipeline-num-layers,
--decoder-last-pipeline-num-layers): the counts they give each (virtual) stage, their one-line
refusals, and training on them as on one rank."""
from __future__ import annotations

import pytest
import torch

from helpers import rel_err
from megalite.pipeline.partition import uneven_stage_counts
from megalite.testing import run_ranks
from training_ranks import parse

FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"


def test_the_ends_take_their_counts_and_the_other_stages_share_the_rest():
    assert uneven_stage_counts(61, 16, None, None, 1) == [4] * 15 + [1]  # DeepSeek-V3's depth
    assert uneven_stage_counts(10, 4, None, 1, 3) == [1, 3, 3, 3]
    assert uneven_stage_counts(12, 4, 2, 2, 2) == [1, 2, 2, 1] * 2  # chunk c of rank r: stage c * pp + r
    assert uneven_stage_counts(5, 2, None, 2, 3) == [2, 3]


@pytest.mark.parametrize("args,says", [
    ((10, 4, None, 2, None), "the 8 layers left of 10 do not split evenly over the 3 other pipeline stages"),
    ((5, 2, None, 2, 2), "the 1 layers left of 5 do not split evenly over the 0 other"),
    ((4, 1, None, 2, None), "they need --pp 2 or more"),
    ((12, 4, 2, 3, None), "the stages would hold 3,3,3,3 layers; each needs at least one and a multiple of --vpp 2"),
])
def test_a_split_that_does_not_fit_is_refused_naming_the_counts(args, says):
    with pytest.raises(ValueError, match=says):
        uneven_stage_counts(*args)


def refused(argv, capsys) -> str:
    """The one line the command line `argv` is refused with."""
    with pytest.raises(SystemExit):
        parse(argv)
    return capsys.readouterr().err


def test_the_flags_set_pipeline_layers_and_refuse_a_second_split_or_a_v_schedule(capsys):
    cfg = parse(["--num-layers", "6", "--pp", "2", FIRST, "2"])
    assert cfg.parallel.pipeline_layers == [2, 4] and "parallel.pipeline_layers" in cfg.derived
    assert "--pipeline-layers and --decoder-first/last-pipeline-num-layers both" in refused(
        ["--num-layers", "6", "--pp", "2", FIRST, "2", "--pipeline-layers", "3,3"], capsys)
    assert "places two chunks per rank in a V: give --pipeline-layers" in refused(
        ["--num-layers", "6", "--pp", "2", LAST, "2", "--pipeline-schedule", "zb-v"], capsys)


def losses(rank, world, argv):
    import pretrain_gpt
    from megalite.training import pretrain

    return [r["loss"] for r in pretrain(parse(argv), pretrain_gpt.task()).records]


def test_training_on_an_uneven_split_gives_one_ranks_losses():
    argv = ["--num-layers", "3", "--seq-length", "16", "--global-batch-size", "4", "--micro-batch-size", "1",
            "--log-interval", "1", "--eval-iters", "0", "--train-iters", "3"]
    [want] = run_ranks(losses, 1, args=(argv,))
    for got in run_ranks(losses, 2, args=(argv + ["--pp", "2", LAST, "2"],)):
        assert rel_err(torch.tensor(got), torch.tensor(want)) <= 1e-5, (got, want)


def test_with_load_the_checkpoints_depth_is_split(tmp_path, monkeypatch, capsys):
    """Parsed over the preset's 4 layers first; the checkpoint's 6 are split once its model is taken."""
    from test_resume_policy import saved_checkpoint
    from megalite.training.checkpoint_shape import adopt_checkpoint_shape

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ckpt = saved_checkpoint(tmp_path / "ck", ["--mock-data", "--num-layers", "6", "--seq-length", "16"])
    cfg = adopt_checkpoint_shape(parse(["--load", str(ckpt), "--pp", "2", LAST, "2"]))
    assert cfg.model.num_layers == 6 and cfg.parallel.pipeline_layers == [4, 2]
    deferred = parse(["--load", str(ckpt), "--pp", "2", LAST, "3"])  # 4 - 3 = 1 layer: fits the preset too
    assert deferred.parallel.pipeline_layers == [1, 3]
    assert adopt_checkpoint_shape(deferred).parallel.pipeline_layers == [3, 3]
    assert "the 0 layers left of 4" in refused(["--pp", "2", LAST, "4"], capsys)  # no checkpoint: refused at once
    unsplit = parse(["--load", str(ckpt), "--pp", "2", LAST, "4"])  # the preset's 4 cannot; the checkpoint's 6 can
    assert unsplit.parallel.pipeline_layers is None
    assert adopt_checkpoint_shape(unsplit).parallel.pipeline_layers == [2, 4]
    from megalite.errors import UsageError

    waiting = parse(["--load", str(tmp_path / "none"), "--pp", "2", LAST, "4"])  # no checkpoint there after all
    with pytest.raises(UsageError, match="the 0 layers left of 4"):
        adopt_checkpoint_shape(waiting)
