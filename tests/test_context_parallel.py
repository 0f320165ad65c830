"""Context parallelism through the whole model and loop: every rank holds part of each sequence
(chunks i and 2N-1-i), attention spans it over the CP group, and training equals one device."""
from __future__ import annotations

import pytest
import torch

from helpers import rel_err
from megalite.testing import run_ranks
from training_ranks import gpt_run, parse, train_losses

BASE = ["--seq-length", "32", "--global-batch-size", "8", "--micro-batch-size", "2", "--log-interval", "1",
        "--train-iters", "5", "--eval-iters", "0"]


def assert_same_losses(got, want, what):
    assert len(got) == len(want) == 5, what
    for a, b in zip(got, want):
        assert rel_err(torch.tensor(a), torch.tensor(b)) <= 1e-5, (what, got, want)


@pytest.fixture(scope="module")
def one_device():
    return {model: run_ranks(train_losses, 1, args=(BASE + ["--model", model],))[0]
            for model in ("gpt-tiny", "llama-tiny")}


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_training_equals_one_device(one_device, cp):
    for losses in run_ranks(train_losses, cp, args=(BASE + ["--cp", str(cp)],)):
        assert_same_losses(losses, one_device["gpt-tiny"], f"cp {cp}")


@pytest.mark.parametrize("layout", [
    ["--tp", "2", "--cp", "2", "--pp", "2", "--sequence-parallel", "--recompute", "full",
     "--use-distributed-optimizer"],  # (tp, cp, pp, dp) = (2, 2, 2, 1)
    ["--cp", "2", "--pp", "2", "--recompute", "full", "--use-distributed-optimizer"],  # (1, 2, 2, 2)
], ids=["tp2-cp2-pp2-dp1-sp", "tp1-cp2-pp2-dp2"])
def test_four_dimensional_layouts_on_8_ranks_equal_one_device(one_device, layout):
    for losses in run_ranks(train_losses, 8, args=(BASE + layout,), timeout=600):
        assert_same_losses(losses, one_device["gpt-tiny"], layout)


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_llama_with_rope_and_grouped_keys_is_context_parallel(one_device, comm):
    # llama-tiny: rope positions follow each chunk's global place; 2 KV groups (a2a splits them).
    argv = BASE + ["--model", "llama-tiny", "--cp", "2", "--cp-comm-type", comm]
    for losses in run_ranks(train_losses, 2, args=(argv,)):
        assert_same_losses(losses, one_device["llama-tiny"], comm)


def test_context_parallel_composes_with_zero_stage_3(one_device):
    for losses in run_ranks(train_losses, 4, args=(BASE + ["--cp", "2", "--zero-stage", "3"],)):
        assert_same_losses(losses, one_device["gpt-tiny"], "cp 2 dp 2 zero 3")


@pytest.mark.parametrize("argv, world, says", [
    (["--cp", "2", "--seq-length", "30"], 2, "--seq-length 30 is not divisible by 4"),
    (["--cp", "3"], 4, "--tp 1 x --cp 3 x --pp 1 = 3 does not divide the number of ranks (4)"),
    (["--cp", "2", "--attention-dropout", "0.1"], 2, "drop --attention-dropout"),
    (["--cp", "2", "--cp-comm-type", "a2a", "--num-attention-heads", "1", "--hidden-size", "64"], 2,
     "use --cp-comm-type p2p"),
    (["--cp", "2", "--tp", "4", "--sequence-parallel", "--seq-length", "20"], 8, "divisible by --tp 4"),
])
def test_bad_context_parallel_layouts_are_refused_in_one_line(argv, world, says):
    from megalite import arguments
    from megalite.runtime import UsageError

    args = parse(argv)
    with pytest.raises(UsageError, match=says.replace("(", r"\(").replace(")", r"\)")):
        arguments.validate(args, world, arguments.model_config(args))


def test_bert_refuses_context_parallelism_naming_the_flag():
    import pretrain_bert
    from megalite import arguments
    from megalite.runtime import UsageError

    args = arguments.build_parser("bert", default_model="bert-tiny").parse_args(["--mock-data", "--cp", "2"])
    with pytest.raises(UsageError, match="drop --cp"):
        pretrain_bert.prepare(args)


@pytest.mark.parametrize("saved, resumed", [
    ((4, ["--cp", "2", "--use-distributed-optimizer"]), (1, [])),  # cp 2 dp 2 -> one device
    ((1, []), (4, ["--cp", "4", "--zero-stage", "2"])),  # one device -> cp 4
], ids=["cp2-dp2-to-one-device", "one-device-to-cp4-zero2"])
def test_checkpoints_move_between_context_parallel_layouts(tmp_path, saved, resumed):
    from test_zero_checkpoint import save_then_resume, unbroken

    resumed_losses = save_then_resume(tmp_path, saved, resumed)
    whole = unbroken(*resumed)
    assert rel_err(torch.tensor(resumed_losses), torch.tensor(whole[3:])) <= 1e-5, (resumed_losses, whole)


def ring_traffic(rank, world, argv):
    """Bytes this rank's ring sends in one training step, and what the formula says."""
    from megalite.parallel import context_parallel

    sent = []
    original = context_parallel._start_exchange

    def counted(send, *args, **kwargs):
        sent.append(send.nbytes)
        return original(send, *args, **kwargs)

    context_parallel._start_exchange = counted
    try:
        gpt_run(argv)
    finally:
        context_parallel._start_exchange = original
    return sum(sent)


def test_the_ring_sends_the_analytical_volume_per_layer_in_training():
    from megalite.models import preset
    from megalite.parallel.context_parallel import ring_bytes_per_layer

    cp, micro, seq = 2, 2, 32
    argv = BASE[:-4] + ["--train-iters", "1", "--eval-iters", "0", "--cp", str(cp)]  # one step, 4 micro-batches
    config = preset("gpt-tiny")
    per_layer = ring_bytes_per_layer(micro, config.num_attention_heads, seq // cp, config.head_dim, cp)["total"]
    micro_batches = 8 // micro
    for sent in run_ranks(ring_traffic, cp, args=(argv,)):
        assert sent == config.num_layers * micro_batches * per_layer
