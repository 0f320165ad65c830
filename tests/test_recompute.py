"""Activation recomputation (full: uniform or block; selective: the attention core) replays the
same operations on the same inputs and dropout masks: losses, gradient norms and weights are
bitwise those without it. Each group of cases below trains (or compiles) in one spawn of ranks,
each configuration once: the runs without recomputation serve every case they are compared with."""
import pytest

from megalite.testing import run_ranks
from test_sequence_parallel import BASE, assert_same_runs
from training_ranks import several, train_params

RECOMPUTE = [
    ["--recompute", "full"],
    ["--recompute", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
    ["--recompute", "full", "--recompute-method", "block", "--recompute-num-layers", "3"],
    ["--recompute", "selective"],
    ["--recompute", "selective", "--attention-backend", "torch"],
]
# Two steps of two micro-batches (argparse: the last flag wins): the second step's forward runs on
# weights the first updated, and each micro-batch draws its own dropout masks, which a recomputation
# must replay (BASE's four steps of four micro-batches repeat the same replays).
SHORT = ["--train-iters", "2", "--global-batch-size", "4"]


def _argvs(flags):
    """(without recomputation, with it) for one case."""
    argv = BASE + ["--tp", "2", "--sequence-parallel"] + SHORT
    if "torch" in flags:
        argv += ["--attention-backend", "torch"]
        flags = flags[:2]
    return argv, argv + flags


@pytest.fixture(scope="module")
def trained():
    """argv (as a tuple) -> each rank's run, every distinct configuration trained once in one spawn."""
    argvs = list(dict.fromkeys(tuple(a) for flags in RECOMPUTE for a in _argvs(flags)))
    per_rank = run_ranks(several, 2, args=(train_params, [list(a) for a in argvs]), timeout=600)
    return {a: [runs[i] for runs in per_rank] for i, a in enumerate(argvs)}


@pytest.mark.parametrize("flags", RECOMPUTE, ids=lambda f: "-".join(x.strip("-") for x in f[1::2]))
def test_recomputation_replays_the_same_numbers(trained, flags):
    plain, recomputed = (trained[tuple(a)] for a in _argvs(flags))
    assert_same_runs(recomputed, plain, 0.0)  # the same operations on the same inputs and dropout masks: bitwise


def _compiled_gradients(rank, world, recompute, tp_rng_seeded):
    """A GPT with dropout compiled whole (aot_eager: what inductor is given): the gradients of one
    seeded step, and the graphs dynamo made. With the TP-rank RNG stream seeded (as training seeds
    it), attention dropout forks it, which dynamo does not trace."""
    import torch
    import torch._dynamo
    from megalite import parallel
    from megalite.models import GPTModel, TransformerConfig
    torch._dynamo.reset()
    parallel.initialize_model_parallel(1)
    if tp_rng_seeded:
        parallel.model_parallel_manual_seed(7)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100,
                               max_position_embeddings=16, hidden_dropout=0.3, attention_dropout=0.3,
                               recompute=recompute)
    model = GPTModel(config, seed=3, device="cpu").train()
    graphs = []

    def backend(gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(123)
    torch.compile(model, backend=backend)(ids, labels=ids).sum().backward()
    return [p.grad for p in model.parameters()], len(graphs)


def _all_compiled(rank, world, cases):
    """_compiled_gradients for each (recompute, tp_rng_seeded) in turn, in one process: each case
    starts from no model-parallel state, no RNG stream tracked and dynamo reset."""
    from megalite import parallel
    from megalite.parallel.random import get_rng_tracker

    out = {}
    for recompute, tp_rng_seeded in cases:
        parallel.destroy_model_parallel()
        get_rng_tracker().reset()  # unseeded means unseeded: no TP stream left by the case before
        out[(recompute, tp_rng_seeded)] = _compiled_gradients(rank, world, recompute, tp_rng_seeded)
    return out


@pytest.fixture(scope="module")
def compiled():
    """(recompute, tp_rng_seeded) -> (gradients, graphs), each compiled once, all in one process:
    the first compilation pays for dynamo's and aot_autograd's warm-up, the others do not."""
    cases = [(recompute, seeded) for seeded in (False, True) for recompute in ("none", "full", "selective")]
    return run_ranks(_all_compiled, 1, args=(cases,), timeout=600)[0]


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_compiled_recomputation_stays_in_the_graph_with_the_same_dropout_masks(compiled, recompute):
    """Under torch.compile the checkpoint is traced into the graph (the compiled backward recomputes
    the region; no Python replay), where its RNG bookkeeping and Llama-style cached tables used to
    break the graph around every checkpointed region: one graph, gradients bitwise those without
    recomputation, dropout masks and all."""
    plain, _ = compiled[("none", False)]
    recomputed, graphs = compiled[(recompute, False)]
    assert graphs == 1
    assert all(a.equal(b) for a, b in zip(recomputed, plain))


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_compiled_recomputation_that_cannot_be_traced_replays_eagerly(compiled, recompute):
    """Attention dropout forking the seeded TP-rank stream: dynamo breaks the graph there, so the
    checkpoint runs eagerly and replays both RNG streams: gradients bitwise those without."""
    plain, _ = compiled[("none", True)]
    recomputed, graphs = compiled[(recompute, True)]
    assert graphs > 1
    assert all(a.equal(b) for a, b in zip(recomputed, plain))
