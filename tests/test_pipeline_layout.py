"""Megatron-LM's --pipeline-model-parallel-layout and --account-for-embedding/loss-in-pipeline-split: the
stages they give, their one-line refusals, and training on them (stages that hold no transformer layer
included) as on one rank."""
from __future__ import annotations

import re

import pytest
import torch

from helpers import rel_err
from megalite.pipeline.layer_layout import accounted_layer_counts, layout_layer_counts, layout_stages
from megalite.testing import run_ranks
from training_ranks import parse, refusal, several, train_losses

LAYOUT = "--pipeline-model-parallel-layout"
EMBEDDING, LOSS = "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"


def test_repetitions_unroll_and_commas_are_cosmetic():
    assert layout_stages("Ettt|(tt|)*3,m|L") == ["Ettt", "tt", "tt", "tt", "m", "L"]
    assert layout_stages("Et*3|t*2L") == ["Ettt", "ttL"]
    assert layout_stages("E|(t|)*2,tL") == ["E", "t", "t", "tL"]
    assert layout_stages("(|t)*2") == ["", "t", "t"]
    assert layout_stages("E((t|)*2)*2L") == ["Et", "t", "t", "t", "L"]  # nested groups too
    assert layout_stages("E t, t|tL") == ["Ett", "tL"]


def test_a_layout_gives_the_layers_of_each_virtual_stage_and_the_stages_per_rank():
    assert layout_layer_counts("Et|(tt|)*2,tmL", 4, 6, 1) == (1, [1, 2, 2, 1])
    assert layout_layer_counts("E|tt|t|tL", 2, 4, 0) == (2, [0, 2, 1, 1])
    assert layout_layer_counts("Etttt|L", 2, 4, 0) == (1, [4, 0])
    # DeepSeek-V3's 61 layers on 16 ranks x 2 chunks, the MTP layer and the loss alone on the last stage
    per_rank, counts = layout_layer_counts("Et|(tt|)*30,mL", 16, 61, 1)
    assert per_rank == 2 and counts == [1] + [2] * 30 + [0]


@pytest.mark.parametrize("layout,pp,says", [
    ("Et|tL|t", 2, "has 3 stages, not a multiple of --pp 2"),
    ("Ett|tL", 2, "places 3 transformer layers (t) but the model has 4"),
    ("Ett|ttmL", 2, "places 1 MTP layers (m) but the model has 0"),
    ("Ett|ttLL", 2, "must name the embedding (E) and the loss (L) once each"),
    ("tEt|ttL", 2, "the embedding (E) comes first, in the first stage"),
    ("|Ett|ttL|", 2, "the embedding (E) comes first, in the first stage"),
    ("Ett|Ltt", 2, "the loss (L) comes last, in the last stage"),
    ("Ett|tt*2x", 2, "'x' is not a layer letter"),
])
def test_a_layout_megalite_cannot_run_is_refused_in_one_line(layout, pp, says):
    with pytest.raises(ValueError, match=re.escape(says)) as e:
        layout_layer_counts(layout, pp, 4, 0)
    assert "\n" not in str(e.value)


def test_mtp_layers_go_with_the_loss():
    assert layout_layer_counts("Ett|tmL", 2, 3, 1) == (1, [2, 1])
    assert layout_layer_counts("Ett|tmmL", 2, 3, 2) == (1, [2, 1])
    for layout in ("Ett|t|m|L", "Ettm|tL", "Ett|mtL"):  # Megatron-LM's standalone MTP stage, MTP before a layer
        with pytest.raises(ValueError, match="put every m in the last stage, just before L"):
            layout_layer_counts(layout, 2, 3, 1)
    for layout in ("Ettm|tmL", "Emtt|tmL"):  # the count is right, but one m is elsewhere
        with pytest.raises(ValueError, match="put every m in the last stage, just before L"):
            layout_layer_counts(layout, 2, 3, 2)


def test_accounting_for_the_embedding_and_the_loss_by_hand():
    # 4 layers + embedding + loss = 6 over 2 ranks: 3 each, less the embedding on the first and the loss on the last
    assert accounted_layer_counts(4, 2, None, True, True) == [2, 2]
    assert accounted_layer_counts(4, 3, None, True, True) == [1, 2, 1]
    assert accounted_layer_counts(5, 3, None, True, False) == [1, 2, 2]
    assert accounted_layer_counts(5, 2, 3, False, True) == [1, 1, 1, 1, 1, 0]  # a last stage of the loss alone
    assert accounted_layer_counts(4, 2, 3, True, True) == [0, 1, 1, 1, 1, 0]
    assert accounted_layer_counts(62, 16, 2, True, True) == [1] + [2] * 30 + [1]
    with pytest.raises(ValueError, match="4 layers \\+ 1 do not split evenly over --pp 2"):
        accounted_layer_counts(4, 2, None, True, False)


def refused(argv, capsys) -> str:
    """The one line the command line `argv` is refused with."""
    with pytest.raises(SystemExit):
        parse(argv)
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_the_flags_set_pipeline_layers_and_vpp_and_refuse_what_disagrees(capsys):
    cfg = parse(["--pp", "2", LAYOUT, "E|tt|t|tL"])
    assert (cfg.parallel.vpp, cfg.parallel.pipeline_layers) == (2, [0, 2, 1, 1])
    assert "parallel.pipeline_layers" in cfg.derived and "parallel.vpp" in cfg.derived
    assert parse(["--pp", "2", "--vpp", "2", LAYOUT, "E|tt|t|tL"]).parallel.vpp == 2
    cfg = parse(["--pp", "2", "--num-layers-per-virtual-pipeline-stage", "1", EMBEDDING, LOSS])
    assert (cfg.parallel.vpp, cfg.parallel.pipeline_layers) == (3, [0, 1, 1, 1, 1, 0])
    assert parse(["--pp", "3", EMBEDDING, LOSS]).parallel.pipeline_layers == [1, 2, 1]
    assert parse(["--pp", "2", "--pipeline-schedule", "dualpipev", LAYOUT, "E|tt|tt|L"]).parallel.pipeline_layers == [
        0, 2, 2, 0]
    assert parse(["--pipeline-layers", "4,0", "--pp", "2"]).parallel.pipeline_layers == [4, 0]
    assert "--vpp 3 and --pipeline-model-parallel-layout (2 virtual stages per pipeline rank) disagree" in refused(
        ["--pp", "2", "--vpp", "3", LAYOUT, "E|tt|t|tL"], capsys)
    assert "names the virtual stages itself: drop --num-layers-per-virtual-pipeline-stage" in refused(
        ["--pp", "2", "--num-layers-per-virtual-pipeline-stage", "1", LAYOUT, "E|tt|t|tL"], capsys)
    assert "--pipeline-layers and --pipeline-model-parallel-layout both split" in refused(
        ["--pp", "2", LAYOUT, "Ett|ttL", "--pipeline-layers", "2,2"], capsys)
    assert "--pipeline-model-parallel-layout and --account-for-loss-in-pipeline-split both split" in refused(
        ["--pp", "2", LAYOUT, "Ett|ttL", LOSS], capsys)
    assert "--decoder-first/last-pipeline-num-layers and --account-for-embedding-in-pipeline-split both" in refused(
        ["--pp", "2", "--decoder-first-pipeline-num-layers", "1", EMBEDDING], capsys)
    # the stages per rank a layout names, checked as a --vpp would be, naming the layout
    assert "names 2 stages, which --pp 1 would run as chunks of one rank: give --pp 2" in refused(
        [LAYOUT, "Ett|ttL"], capsys)
    assert "names 2 stages per pipeline rank, but --pipeline-schedule zb-h1 runs one" in refused(
        ["--pp", "2", "--pipeline-schedule", "zb-h1", LAYOUT, "E|tt|tt|L"], capsys)
    assert "interleaved runs model chunks per rank, but --pipeline-model-parallel-layout names one stage" in refused(
        ["--pp", "2", "--pipeline-schedule", "interleaved", LAYOUT, "Ett|ttL"], capsys)
    # the accounting split is one count per virtual stage: in a V too (rank 0 holds the first and the last)
    v = parse(["--num-layers", "6", "--pp", "2", "--pipeline-schedule", "dualpipev", EMBEDDING, LOSS]).parallel
    assert (v.vpp, v.pipeline_layers) == (2, [1, 2, 2, 1])
    assert "runs two chunks per rank in a V: give 4 stages" in refused(
        ["--pp", "2", "--pipeline-schedule", "zb-v", LAYOUT, "Ett|ttL"], capsys)
    assert "places 1 MTP layers (m) but the model has 0" in refused(["--pp", "2", LAYOUT, "Ett|ttmL"], capsys)
    assert "does not divide the 5 layers (1 of them the embedding or the loss" in refused(
        ["--pp", "2", "--num-layers-per-virtual-pipeline-stage", "2", EMBEDDING], capsys)
    assert "a stage holds 0 or more" in refusal(["--pp", "2", "--pipeline-layers", "5,-1"], 2)


GPT = ["--seq-length", "16", "--global-batch-size", "4", "--micro-batch-size", "1", "--log-interval", "1",
       "--eval-iters", "0", "--train-iters", "3"]
MTP = ["--model", "deepseek-tiny", *GPT]
ON_TWO = [  # (argv, one rank's run it equals)
    (GPT + ["--pp", "2", LAYOUT, "E|tt|t|tL"], GPT),  # interleaved, the first chunk the embedding alone
    (GPT + ["--pp", "2", LAYOUT, "Etttt|L"], GPT),  # the last stage the output layer and loss alone
    (GPT + ["--pp", "2", "--pipeline-schedule", "dualpipev", LAYOUT, "E|tt|tt|L"], GPT),  # empty chunks in a V
    (GPT + ["--pp", "2", "--num-layers-per-virtual-pipeline-stage", "1", EMBEDDING, LOSS], GPT),
    (MTP + ["--pp", "2", LAYOUT, "Ettt|mL"], MTP),  # the MTP layer and the loss on a stage of no layer
]


@pytest.mark.slow
def test_training_on_a_layout_gives_one_ranks_losses(tmp_path):
    save = ["--save", str(tmp_path / "ck"), "--save-interval", "2", "--train-iters", "2"]
    wants = run_ranks(several, 1, args=(train_losses, [GPT, MTP]))[0]
    want = dict(zip(map(tuple, [GPT, MTP]), wants))
    runs = [argv for argv, _ in ON_TWO] + [GPT + ["--pp", "2", LAYOUT, "Etttt|L"] + save]
    got = run_ranks(several, 2, args=(train_losses, runs))[-1]  # the last stage logs the loss
    for (argv, one), losses in zip(ON_TWO, got):
        assert losses == want[tuple(one)], (argv[-4:], losses, want[tuple(one)])  # bitwise: the same sums
    # ZeRO-3 over two data-parallel replicas, a chunk of no layer among the gathered ones
    [zero3] = run_ranks(train_losses, 4, args=(GPT + ["--pp", "2", "--zero-stage", "3", LAYOUT, "E|tt|tt|L"],))[-1:]
    assert rel_err(torch.tensor(zero3), torch.tensor(want[tuple(GPT)])) <= 1e-5
    # a checkpoint saved with the loss's stage empty resumes on one rank
    [resumed] = run_ranks(train_losses, 1, args=(GPT + ["--load", str(tmp_path / "ck")],))
    assert resumed == want[tuple(GPT)][2:]


def _generate_on_a_layout(rank, world, counts, vpp):
    """Greedy tokens of gpt-tiny with this rank's chunks of `counts` (one layer count per virtual stage)."""
    from megalite import parallel
    from megalite.generation import generate
    from megalite.models import GPTModel
    from megalite.pipeline.partition import layers_of, virtual_stage
    from training_ranks import built_model

    config = built_model(["--model", "gpt-tiny"])
    parallel.initialize_model_parallel(1, world, virtual_pipeline_model_parallel_size=vpp)
    chunks = []
    for c in range(vpp or 1):
        stage = virtual_stage(world, rank, c)
        chunks.append(GPTModel(config, stage == 0, stage == len(counts) - 1, layers_of(counts, stage), seed=5).eval())
    return generate(chunks, [[5, 6, 7], [9, 3]], max_new_tokens=4, eos_id=None).tokens


@pytest.mark.slow
def test_generation_runs_through_stages_of_no_layer_and_ranks_of_no_weight():
    [want] = run_ranks(_generate_on_a_layout, 1, args=([4], None))
    assert run_ranks(_generate_on_a_layout, 2, args=([1, 0, 3, 0], 2)) == [want] * 2  # E | (nothing) | ttt | L
    assert run_ranks(_generate_on_a_layout, 3, args=([4, 0, 0], None)) == [want] * 3  # a middle rank of no weight


def test_the_planner_takes_a_pipeline_rank_of_no_weight_under_zero_3(capsys):
    from megalite.tools.plan.cli import main

    main(["--model", "gpt2-350m", "--gpus", "8", "--global-batch-size", "64", "--compare",
          "tp=1,pp=4,dp=2,mb=1,zero=3,layers=12+0+12+0"])
    out = capsys.readouterr().out
    assert "compared tp=1,pp=4,dp=2,mb=1,zero=3,layers=12+0+12+0: tp 1 pp 4 dp 2" in out, out[-2000:]


def test_with_load_the_checkpoints_depth_gives_the_virtual_stages_and_the_split(tmp_path, monkeypatch):
    from test_resume_policy import saved_checkpoint
    from megalite.training.checkpoint_shape import adopt_checkpoint_shape

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ckpt = saved_checkpoint(tmp_path / "ck", ["--mock-data", "--num-layers", "6", "--seq-length", "16"])
    # the preset's 4 layers + embedding + loss do not fill 2 x 2-layer virtual stages; the checkpoint's 6 do
    argv = ["--load", str(ckpt), "--pp", "2", "--num-layers-per-virtual-pipeline-stage", "2", EMBEDDING, LOSS]
    cfg = adopt_checkpoint_shape(parse(argv))
    assert (cfg.model.num_layers, cfg.parallel.vpp, cfg.parallel.pipeline_layers) == (6, 2, [1, 2, 2, 1])
    cfg = adopt_checkpoint_shape(parse(["--load", str(ckpt), "--pp", "2", LAYOUT, "Ett|tt|t|tL"]))
    assert (cfg.parallel.vpp, cfg.parallel.pipeline_layers) == (2, [2, 2, 1, 1])
    # a shape flag given keeps the preset's model (4 layers), whose depth the virtual stages then take
    cfg = adopt_checkpoint_shape(parse(["--load", str(ckpt), "--pp", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                                        "--hidden-size", "128"]))
    assert cfg.parallel.vpp == 2
