"""`--pipeline-extra-warmup 1`: one more forward before the first backward on every stage but the
last. The same numbers as without it (bitwise: each stage's passes run the same micro-batches and
gradients sum in the same order, only a forward earlier), one more micro-batch in flight, exchanges
that NCCL's matching cannot deadlock, and the steady state's boundary transfers off the schedule's
path (the planner's play, which docs/slow-links.md measures across the emulated link)."""
import pytest
import torch

from megalite.arguments import model_config, validate
from megalite.pipeline.programs import build_program, peak_in_flight
from megalite.pipeline.replay import check_schedule
from megalite.testing import run_ranks
from megalite.tools.plan.pipeline_play import exposed_transfers
from training_ranks import gpt_run, parse, several, whole_params

SMALL = ["--train-iters", "2", "--global-batch-size", "8", "--micro-batch-size", "1", "--log-interval", "1",
         "--seq-length", "32", "--lr-warmup-iters", "0"]


def test_every_stage_but_the_last_holds_one_more_micro_batch():
    for kind in ("1f1b", "zb-h1"):
        for p in (2, 3, 4):
            for m in (1, 2, 4, 8):
                for r in range(p):
                    before = peak_in_flight(build_program(p, r, m, None, kind))
                    after = peak_in_flight(build_program(p, r, m, None, kind, extra_warmup=1))
                    assert after == (min(before + 1, m) if r < p - 1 else before), (kind, p, m, r)
                    # the same passes, only in another order
                    same = sorted(map(repr, build_program(p, r, m, None, kind)))
                    assert sorted(map(repr, build_program(p, r, m, None, kind, extra_warmup=1))) == same
    assert [op.kind for op in build_program(2, 0, 4, extra_warmup=1) if op.kind != "X"] == list("FFFBFBBB")


def test_its_exchanges_match_under_ncclS_ordering_at_every_size():
    for kind in ("1f1b", "zb-h1"):
        for p in (2, 3, 4, 8):
            for m in (1, 2, 3, 4, 8, 16):
                assert check_schedule(p, m, None, kind, extra_warmup=1) == 2 * (p - 1) * m


def test_it_takes_the_steady_states_transfers_off_the_path():
    # equal stages (forward 1, backward 2), transfers of 0.5: 1F1B at pp 2 waits a round trip for every two
    # micro-batches and the last activation, whose receive is posted where it is read; one forward
    # ahead leaves only the fill's activation and the drain's gradient
    assert exposed_transfers(2, 8, None, "1f1b", 1.0, 2.0, 0.0, 0.5) == pytest.approx(4.5)
    assert exposed_transfers(2, 8, None, "1f1b", 1.0, 2.0, 0.0, 0.5, extra_warmup=1) == pytest.approx(1.0)
    assert exposed_transfers(2, 8, None, "zb-h1", 1.0, 1.0, 1.0, 1.5, extra_warmup=1) < \
        exposed_transfers(2, 8, None, "zb-h1", 1.0, 1.0, 1.0, 1.5)


@pytest.mark.parametrize("argv,why", [
    (["--pipeline-extra-warmup", "1"], "it needs --pp 2 or more"),
    (["--pp", "2", "--vpp", "2", "--pipeline-extra-warmup", "1"], "with one model chunk a rank"),
    (["--pp", "2", "--pipeline-schedule", "zb-v", "--pipeline-extra-warmup", "1"], "--pipeline-schedule 1f1b and zb-h1"),
    (["--pp", "2", "--overlap-moe-expert-parallel-comm", "--pipeline-extra-warmup", "1"],
     "without --overlap-moe-expert-parallel-comm"),
])
def test_where_it_is_not_built_it_is_refused_in_one_line(argv, why):
    from megalite.runtime import UsageError

    with pytest.raises(UsageError) as err:
        args = parse(argv)
        validate(args, 2, model_config(args))
    assert why in str(err.value) and "\n" not in str(err.value)


def test_a_count_above_one_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse(["--pp", "2", "--pipeline-extra-warmup", "2"])
    assert "invalid choice: 2 (choose from 0, 1)" in capsys.readouterr().err


def _train(rank, world, argv):
    """Losses, parameters and the peak in flight of the program the step ran (read off the program
    `TrainStep.for_run` built: the flag must reach it)."""
    from megalite.training import step

    built, peaks = step.build_program, []

    def recording(*args, **kw):
        program = built(*args, **kw)
        peaks.append(peak_in_flight(program))
        return program
    step.build_program = recording
    try:
        run = gpt_run(argv)
    finally:
        step.build_program = built
    return [r["loss"] for r in run.records], whole_params(run), peaks


CASES = [  # (name, argv) at world 4; each trained with and without --pipeline-extra-warmup 1
    ("1f1b pp 4", ["--pp", "4"]),
    ("zb-h1 pp 2 dp 2", ["--pp", "2", "--pipeline-schedule", "zb-h1"]),
    ("1f1b pp 2 dp 2 untied, zero 1", ["--pp", "2", "--untie-embeddings-and-output-weights", "--zero-stage", "1"]),
]


@pytest.fixture(scope="module")
def trained():
    argvs = [SMALL + argv + extra for _, argv in CASES for extra in ([], ["--pipeline-extra-warmup", "1"])]
    return run_ranks(several, 4, args=(_train, argvs), timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=[name for name, _ in CASES])
def test_it_trains_bitwise_like_the_schedule_without_it(trained, index):
    for rank, runs in enumerate(trained):
        (losses, params, peaks), (losses_ahead, params_ahead, peaks_ahead) = runs[2 * index], runs[2 * index + 1]
        pp = 4 if index == 0 else 2
        stage = rank if pp == 4 else rank // 2  # ranks are ordered tensor, data, pipeline
        held = pp if index == 1 else pp - stage  # zb-h1: p on every stage (forwarded, not yet through W)
        assert peaks == [held] and peaks_ahead == [held + (stage < pp - 1)], (rank, peaks, peaks_ahead)
        assert losses_ahead == losses, (rank, losses_ahead, losses)
        assert params_ahead.keys() == params.keys()
        for name, p in params.items():
            assert torch.equal(params_ahead[name], p), (rank, name)


def test_the_planner_counts_the_extra_micro_batch_and_carries_the_flag_where_the_schedule_has_it():
    from megalite.tools import plan as P
    from megalite.training.plan_check import check_run

    argv = ["--pp", "2", "--micro-batch-size", "1", "--global-batch-size", "8", "--seq-length", "64"]
    cluster = P.Cluster(gpus=2, gpus_per_node=1, inter_node_gbps=0.05, peak_tflops=0.1, efficiency=1)
    _, plain = check_run(parse(argv), 2, gpu_memory_bytes=80 * P.GIB, cluster=cluster)
    _, ahead = check_run(parse([*argv, "--pipeline-extra-warmup", "1"]), 2, gpu_memory_bytes=80 * P.GIB, cluster=cluster)
    assert ahead.run.pipeline_extra_warmup == 1 and plain.run.pipeline_extra_warmup == 0
    assert [ahead.stages[r].chunks_in_flight for r in (0, 1)] == [3, 1]
    assert [plain.stages[r].chunks_in_flight for r in (0, 1)] == [2, 1]
    assert ahead.exposed["pp"].exposed < plain.exposed["pp"].exposed
    assert "--pipeline-extra-warmup 1" in ahead.command() and "--pipeline-extra-warmup" not in plain.command()
    # a search applies it only where the layout's schedule has it: an interleaved layout plays without it
    run = P.Run(8, 64, "fp32", pipeline_extra_warmup=1)
    interleaved = P.predict(ahead.config, P.Layout(pp=2, vpp=2, micro_batch_size=1), cluster, run=run)
    assert interleaved.stages[0].chunks_in_flight == P.predict(
        ahead.config, P.Layout(pp=2, vpp=2, micro_batch_size=1), cluster,
        run=P.Run(8, 64, "fp32")).stages[0].chunks_in_flight
    assert "--pipeline-extra-warmup" not in interleaved.command()
