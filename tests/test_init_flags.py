"""--init-method-xavier-uniform and --embedding-init-method-std (Megatron-LM's flags): which tables and
matrices each draws, with which bounds or std; the draws are of the full matrix, so training at tp 2
gives one rank's numbers; the untouched weights stay bit for bit those of a run without the flags."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import rel_err
from megalite.testing import run_ranks
from training_ranks import parse, built_model as _built

RUN = ["--num-layers", "2", "--seq-length", "16", "--global-batch-size", "4", "--micro-batch-size", "1",
       "--log-interval", "1", "--eval-iters", "0", "--train-iters", "3"]


def _weights(argv, seed=7):
    from megalite.models import BERTModel, GPTModel

    config = _built(argv)
    model = (BERTModel if "bert" in " ".join(argv) else GPTModel)(config, seed=seed, device="cpu")
    return config, {name: p.detach() for name, p in model.named_parameters()}


def _is_xavier(w: torch.Tensor, fan_out: int | None = None, rows: int | None = None) -> bool:
    """w (its first `rows` rows) within +-a of Xavier-uniform's a and reaching near it, and (given values
    enough to tell) spread like U(-a, a): std a / sqrt(3)."""
    w = w[:rows] if rows is not None else w
    bound = math.sqrt(6.0 / (w.shape[-1] + (fan_out or w.shape[-2])))
    spread = w.std().item() / (bound / math.sqrt(3.0))
    return 0.95 * bound < w.abs().max().item() <= bound and (w.numel() < 1000 or 0.9 < spread < 1.1)


def test_xavier_draws_every_matrix_of_a_gpt_and_its_tables_with_their_full_fans():
    config, w = _weights(["--model", "llama-tiny", "--init-method-xavier-uniform", "--untie-embeddings-and-output-weights"])
    assert config.init_method_xavier_uniform
    d = config.head_dim
    fused_qkv = (config.num_attention_heads + 2 * config.num_query_groups) * d  # Megatron-LM's one linear_qkv
    for name, t in w.items():
        if name.endswith(("attention.q.weight", "attention.kv.weight")):
            assert _is_xavier(t, fan_out=fused_qkv), name
        elif name in ("word_embeddings.weight", "output_layer.weight"):
            assert _is_xavier(t, rows=config.vocab_size), name
        elif t.dim() == 2:
            assert _is_xavier(t), name
        else:  # norms stay ones
            assert torch.equal(t, torch.ones_like(t)), name


def test_xavier_draws_each_expert_by_its_own_fans_and_the_router():
    config, w = _weights(["--model", "moe-tiny", "--init-method-xavier-uniform"])
    fc1, fc2 = w["layers.1.mlp.experts.fc1_weight"], w["layers.1.mlp.experts.fc2_weight"]
    assert fc1.dim() == 3 and all(_is_xavier(e) for e in fc1) and all(_is_xavier(e) for e in fc2)
    assert _is_xavier(w["layers.1.mlp.router.weight"])


def test_a_bert_draws_its_heads_xavier_and_its_token_types_as_embeddings():
    _, w = _weights(["--model", "bert-tiny", "--init-method-xavier-uniform", "--embedding-init-method-std", "0.5"])
    for name in ("lm_dense.weight", "pooler.weight", "binary_head.weight", "layers.0.attention.qkv.weight"):
        assert _is_xavier(w[name]), name
    for name in ("tokentype_embeddings.weight", "position_embeddings.weight"):
        assert w[name].std().item() == pytest.approx(0.5, rel=0.15), name


def test_the_embedding_std_draws_the_tables_alone():
    base = ["--model", "gpt-tiny", "--untie-embeddings-and-output-weights"]
    _, plain = _weights(base)
    _, wide = _weights(base + ["--embedding-init-method-std", "1.0"])
    for name in ("word_embeddings.weight", "position_embeddings.weight"):
        assert wide[name][:1000].std().item() == pytest.approx(1.0, rel=0.05), name
        assert torch.equal(wide[name], plain[name] * 50.0) or rel_err(wide[name], plain[name] * 50.0) < 1e-6
    for name in set(plain) - {"word_embeddings.weight", "position_embeddings.weight"}:
        assert torch.equal(wide[name], plain[name]), name  # the untied output layer keeps --init-method-std
    assert plain["output_layer.weight"][:1000].std().item() == pytest.approx(0.02, rel=0.05)


def test_under_xavier_an_embedding_std_equal_to_init_method_std_keeps_the_tables_xavier():
    # Megatron-Core: a std that differs from --init-method-std draws N(0, std); an equal one keeps init_method.
    xavier = ["--model", "gpt-tiny", "--init-method-xavier-uniform"]
    _, same = _weights(xavier + ["--embedding-init-method-std", "0.02"])
    assert _is_xavier(same["word_embeddings.weight"], rows=_built(xavier).vocab_size)
    _, other = _weights(xavier + ["--embedding-init-method-std", "0.05"])
    assert other["word_embeddings.weight"][:1000].std().item() == pytest.approx(0.05, rel=0.05)


def losses(rank, world, argv):
    import pretrain_gpt
    from megalite.training import pretrain

    return [r["loss"] for r in pretrain(parse(argv), pretrain_gpt.task()).records]


def test_training_with_both_flags_at_tp2_gives_one_ranks_losses():
    argv = RUN + ["--model", "llama-tiny", "--init-method-xavier-uniform", "--embedding-init-method-std", "0.5"]
    [want] = run_ranks(losses, 1, args=(argv,))
    for got in run_ranks(losses, 2, args=(argv + ["--tp", "2", "--sequence-parallel"],)):
        assert rel_err(torch.tensor(got), torch.tensor(want)) <= 1e-5, (got, want)
    [normal] = run_ranks(losses, 1, args=(RUN + ["--model", "llama-tiny"],))
    assert normal[0] != want[0]


def test_a_non_positive_embedding_std_is_refused_in_one_line():
    from megalite.errors import UsageError

    with pytest.raises(UsageError, match="--embedding-init-method-std"):
        _built(["--embedding-init-method-std", "0"])
