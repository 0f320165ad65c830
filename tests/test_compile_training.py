"""--torch-compile in the training loop (issue 30): at --tp 1 each stage's chunk is compiled as one
region (embedding, layers, head and loss fuse; the whole-model compile closed most of the compiled
gap to plain PyTorch in scripts/benchmark_step.py), with tensor parallelism layer by layer as before;
either way the losses are the eager run's. The aot_eager backend traces what inductor would compile,
in seconds on a CPU."""
import pytest

from megalite.testing import run_ranks
from training_ranks import gpt_run, side_by_side

BASE = ["--seq-length", "32", "--global-batch-size", "8", "--micro-batch-size", "2", "--log-interval", "1",
        "--train-iters", "3", "--eval-interval", "0"]
LLAMA = ["--model", "llama-tiny", "--num-layers", "2"]


def _losses_and_compiled(rank, world, argv):
    run = gpt_run(argv)
    chunk = run.model_chunks[0]
    whole = getattr(chunk, "_compiled_call_impl", None) is not None
    layers = [getattr(layer, "_compiled_call_impl", None) is not None for layer in chunk.layers]
    return [r["loss"] for r in run.records], whole, layers


def _figures(rank, world, argv):
    run = gpt_run(argv)
    return [{k: r[k] for k in ("loss", "moe_aux_loss", "moe_z_loss", "moe_load_imbalance")} for r in run.records]


def _in_turn(rank, world, calls):
    """fn(rank, world, argv) for each (fn, argv) in turn, in one process, dynamo reset before each:
    a compiled run's first compilation pays for dynamo's and AOTAutograd's warm-up, later ones do not."""
    import torch._dynamo

    out = []
    for fn, argv in calls:
        torch._dynamo.reset()
        out.append(fn(rank, world, argv))
    return out


LAYOUTS = {"tp1": (1, [], True), "pp2": (2, ["--pp", "2"], True), "tp2": (2, ["--tp", "2"], False)}
COMPILE = ["--torch-compile"]


def _moe_argv():
    from test_moe_training import BIAS
    argv = [*BIAS, "--recompute", "full"]
    argv[argv.index("--train-iters") + 1] = "3"
    return argv


@pytest.fixture(scope="module")
def runs():
    """(case, compiled) -> the last rank's result: every run of one world size in one spawn (eager
    first, then compiled), the one-rank spawn beside the two-rank one (it leaves a core idle)."""
    one = [(_losses_and_compiled, BASE + LLAMA), (_figures, _moe_argv())]
    two = [(_losses_and_compiled, BASE + LLAMA + flags) for world, flags, _ in LAYOUTS.values() if world == 2]
    env = {"MEGALITE_COMPILE_BACKEND": "aot_eager"}  # read only under --torch-compile
    got_one, got_two = side_by_side(*(
        lambda calls=calls, world=world: run_ranks(
            _in_turn, world, args=(calls + [(fn, argv + COMPILE) for fn, argv in calls],), env=env, timeout=600)[-1]
        for world, calls in ((1, one), (2, two))))
    names = [["tp1", "moe"], [n for n, (world, _, _) in LAYOUTS.items() if world == 2]]
    out = {}
    for got, keys in zip((got_one, got_two), names):
        for i, key in enumerate(keys):
            out[(key, False)], out[(key, True)] = got[i], got[len(keys) + i]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_training_gives_the_eager_losses(runs, layout):
    whole = LAYOUTS[layout][2]
    eager, compiled = runs[(layout, False)], runs[(layout, True)]
    assert eager[1] is False and not any(eager[2])
    assert compiled[1] is whole and all(compiled[2]) is not whole
    assert len(compiled[0]) == 3
    for a, b in zip(compiled[0], eager[0]):
        assert abs(a - b) <= 1e-5 * abs(b), (compiled[0], eager[0])


@pytest.mark.slow
def test_compiled_recomputation_of_moe_layers_counts_each_token_once(runs):
    """A MoE GPT with the expert bias, compiled with full recomputation: dynamo cannot trace a MoE
    layer's checkpoint (the router's running counts), so it runs eagerly between graphs and replays
    the RNG state and the recomputing flag as eager code does: the routers count and the MoE
    figures take each token once, and the losses are the eager run's."""
    eager, compiled = runs[("moe", False)], runs[("moe", True)]
    assert len(compiled) == 3
    for a, b in zip(compiled, eager):
        for k in b:
            assert abs(a[k] - b[k]) <= 1e-5 * abs(b[k]), (k, compiled, eager)
