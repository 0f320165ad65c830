"""Sequence parallelism changes memory, never numbers: losses, gradients and weights equal plain
tensor parallelism with dropout on (GPT through the training loop and alone, RMSNorm, BERT)."""
import pytest
import torch
import torch.distributed as dist

from helpers import assert_rel_close, fresh_seed, rel_err
from megalite import parallel
from megalite.models import GPTModel, TransformerConfig
from megalite.testing import run_ranks
from test_bert_model import assert_same_results, bert_forward_backward
from test_gpt_model import gpt_forward_backward
from training_ranks import train_params

# Training flags shared by the layout comparisons here, in test_recompute.py and test_activation_memory.py.
BASE = ["--seq-length", "32", "--log-interval", "1", "--global-batch-size", "8", "--micro-batch-size", "2",
        "--train-iters", "4", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def assert_same_runs(a, b, tol, params=True):
    """Per-rank training runs agree within `tol` (relative): losses, gradient norms, final weights."""
    for x, y in zip(a, b):
        losses = torch.tensor([r["loss"] for r in x["records"]]), torch.tensor([r["loss"] for r in y["records"]])
        assert rel_err(*losses) <= tol, losses
        norms = torch.tensor([r["grad_norm"] for r in x["records"]]), torch.tensor([r["grad_norm"] for r in y["records"]])
        assert rel_err(*norms) <= tol, norms
        # Weights after Adam steps only where bitwise equality is expected: Adam turns rounding noise
        # in gradients that are zero in exact arithmetic (the key bias) into full-size updates.
        for name, p in (x["params"].items() if params else ()):
            assert rel_err(p, y["params"][name]) <= tol, name


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_trains_like_tensor_parallel_alone(tp):
    argv = BASE + ["--tp", str(tp)]
    plain = run_ranks(train_params, tp, args=(argv,))
    sp = run_ranks(train_params, tp, args=(argv + ["--sequence-parallel"],))
    assert_same_runs(sp, plain, 1e-5, params=False)


def sp_gradients(rank, world, seed, sequence_parallel):
    parallel.initialize_model_parallel(world)
    parallel.model_parallel_manual_seed(seed)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100,
                               max_position_embeddings=16, hidden_dropout=0.1, attention_dropout=0.1,
                               sequence_parallel=sequence_parallel)
    model = GPTModel(config, seed=seed).train()
    gen = torch.Generator().manual_seed(seed + 1)
    ids, labels = torch.randint(0, 100, (3, 16), generator=gen), torch.randint(0, 100, (3, 16), generator=gen)
    loss = model(ids, labels=labels)
    loss.sum().backward()
    for p in model.parameters():
        if getattr(p, "sequence_parallel", False):  # partial over the sequence shards
            dist.all_reduce(p.grad, group=parallel.get_tensor_model_parallel_group())
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_gradients_equal_tensor_parallel_alone(tp):
    seed = fresh_seed()
    plain = run_ranks(sp_gradients, tp, args=(seed, False))
    sp = run_ranks(sp_gradients, tp, args=(seed, True))
    for (loss_a, grads_a), (loss_b, grads_b) in zip(sp, plain):
        assert rel_err(loss_a, loss_b) <= 1e-5
        for name, g in grads_a.items():
            assert rel_err(g, grads_b[name]) <= 1e-5, name


def rmsnorm_forward_backward(rank, world, seed):
    return gpt_forward_backward(rank, world, seed, normalization="rmsnorm", sequence_parallel=world > 1)


def test_rmsnorm_gpt_with_sequence_parallelism_matches_single_device():
    """RMSNorm weights are replicated in the sequence-parallel region like LayerNorm's."""
    seed = fresh_seed()
    single = run_ranks(rmsnorm_forward_backward, 1, args=(seed,))[0]
    assert not any(name.endswith("layernorm.bias") for name in single["weights"]), "RMSNorm has no bias"
    for r in run_ranks(rmsnorm_forward_backward, 2, args=(seed,)):
        assert_rel_close(r["logits"], single["logits"], what="logits")
        for name, g in single["grads"].items():
            assert_rel_close(r["grads"][name], g, what=f"grad {name}")


@pytest.mark.parametrize("layernorm_position", ["pre", "post"])
def test_bert_sequence_parallel_and_recompute_equal_plain_tensor_parallel(layernorm_position):
    """Dropout on: SP draws the same masks, recomputation replays them; a parameter marked
    `sequence_parallel` wrongly (or not marked) would leave its gradient doubled (or partial)."""
    seed, dropout = fresh_seed(), dict(hidden_dropout=0.2, attention_dropout=0.2)
    runs = {
        name: run_ranks(bert_forward_backward, 2, args=(seed, layernorm_position, {**dropout, **changes}))
        for name, changes in (("plain", {}), ("sp", {"sequence_parallel": True}),
                              ("sp+recompute", {"sequence_parallel": True, "recompute": "full"}))
    }
    for rank in range(2):
        for name in ("sp", "sp+recompute"):
            assert_same_results(runs[name][rank], runs["plain"][rank], f"{name} {layernorm_position}-LN")
