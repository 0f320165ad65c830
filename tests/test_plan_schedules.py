"""The planner models the pipeline schedule: ZB-H1's bubble is the formula's (a third of 1F1B's idle
time at equal pass costs), its activations are p micro-batches on every stage (1F1B's first stage),
and the search tries both schedules and prints the flag that runs its choice."""
import pytest

from megalite.models import preset
from megalite.pipeline.schedules import bubble_fraction
from megalite.tools import plan as P

CONFIG = preset("gpt-1.3b")
CLUSTER = P.Cluster(gpus=16)


def _predict(schedule, **layout):
    return P.predict(CONFIG, P.Layout(tp=1, pp=4, dp=4, micro_batch_size=1, zero_stage=1, schedule=schedule, **layout),
                     CLUSTER, 64, 2048)


def test_zb_h1_bubble_is_the_formulas_and_shorter_than_1f1b():
    one_f_one_b, zb = _predict("1f1b"), _predict("zb-h1")
    m = zb.micro_batches
    assert zb.bubble_fraction == pytest.approx(bubble_fraction("zb-h1", 4, m, 1, 1, 1))
    assert one_f_one_b.bubble_fraction == pytest.approx((4 - 1) / (m + 4 - 1))
    assert zb.time.bubble < one_f_one_b.time.bubble / 2.5  # about a third of the idle time
    assert zb.step_time < one_f_one_b.step_time


def test_zb_h1_holds_p_micro_batches_on_every_stage_and_1f1b_p_minus_r():
    one_f_one_b, zb = _predict("1f1b"), _predict("zb-h1")
    for r in (0, 3):
        assert one_f_one_b.stages[r].chunks_in_flight == 4 - r
        assert zb.stages[r].chunks_in_flight == 4
    assert zb.stages[0].activations == pytest.approx(one_f_one_b.stages[0].activations)
    assert zb.stages[3].activations == pytest.approx(4 * one_f_one_b.stages[3].activations, rel=0.05)


def test_layouts_refuse_zb_h1_with_interleaving():
    with pytest.raises(ValueError, match="one model chunk per rank"):
        P.Layout(pp=4, vpp=2, schedule="zb-h1")
    with pytest.raises(ValueError, match="schedule must be one of"):
        P.Layout(pp=4, schedule="zb-v1")


def test_search_tries_both_schedules_and_only_asked_ones():
    both = P.plan(CONFIG, CLUSTER, 64, 2048, pp=4, tp=1, micro_batch_size=1, recompute="none", zero_stage=1)
    assert {x.layout.schedule for x in both.predictions} == {"1f1b", "zb-h1"}
    assert all(x.layout.schedule == "1f1b" for x in both.predictions if x.layout.vpp)
    assert both.best.layout.schedule == "zb-h1"
    only = P.plan(CONFIG, CLUSTER, 64, 2048, pp=4, tp=1, micro_batch_size=1, recompute="none", zero_stage=1,
                  schedule="1f1b")
    assert {x.layout.schedule for x in only.predictions} == {"1f1b"}
    assert not P.plan(CONFIG, CLUSTER, 64, 2048, pp=1, schedule="zb-h1").predictions


def test_cli_prints_the_schedule_column_and_the_flag(capsys):
    assert P.main(["--model", "gpt-1.3b", "--gpus", "16", "--global-batch-size", "64", "--pp", "4", "--tp", "1",
                   "--micro-batch-size", "1", "--pipeline-schedule", "zb-h1", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert " sched " in out and "--pipeline-schedule zb-h1" in out
