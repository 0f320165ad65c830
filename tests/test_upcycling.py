"""`--moe-use-upcycling`: a dense checkpoint's weights as the experts' (megalite.checkpoint.upcycle,
Megatron-Core's formulas), saved before training (as iteration 0) and trained on from the dense run's
data position with a fresh optimizer and learning-rate schedule (megalite.training.upcycling).

Where the upcycled function is the dense one (softmax after the top-k; granularity 1, or squared ReLU
at any granularity), the upcycled model's first loss is the dense model's loss on the same batch, and
Megatron-LM's own dense checkpoint upcycled gives megatron-core's dense logits."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megalite import checkpoint, parallel
from megalite.checkpoint.megatron_dist import MegatronCheckpoint
from megalite.checkpoint.upcycle import load_upcycled_weights, weight_scale
from megalite.models import GPTModel
from helpers import sentencepiece_fixture
from megalite.testing import run_ranks
from test_data_per_split import _write
from training_ranks import gpt_run, one_device_each, run_refusal, side_by_side, train_losses

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_ckpt"
STEPS = ["--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "4", "--micro-batch-size", "2",
         "--log-interval", "1", "--eval-interval", "0"]
LLAMA = ["--model", "llama-tiny", *STEPS]  # SwiGLU
SQUARED = ["--model", "gpt-tiny", "--squared-relu", *STEPS]  # ffn 512, biases
EXPERTS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0", "--moe-use-upcycling"]
GRANULAR = [*EXPERTS, "--moe-upcycling-granularity", "2", "--moe-ffn-hidden-size", "256"]


def _losses(run):
    return [r["loss"] for r in run.records]


def _one_device(rank, world, d, tokenizer):
    out = {}
    out["llama from scratch"] = [r["lr"] for r in gpt_run(LLAMA + ["--train-iters", "2", "--save", f"{d}/llama"]).records]
    gpt_run(SQUARED + ["--train-iters", "2", "--save", f"{d}/squared"])
    # the dense models' losses on the batch after their checkpoint (iteration 3 reads samples 8..11)
    out["llama dense"] = _losses(gpt_run(LLAMA + ["--train-iters", "3", "--load", f"{d}/llama"]))
    out["squared dense"] = _losses(gpt_run(SQUARED + ["--train-iters", "3", "--load", f"{d}/squared"]))
    up = gpt_run(LLAMA + EXPERTS + ["--train-iters", "4", "--load", f"{d}/llama", "--save", f"{d}/up"])
    out["llama up"] = [(r["iteration"], r["loss"], r["lr"]) for r in up.records]
    out["squared up"] = _losses(gpt_run(SQUARED + GRANULAR + ["--train-iters", "3", "--load", f"{d}/squared"]))
    out["swiglu g2"] = _losses(gpt_run(LLAMA + EXPERTS + ["--moe-upcycling-granularity", "2",
                                                          "--moe-ffn-hidden-size", "128", "--train-iters", "2",
                                                          "--load", f"{d}/llama", "--save", f"{d}/g2"]))
    out["finetune"] = [(r["iteration"], r["loss"]) for r in gpt_run(
        LLAMA + EXPERTS + ["--train-iters", "2", "--load", f"{d}/llama", "--finetune"]).records]
    # what a plain run makes of the upcycled checkpoint (iteration 0): the same iterations 1..4
    out["resumed"] = _losses(gpt_run(LLAMA + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff",
                                              "0", "--train-iters", "5", "--load", f"{d}/up/iter_0000000"]))
    # the job requeued with the flag still on: its own checkpoints, not a second upcycling
    out["requeued"] = _losses(gpt_run(LLAMA + EXPERTS + ["--train-iters", "5", "--load", f"{d}/llama",
                                                         "--save", f"{d}/up"]))
    out["refusals"] = [
        run_refusal(LLAMA + EXPERTS + ["--train-iters", "2"]),
        run_refusal(LLAMA + EXPERTS + ["--train-iters", "2", "--load", f"{d}/llama", "--save", f"{d}/llama"]),
        run_refusal(LLAMA + EXPERTS + ["--train-iters", "2", "--load", f"{d}/llama", "--save", f"{d}/squared"]),
        run_refusal(LLAMA + EXPERTS + ["--train-iters", "6", "--load", f"{d}/up"]),
        run_refusal(LLAMA + EXPERTS + ["--moe-upcycling-granularity", "2", "--train-iters", "2", "--load", f"{d}/llama"]),
        run_refusal(LLAMA + EXPERTS + ["--moe-upcycling-granularity", "3", "--moe-ffn-hidden-size", "85",
                                    "--train-iters", "2", "--load", f"{d}/llama"]),
        run_refusal(LLAMA + ["--num-experts", "3", "--moe-upcycling-granularity", "2", "--moe-ffn-hidden-size", "128",
                          "--moe-use-upcycling", "--train-iters", "2", "--load", f"{d}/llama"]),
        run_refusal(LLAMA + EXPERTS + ["--hidden-size", "64", "--train-iters", "2", "--load", f"{d}/llama"]),
    ]
    # real data: iterations 1..4 read samples 8..23 of a corpus a run of 4 iterations from scratch reads 16 of;
    # a resume of its checkpoint builds the same data (the schedule's start in the checkpoint)
    data = ["--data-path", _write(f"{d}/corpus", 40, 100), "--tokenizer", tokenizer, "--seq-length", "16"]
    gpt_run(LLAMA + data + ["--train-iters", "2", "--save", f"{d}/on_data"])
    out["on data"] = [(r["iteration"], r["loss"]) for r in gpt_run(
        LLAMA + data + EXPERTS + ["--train-iters", "4", "--load", f"{d}/on_data", "--save", f"{d}/on_data_up",
                                  "--save-interval", "1"]).records]
    out["on data resumed"] = _losses(gpt_run(LLAMA + data + EXPERTS[:-1] + ["--train-iters", "4", "--load",
                                                                            f"{d}/on_data_up/iter_0000002"]))
    out["refusals"].append(run_refusal(LLAMA + EXPERTS + ["--train-iters", "2", "--load", f"{d}/on_data",
                                                       "--save", f"{d}/up"]))
    # the schedule is this command line's, not the dense checkpoint's (2 iterations long)
    decay = ["--lr", "1e-3", "--lr-warmup-iters", "0", "--lr-decay-style", "linear", "--min-lr", "0", "--train-iters",
             "5"]
    out["decay from scratch"] = [r["lr"] for r in gpt_run(LLAMA + decay).records]
    out["decay upcycled"] = [r["lr"] for r in gpt_run(LLAMA + EXPERTS + decay + ["--load", f"{d}/llama"]).records]
    return out


tokenizer = sentencepiece_fixture("\n".join(f"the value {i} is {i * 7} and not {i * 3}" for i in range(300)))


@pytest.fixture(scope="module")
def one_device(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("upcycling")
    return d, run_ranks(_one_device, 1, args=(str(d), str(tokenizer.path)), timeout=900)[0]


def test_the_upcycled_model_computes_the_dense_function_where_the_formulas_are_exact(one_device):
    _, out = one_device
    # SwiGLU at granularity 1 (every expert a copy), squared ReLU at granularity 2 (s^3 = 2):
    # iteration 1 of the upcycled run reads the batch iteration 3 of the dense run reads
    assert out["llama up"][0][0] == 1
    assert out["llama up"][0][1] == pytest.approx(out["llama dense"][0], rel=1e-6)
    assert out["squared up"][0] == pytest.approx(out["squared dense"][0], rel=1e-5)
    # SwiGLU at granularity 2: s = 2^(1/3) is the paper's heuristic, not exact (silu is not homogeneous)
    assert out["swiglu g2"][0] != pytest.approx(out["llama dense"][0], rel=1e-5)
    assert out["swiglu g2"][0] == pytest.approx(out["llama dense"][0], rel=0.05)


def test_the_run_trains_every_iteration_with_the_schedule_from_its_start(one_device):
    d, out = one_device
    records = out["llama up"]
    assert [r[0] for r in records] == [1, 2, 3, 4]
    assert [r[2] for r in records[:2]] == out["llama from scratch"]  # a run from scratch's rates
    assert out["decay upcycled"] == out["decay from scratch"]  # the command line's schedule, not the dense run's
    meta = checkpoint.CheckpointReader(Path(d) / "up" / "iter_0000000").metadata
    assert (meta["iteration"], meta["consumed_samples"], meta["schedule_start"]) == (0, 8, [0, 8])
    assert meta["upcycled_from"] == str((Path(d) / "llama").resolve())
    # --finetune: data from sample 0 (iteration 1's loss is then not the dense run's iteration 3's)
    assert [r[0] for r in out["finetune"]] == [1, 2]
    assert out["finetune"][0][1] != pytest.approx(out["llama up"][0][1], rel=1e-6)
    assert [i for i, _ in out["on data"]] == [1, 2, 3, 4]  # the data built to reach past the dense run's position
    assert out["on data resumed"] == [loss for _, loss in out["on data"][2:]]


def test_a_resumed_or_requeued_run_continues_the_upcycled_one(one_device):
    _, out = one_device
    assert out["resumed"][:4] == [r[1] for r in out["llama up"]]  # the schedule's start travels in the checkpoint
    assert out["requeued"] == out["resumed"][4:]  # iteration 5 from the checkpoint of iteration 4


def test_granular_experts_hold_the_scaled_parts_and_the_router_rows_are_tied(one_device):
    d, _ = one_device
    _, _, dense = checkpoint.load_full_state_dict(Path(d) / "llama")
    config, _, moe = checkpoint.load_full_state_dict(Path(d) / "g2" / "iter_0000000")
    s = weight_scale(config, 2)
    assert s == pytest.approx(2 ** (1 / 3))
    for layer in range(config.num_layers):
        fc1, fc2 = dense[f"layers.{layer}.mlp.fc1.weight"], dense[f"layers.{layer}.mlp.fc2.weight"]
        gate, up = fc1.chunk(2)
        for e in range(4):
            j = e % 2
            part = torch.cat([gate[j * 128:(j + 1) * 128], up[j * 128:(j + 1) * 128]])
            torch.testing.assert_close(moe[f"layers.{layer}.mlp.experts.fc1_weight"][e], part * s, rtol=0, atol=0)
            torch.testing.assert_close(moe[f"layers.{layer}.mlp.experts.fc2_weight"][e],
                                       fc2[:, j * 128:(j + 1) * 128] * s, rtol=0, atol=0)
        router = moe[f"layers.{layer}.mlp.router.weight"]
        assert torch.equal(router[0], router[1]) and torch.equal(router[2], router[3])
        assert not torch.equal(router[0], router[2])
    copied = [n for n in dense if ".mlp." not in n]
    assert len(copied) > 10 and all(torch.equal(moe[n], dense[n]) for n in copied)


def test_bad_upcycling_is_refused_in_one_line(one_device):
    d, out = one_device
    no_load, same, dense_save, moe_load, width, divisible, experts, shape, other_upcycling = out["refusals"]
    assert "--moe-use-upcycling needs --load DIR" in no_load
    assert "is --load's directory" in same and "a --save directory of its own" in same
    assert "already holds a checkpoint that is not this upcycling of --load" in dense_save
    assert "already holds a checkpoint that is not this upcycling of --load" in other_upcycling
    assert "already holds experts; drop the flag to resume it" in moe_load
    assert "give --moe-ffn-hidden-size 128 (the dense width / the granularity)" in width
    assert "not divisible by --moe-upcycling-granularity 3" in divisible
    assert "--num-experts 3 is not a multiple of --moe-upcycling-granularity 2" in experts
    assert "hidden_size 128 (checkpoint) vs 64 (now)" in shape


def _megatron_upcycled(rank, world, ep):
    """megatron-core's dense Llama checkpoint upcycled into 4 SwiGLU experts (granularity 1) at `ep`:
    the logits, to compare with megatron-core's dense model's."""
    reader = MegatronCheckpoint(FIXTURES / "llama")
    expected = torch.load(FIXTURES / "llama" / "expected.pt")
    config = reader.config.replace(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=reader.config.ffn_hidden_size,
                                   moe_layer_freq=[1] * reader.config.num_layers)
    parallel.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    try:
        model = GPTModel(config, seed=11, device="cpu").eval()
        load_upcycled_weights(reader, [model], config, 1)
        with torch.no_grad():
            logits = model(expected["tokens"])[..., :config.vocab_size]
    finally:
        parallel.destroy_model_parallel()
    return (logits - expected["logits"][..., :config.vocab_size]).abs().max().item()


def _layouts(rank, world, d, argvs):
    return [train_losses(rank, world, argv) for argv in argvs], _megatron_upcycled(rank, world, 2)


LAYOUTS = {"ep2": ["--ep", "2"], "tp2 sp": ["--tp", "2", "--sequence-parallel"], "pp2": ["--pp", "2"],
           "dp2 zero3": ["--zero-stage", "3"]}


@pytest.mark.slow
def test_upcycling_at_every_layout_gives_one_devices_run_and_megatron_cores_dense_logits(one_device):
    d, _ = one_device
    base = LLAMA + EXPERTS + ["--train-iters", "3", "--load", f"{d}/llama"]
    (one,), per_rank = side_by_side(
        lambda: one_device_each(train_losses, [base], ranks=1, timeout=600),
        lambda: run_ranks(_layouts, 2, args=(d, [base + extra for extra in LAYOUTS.values()]), timeout=600))
    for r, (runs, megatron_error) in enumerate(per_rank):
        assert megatron_error <= 1e-5, megatron_error
        for name, got in zip(LAYOUTS, runs):
            if got:  # the ranks that hold the loss
                assert torch.allclose(torch.tensor(got), torch.tensor(one), rtol=1e-5, atol=0), (name, got, one)


def test_the_data_reaches_where_the_steps_after_the_dense_runs_position_end():
    from megalite.config.batch_schedule import BatchSchedule

    for schedule in (BatchSchedule(16), BatchSchedule(16, (4, 4, 32)), BatchSchedule(16, None, ((0, 4), (40, 8), (120, 16)))):
        for start, steps in ((0, 10), (104, 9), (7, 3)):
            consumed = start
            for _ in range(steps):  # the loop's own count: each step's batch by the samples consumed
                consumed += schedule.at(consumed)
            assert schedule.samples_for_steps(steps, start=start) == consumed, (schedule, start, steps)
