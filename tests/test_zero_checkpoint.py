"""Checkpoints are free of the ZeRO stage as of the layout: saved at stage 3 they resume at stages 0
and 2 on other data-parallel sizes (and the reverse) with the optimizer's state, and hold the same
tensors as a stage-0 save of the same training."""
from __future__ import annotations

import pytest
import torch

from helpers import rel_err
from megalite.checkpoint import CheckpointReader
from megalite.testing import run_ranks
from training_ranks import train_losses

ITERS, SAVED_AT = 6, 3
BASE = ["--train-iters", str(ITERS), "--log-interval", "1", "--lr-warmup-iters", "2", "--seq-length", "32",
        "--num-layers", "2", "--hidden-size", "64", "--global-batch-size", "8", "--micro-batch-size", "2"]
# One micro-batch per step on dp 2 and no clipping: every stage sums the same two gradients in the
# same order, so stages agree to the bit (tests/test_zero.py), in bf16 too.
ONE_MICRO_BATCH = [*BASE[:-4], "--global-batch-size", "4", "--micro-batch-size", "2", "--clip-grad", "0"]


def stage(n: int) -> list[str]:
    return ["--zero-stage", str(n)]


def save_then_resume(directory, saved: tuple[int, list[str]], resumed: tuple[int, list[str]]) -> list[float]:
    """Train to SAVED_AT at the `saved` (ranks, flags), resume at `resumed`: the resumed losses."""
    (world, flags), (world2, flags2) = saved, resumed
    run_ranks(train_losses, world, args=(BASE + flags + ["--save", str(directory), "--exit-interval",
                                                          str(SAVED_AT)],), timeout=300)
    assert (directory / "latest").read_text().strip() == f"iter_{SAVED_AT:07d}"
    losses = run_ranks(train_losses, world2, args=(BASE + flags2 + ["--load", str(directory)],), timeout=300)[0]
    assert len(losses) == ITERS - SAVED_AT
    return losses


def unbroken(world: int, flags: list[str]) -> list[float]:
    return run_ranks(train_losses, world, args=(BASE + flags,), timeout=300)[0]


def assert_continues(resumed: list[float], whole: list[float], what) -> None:
    err = rel_err(torch.tensor(resumed), torch.tensor(whole[SAVED_AT:]))
    assert err <= 1e-5, (what, resumed, whole[SAVED_AT:])


# saved (ranks, flags) -> resumed (ranks, flags): the stage 3 on dp 4 to stage 0 on dp 1 and
# stage 2 on dp 2; stage 3 under pipeline parallelism (the tied embedding a unit of its own) to
# stage 3 under tensor parallelism; and the way back from stages 0 and 1.
MOVES = {
    "stage3-dp4-to-stage0-dp1": ((4, stage(3)), (1, stage(0))),
    "stage3-dp4-to-stage2-dp2": ((4, stage(3)), (2, stage(2))),
    "stage3-pp2-dp2-to-stage3-tp2-dp2": ((4, stage(3) + ["--pp", "2"]), (4, stage(3) + ["--tp", "2"])),
    "stage0-dp1-to-stage3-pp2-dp2": ((1, stage(0)), (4, stage(3) + ["--pp", "2"])),
    "stage1-dp2-to-stage3-dp2": ((2, stage(1)), (2, stage(3))),
}


@pytest.mark.parametrize("move", list(MOVES))
def test_a_checkpoint_resumes_at_another_stage_and_layout_like_the_unbroken_run(tmp_path, move):
    saved, resumed = MOVES[move]
    losses = save_then_resume(tmp_path, saved, resumed)
    assert_continues(losses, unbroken(*resumed), move)


def test_a_background_stage_3_save_resumes_like_the_unbroken_run(tmp_path):
    losses = save_then_resume(tmp_path, (2, stage(3) + ["--save-async"]), (1, stage(0)))
    assert_continues(losses, unbroken(1, stage(0)), "async")


def assert_same_tensors(a: CheckpointReader, b: CheckpointReader) -> None:
    """Every model tensor and every optimizer state (master, both moments) equal bit for bit."""
    assert a.model_names() == b.model_names()
    for name in a.model_names():
        assert torch.equal(a.full_tensor(name), b.full_tensor(name)), name
        state_a, state_b = a.full_optimizer_state(name), b.full_optimizer_state(name)
        assert state_a.keys() == state_b.keys() == {"master", "exp_avg", "exp_avg_sq"}, name
        for k in state_a:
            assert torch.equal(state_a[k], state_b[k]), (name, k)


@pytest.mark.parametrize("saved_stage,resumed_stage", [(3, 0), (0, 3)])
def test_bf16_resumes_with_the_fp32_masters_adam_moments_and_step_across_stages(tmp_path, saved_stage,
                                                                                resumed_stage):
    # Masters rebuilt from the bf16 weights would lose their low bits: compare the final state itself.
    bf16 = ONE_MICRO_BATCH + ["--bf16"]
    split, whole = tmp_path / "split", tmp_path / "whole"
    run_ranks(train_losses, 2, args=(bf16 + stage(saved_stage) + ["--save", str(split), "--exit-interval",
                                                                  str(SAVED_AT)],), timeout=300)
    resumed = run_ranks(train_losses, 2, args=(bf16 + stage(resumed_stage) + ["--load", str(split), "--save",
                                                                              str(split)],), timeout=300)[0]
    unbroken_losses = run_ranks(train_losses, 2, args=(bf16 + stage(resumed_stage) + ["--save", str(whole)],),
                                timeout=300)[0]
    assert_continues(resumed, unbroken_losses, (saved_stage, resumed_stage))
    after_resume, after_unbroken = CheckpointReader(split), CheckpointReader(whole)
    assert after_resume.metadata["iteration"] == after_unbroken.metadata["iteration"] == ITERS
    assert_same_tensors(after_resume, after_unbroken)
    for reader in (after_resume, after_unbroken):
        assert [f.meta["step"] for f in reader.files] == [ITERS] * 2


def test_stage_3_and_stage_0_save_the_same_tensors_bit_for_bit(tmp_path):
    for n in (0, 3):
        run_ranks(train_losses, 2, args=(ONE_MICRO_BATCH + ["--bf16"] + stage(n) + [
            "--save", str(tmp_path / str(n)), "--exit-interval", str(SAVED_AT)],), timeout=300)
    plain, sharded = CheckpointReader(tmp_path / "0"), CheckpointReader(tmp_path / "3")
    assert_same_tensors(sharded, plain)
    assert (plain.metadata["layout"]["zero_stage"], sharded.metadata["layout"]["zero_stage"]) == (0, 3)
    assert [f.meta["step"] for f in sharded.files] == [SAVED_AT] * 2
