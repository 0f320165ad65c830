"""The planner models the pipeline schedule: ZB-H1's bubble is the formula's (a third of 1F1B's idle
time at equal pass costs), its activations are p micro-batches on every stage (1F1B's first stage);
ZB-V's bubble is a sixth of 1F1B's, at p micro-batches too, with rank 0 holding the first and last
stages; the search tries every schedule and prints the flag that runs its choice."""
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


def test_zb_v_bubble_is_a_sixth_of_1f1bs_and_rank_0_holds_both_ends():
    one_f_one_b, zb_h1, zb_v = _predict("1f1b"), _predict("zb-h1"), _predict("zb-v")
    m = zb_v.micro_batches
    assert zb_v.layout.vpp == 2  # set by the schedule
    assert zb_v.bubble_fraction == pytest.approx(bubble_fraction("zb-v", 4, m, 1, 1, 1))
    assert zb_v.time.bubble < zb_h1.time.bubble < one_f_one_b.time.bubble
    assert zb_v.time.bubble == pytest.approx(one_f_one_b.time.bubble / 6, rel=0.05)
    for r in (0, 3):
        assert zb_v.stages[r].chunks_in_flight == 8  # 2p chunks of half a stage: p micro-batches
        assert zb_v.stages[r].activations == pytest.approx(one_f_one_b.stages[0].activations, rel=0.05)
    # Rank 0 holds the word embedding and the output layer (tied: a second copy), rank 3 neither.
    assert zb_v.stages[0].output > 0 and zb_v.stages[3].output == 0
    assert zb_v.stages[0].state.numel > one_f_one_b.stages[0].state.numel
    assert zb_v.stages[3].state.numel < one_f_one_b.stages[3].state.numel
    held = [P.inputs.rank_layer_numbers(CONFIG, 4, 2, r, v_shape=True) for r in range(4)]
    assert sorted(n for chunks in held for chunk in chunks for n in chunk) == list(range(CONFIG.num_layers))
    assert held[0] == [range(0, 3), range(21, 24)] and held[3] == [range(9, 12), range(12, 15)]


def test_dualpipev_has_zb_h1s_bubble_with_2p_plus_1_chunks_and_needs_2p_micro_batches():
    zb_h1, dpv = _predict("zb-h1"), _predict("dualpipev")
    m = dpv.micro_batches
    assert dpv.bubble_fraction == pytest.approx(bubble_fraction("dualpipev", 4, m, 1, 1, 1))
    assert dpv.bubble_fraction == pytest.approx(zb_h1.bubble_fraction)  # (p-1)/(3m+p-1) at equal costs
    assert [dpv.stages[r].chunks_in_flight for r in (0, 3)] == [9, 9]  # 2p + 1 (the README's PP + 1)
    few = P.plan(CONFIG, CLUSTER, 4, 2048, pp=4, tp=1, micro_batch_size=1, recompute="none", zero_stage=1,
                 schedule="dualpipev")  # at most 4 micro-batches, under 2 x pp
    assert not few.predictions and "dualpipev: m < 2 pp" in few.rejected


def test_layouts_refuse_zb_h1_with_interleaving():
    with pytest.raises(ValueError, match="one model chunk per rank"):
        P.Layout(pp=4, vpp=2, schedule="zb-h1")
    with pytest.raises(ValueError, match="the planner models the schedules"):
        P.Layout(pp=4, schedule="zb-v1")
    with pytest.raises(ValueError, match="zb-v schedule places two chunks per rank in a V"):
        P.Layout(pp=4, vpp=3, schedule="zb-v")


def test_search_tries_both_schedules_and_only_asked_ones():
    every = P.plan(CONFIG, CLUSTER, 64, 2048, pp=4, tp=1, micro_batch_size=1, recompute="none", zero_stage=1)
    assert {x.layout.schedule for x in every.predictions} == {"1f1b", "zb-h1", "zb-v", "dualpipev"}
    assert all(x.layout.schedule in ("1f1b", "zb-v", "dualpipev") for x in every.predictions if x.layout.vpp)
    assert all(x.layout.vpp == 2 for x in every.predictions if x.layout.schedule in ("zb-v", "dualpipev"))
    assert every.best.layout.schedule == "zb-v"
    only = P.plan(CONFIG, CLUSTER, 64, 2048, pp=4, tp=1, micro_batch_size=1, recompute="none", zero_stage=1,
                  schedule="1f1b")
    assert {x.layout.schedule for x in only.predictions} == {"1f1b"}
    assert not P.plan(CONFIG, CLUSTER, 64, 2048, pp=1, schedule="zb-h1").predictions


def test_the_suggested_zb_v_command_sets_no_vpp_and_parses(capsys):
    from megalite.arguments import build_parser

    assert P.main(["--model", "gpt-1.3b", "--gpus", "16", "--global-batch-size", "64", "--pp", "4", "--tp", "1",
                   "--micro-batch-size", "1", "--pipeline-schedule", "zb-v", "--top", "1"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if "pretrain_gpt.py" in x][0]
    assert "--pipeline-schedule zb-v" in line and "--vpp" not in line
    argv = line.split("pretrain_gpt.py", 1)[1].split()
    args = build_parser("plan", default_model="gpt-1.3b").parse_args(argv)
    assert (args.parallel.pipeline_schedule, args.parallel.vpp, args.parallel.pp) == ("zb-v", 2, 4)


def test_cli_prints_the_schedule_column_and_the_flag(capsys):
    assert P.main(["--model", "gpt-1.3b", "--gpus", "16", "--global-batch-size", "64", "--pp", "4", "--tp", "1",
                   "--micro-batch-size", "1", "--pipeline-schedule", "zb-h1", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert " sched " in out and "--pipeline-schedule zb-h1" in out
