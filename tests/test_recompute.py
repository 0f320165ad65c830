"""Activation recomputation (full: uniform or block; selective: the attention core) replays the
same operations on the same inputs and dropout masks: losses, gradient norms and weights are
bitwise those without it."""
import pytest

from megalite.testing import run_ranks
from test_sequence_parallel import BASE, assert_same_runs
from training_ranks import train_params

RECOMPUTE = [
    ["--recompute", "full"],
    ["--recompute", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
    ["--recompute", "full", "--recompute-method", "block", "--recompute-num-layers", "3"],
    ["--recompute", "selective"],
    ["--recompute", "selective", "--attention-backend", "torch"],
]


@pytest.mark.parametrize("flags", RECOMPUTE, ids=lambda f: "-".join(x.strip("-") for x in f[1::2]))
def test_recomputation_replays_the_same_numbers(flags):
    argv = BASE + ["--tp", "2", "--sequence-parallel"]
    if "torch" in flags:
        argv += ["--attention-backend", "torch"]
        flags = flags[:2]
    plain = run_ranks(train_params, 2, args=(argv,))
    recomputed = run_ranks(train_params, 2, args=(argv + flags,))
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


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_compiled_recomputation_stays_in_the_graph_with_the_same_dropout_masks(recompute):
    """Under torch.compile the checkpoint is traced into the graph (the compiled backward recomputes
    the region; no Python replay), where its RNG bookkeeping and Llama-style cached tables used to
    break the graph around every checkpointed region: one graph, gradients bitwise those without
    recomputation, dropout masks and all."""
    plain, _ = run_ranks(_compiled_gradients, 1, args=("none", False))[0]
    recomputed, graphs = run_ranks(_compiled_gradients, 1, args=(recompute, False))[0]
    assert graphs == 1
    assert all(a.equal(b) for a, b in zip(recomputed, plain))


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_compiled_recomputation_that_cannot_be_traced_replays_eagerly(recompute):
    """Attention dropout forking the seeded TP-rank stream: dynamo breaks the graph there, so the
    checkpoint runs eagerly and replays both RNG streams: gradients bitwise those without."""
    plain, _ = run_ranks(_compiled_gradients, 1, args=("none", True))[0]
    recomputed, graphs = run_ranks(_compiled_gradients, 1, args=(recompute, True))[0]
    assert graphs > 1
    assert all(a.equal(b) for a, b in zip(recomputed, plain))
