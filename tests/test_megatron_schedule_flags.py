"""Megatron-LM's schedule flags: --lr-warmup-init (the warm-up rises from it) and a weight decay that
moves over the run (--weight-decay-incr-style linear / cosine from --start-weight-decay to
--end-weight-decay), by formula, in training (biases and norms never decay) and on resume."""
from __future__ import annotations

import math

import pytest

from megalite.optim.lr import LRSchedule, WeightDecaySchedule
from megalite.testing import run_ranks
from training_ranks import parse

RUN = ["--model", "gpt-tiny", "--seq-length", "16", "--global-batch-size", "4", "--micro-batch-size", "2",
       "--log-interval", "1", "--eval-iters", "0", "--train-iters", "3", "--lr-warmup-iters", "0"]


def test_the_warmup_rises_from_its_initial_value_and_the_decay_is_unchanged():
    plain = LRSchedule(1.0, 0.1, warmup_iters=4, decay_iters=8, style="linear")
    init = LRSchedule(1.0, 0.1, warmup_iters=4, decay_iters=8, style="linear", warmup_init=0.2)
    assert [init(i) for i in range(4)] == pytest.approx([0.2 + 0.8 * k / 4 for k in (1, 2, 3, 4)], rel=1e-12)
    assert [init(i) for i in range(4, 9)] == [plain(i) for i in range(4, 9)]
    assert LRSchedule(1.0, 0.1, warmup_iters=2.5, decay_iters=8, warmup_init=0.2)(2) == pytest.approx(1.0)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_the_weight_decay_moves_from_start_to_end_by_megatron_lms_formula(style):
    wd = WeightDecaySchedule(0.1, 0.3, style, steps=10)
    for i in (0, 2.5, 5, 10, 12):
        r = min(i / 10, 1.0)
        c = r if style == "linear" else 0.5 * (math.cos(math.pi * (1 - r)) + 1)  # Megatron-LM's spelling
        assert wd(i) == pytest.approx(0.1 + c * 0.2, rel=1e-12)
    assert wd(0) == 0.1 and wd(10) == pytest.approx(0.3)


@pytest.mark.parametrize("argv,says", [
    (["--start-weight-decay", "0.1"], "--start-weight-decay/--end-weight-decay go with --weight-decay-incr-style "
                                      "linear or cosine"),
    (["--weight-decay-incr-style", "cosine", "--start-weight-decay", "0"], "--weight-decay-incr-style cosine needs "
                                                                          "both --start-weight-decay and"),
])
def test_a_weight_decay_schedule_with_its_ends_missing_or_unused_is_refused_in_one_line(argv, says):
    from megalite import arguments
    from megalite.errors import UsageError

    with pytest.raises(UsageError, match=says):
        args = parse(argv)
        arguments.validate(args, 1, arguments.model_config(args))


def runs(rank, world, argvs, record_decay=False):
    """Each run's losses and learning rates; with `record_decay` the weight decay each step set, and
    the decay of every group at the end (name of its first parameter's dimension count, value)."""
    import pretrain_gpt
    from megalite.optim import MegaliteOptimizer
    from megalite.training import pretrain

    out = []
    for argv in argvs:
        set_to, original = [], MegaliteOptimizer.set_weight_decay

        def recorded(self, value):
            set_to.append(value)
            original(self, value)

        MegaliteOptimizer.set_weight_decay = recorded
        try:
            run = pretrain(parse(argv), pretrain_gpt.task())
        finally:
            MegaliteOptimizer.set_weight_decay = original
        groups = [(g["decays"], g["weight_decay"]) for g in run.optimizer.inner.param_groups]
        out.append(([r["loss"] for r in run.records], [r["lr"] for r in run.records], set_to, groups))
    return out


def test_in_training_the_schedules_set_each_steps_values_and_a_steady_one_is_the_constant_decay():
    linear = ["--weight-decay-incr-style", "linear", "--start-weight-decay"]
    argvs = [RUN + ["--weight-decay", "0.2"], RUN + linear + ["0.2", "--end-weight-decay", "0.2"],
             RUN + ["--weight-decay", "0"], RUN + linear + ["0", "--end-weight-decay", "0"],
             RUN + linear + ["0", "--end-weight-decay", "0.6"],
             RUN + ["--lr-warmup-iters", "4", "--lr-warmup-init", "1e-4", "--lr", "1e-3"]]
    [results] = run_ranks(runs, 1, args=(argvs,))
    (const, _, none, _), (steady, _, set_to, groups) = results[0], results[1]
    assert none == [] and steady == const and set_to == [0.2] * 3  # the same decay each step, bit for bit
    assert results[3][0] == results[2][0]  # set to 0 over the default 0.1 the groups started with
    losses, _, set_to, groups = results[4]
    assert set_to == pytest.approx([0.0, 0.2, 0.4]) and losses != results[2][0]
    assert [wd for decays, wd in groups if decays] == pytest.approx([0.4] * sum(d for d, _ in groups))
    assert all(wd == 0.0 for decays, wd in groups if not decays)  # biases and norms never decay
    assert any(not decays for decays, _ in groups)
    lrs = results[5][1]
    assert lrs == pytest.approx([1e-4 + 9e-4 * k / 4 for k in (1, 2, 3)], rel=1e-9)


def test_a_resumed_run_with_another_weight_decay_schedule_or_warmup_start_is_refused(tmp_path):
    from megalite.errors import UsageError
    from test_resume_policy import saved_checkpoint
    from megalite.training.checkpoint_shape import adopt_checkpoint_shape

    small = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "16", "--train-iters", "20", "--lr-warmup-iters", "2"]
    ckpt = saved_checkpoint(tmp_path / "ck", small + ["--weight-decay-incr-style", "linear", "--start-weight-decay",
                                                      "0", "--end-weight-decay", "0.1"])
    same = adopt_checkpoint_shape(parse(["--load", str(ckpt), *small]))
    assert (same.optimizer.weight_decay_incr_style, same.optimizer.end_weight_decay) == ("linear", 0.1)
    for argv, says in ((["--end-weight-decay", "0.2"], "end_weight_decay 0.2 (--end-weight-decay) vs the "
                                                       "checkpoint's 0.1"),
                       (["--weight-decay-incr-style", "cosine"], "weight_decay_incr_style cosine "
                                                                 "(--weight-decay-incr-style) vs the checkpoint's "
                                                                 "linear: add"),
                       (["--lr-warmup-init", "1e-5"], "lr_warmup_init 1e-05 (--lr-warmup-init) vs the checkpoint's 0"),
                       (["--train-iters", "40"], "weight-decay ramp 40 iterations (--train-iters) vs the checkpoint's "
                                                 "20")):
        with pytest.raises(UsageError, match="add --override-opt_param-scheduler") as e:
            adopt_checkpoint_shape(parse(["--load", str(ckpt), *small, *argv]))
        assert says in str(e.value), str(e.value)
