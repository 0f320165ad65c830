"""The warm-up is megalite's documented choice: iteration k (1-based) of W trains at lr * k / W,
one step ahead of Megatron-LM's lr * (k - 1) / W, so no step is spent at lr 0."""
import pytest

from megalite.optim.lr import LRSchedule


def test_first_warmup_step_trains_at_lr_over_warmup_not_zero():
    schedule = LRSchedule(6e-4, 6e-5, warmup_iters=2000, decay_iters=10000)
    first_steps = [schedule(i) for i in range(3)]
    assert first_steps == pytest.approx([6e-4 / 2000, 2 * 6e-4 / 2000, 3 * 6e-4 / 2000], rel=1e-12)
    assert min(schedule(i) for i in range(2000)) > 0


def test_warmup_reaches_lr_on_its_last_step_and_decay_starts_from_lr():
    schedule = LRSchedule(1.0, 0.1, warmup_iters=4, decay_iters=8, style="linear")
    assert [schedule(i) for i in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 0.775])
