"""--torch-compile in the training loop (issue 30): at --tp 1 each stage's chunk is compiled as one
region (embedding, layers, head and loss fuse; the whole-model compile closed most of the compiled
gap to plain PyTorch in scripts/benchmark_step.py), with tensor parallelism layer by layer as before;
either way the losses are the eager run's. The aot_eager backend traces what inductor would compile,
in seconds on a CPU."""
import pytest

from megalite.testing import run_ranks
from training_ranks import gpt_run

BASE = ["--seq-length", "32", "--global-batch-size", "8", "--micro-batch-size", "2", "--log-interval", "1",
        "--train-iters", "3", "--eval-interval", "0"]
LLAMA = ["--model", "llama-tiny", "--num-layers", "2"]


def _losses_and_compiled(rank, world, argv):
    run = gpt_run(argv)
    chunk = run.model_chunks[0]
    whole = getattr(chunk, "_compiled_call_impl", None) is not None
    layers = [getattr(layer, "_compiled_call_impl", None) is not None for layer in chunk.layers]
    return [r["loss"] for r in run.records], whole, layers


@pytest.mark.slow
@pytest.mark.parametrize("world,flags,whole", [(1, [], True), (2, ["--pp", "2"], True), (2, ["--tp", "2"], False)],
                         ids=["tp1", "pp2", "tp2"])
def test_compiled_training_gives_the_eager_losses(world, flags, whole):
    argv = BASE + LLAMA + flags
    eager = run_ranks(_losses_and_compiled, world, args=(argv,))[-1]
    compiled = run_ranks(_losses_and_compiled, world, args=(argv + ["--torch-compile"],),
                         env={"MEGALITE_COMPILE_BACKEND": "aot_eager"})[-1]
    assert eager[1] is False and not any(eager[2])
    assert compiled[1] is whole and all(compiled[2]) is not whole
    assert len(compiled[0]) == 3
    for a, b in zip(compiled[0], eager[0]):
        assert abs(a - b) <= 1e-5 * abs(b), (compiled[0], eager[0])


def _figures(rank, world, argv):
    run = gpt_run(argv)
    return [{k: r[k] for k in ("loss", "moe_aux_loss", "moe_z_loss", "moe_load_imbalance")} for r in run.records]


@pytest.mark.slow
def test_compiled_recomputation_of_moe_layers_counts_each_token_once():
    """A MoE GPT with the expert bias, compiled with full recomputation: dynamo cannot trace a MoE
    layer's checkpoint (the router's running counts), so it runs eagerly between graphs and replays
    the RNG state and the recomputing flag as eager code does: the routers count and the MoE
    figures take each token once, and the losses are the eager run's."""
    from test_moe_training import BIAS
    argv = [*BIAS, "--recompute", "full"]
    argv[argv.index("--train-iters") + 1] = "3"
    eager = run_ranks(_figures, 1, args=(argv,))[0]
    compiled = run_ranks(_figures, 1, args=(argv + ["--torch-compile"],),
                         env={"MEGALITE_COMPILE_BACKEND": "aot_eager"})[0]
    assert len(compiled) == 3
    for a, b in zip(compiled, eager):
        for k in b:
            assert abs(a[k] - b[k]) <= 1e-5 * abs(b[k]), (k, compiled, eager)
