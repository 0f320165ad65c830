"""GPTModel at TP = 2 and 4 equals TP = 1 from the same seed: the same full weights, logits,
per-token loss and gradients (fp32, <= 1e-5 relative)."""
import pytest
import torch
import torch.distributed as dist

from helpers import assert_same_model_run, fresh_seed, gpt_forward_backward_record
from megalite import parallel
from megalite.models import GPTModel, TransformerConfig
from megalite.testing import run_ranks

VOCAB = 100  # padded to 128 * tp, differently for each TP size


def tiny_config(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
    return TransformerConfig(**{**base, **kw})


def gpt_forward_backward(rank, world, seed, **config):
    parallel.initialize_model_parallel(world)
    parallel.model_parallel_manual_seed(seed)
    return gpt_forward_backward_record(GPTModel(tiny_config(**config), seed=seed), world, seed, VOCAB)


@pytest.fixture(scope="module")
def seed():
    return fresh_seed()


@pytest.fixture(scope="module")
def reference(seed):
    return run_ranks(gpt_forward_backward, 1, args=(seed,))[0]


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_tensor_parallel_matches_single_device(tp, seed, reference):
    for r in run_ranks(gpt_forward_backward, tp, args=(seed,)):
        assert_same_model_run(r, reference, f"tp={tp}")


def rng_streams(rank, world, seed):
    parallel.initialize_model_parallel(world)
    parallel.model_parallel_manual_seed(seed)
    with parallel.get_rng_tracker().fork():
        inside = torch.rand(8)
    outside = torch.rand(8)
    # With dropout on, the residual stream (replicated across TP) stays identical on every rank.
    model = GPTModel(tiny_config(hidden_dropout=0.5, attention_dropout=0.5), seed=seed)
    model.train()
    seen = {}
    model.final_layernorm.register_forward_hook(lambda m, i, o: seen.setdefault("h", o.detach()))
    model(torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed)))
    return inside, outside, seen["h"]


def test_dropout_differs_inside_tp_region_and_agrees_outside():
    inside, outside, hidden = zip(*run_ranks(rng_streams, 2, args=(fresh_seed(),)))
    assert not torch.equal(inside[0], inside[1]), "TP ranks must draw different dropout in the TP region"
    assert torch.equal(outside[0], outside[1]), "TP ranks must draw the same dropout on replicated data"
    assert torch.equal(hidden[0], hidden[1]), "replicated activations diverged across TP ranks"


def bad_heads(rank, world):
    parallel.initialize_model_parallel(world)
    GPTModel(tiny_config(num_attention_heads=2, hidden_size=32))


def test_heads_not_divisible_by_tp_is_a_clear_error():
    with pytest.raises(Exception, match=r"num_attention_heads \(2\) is not divisible by the tensor-parallel size \(4\)"):
        run_ranks(bad_heads, 4)


def test_world_not_divisible_by_tp_names_both_numbers():
    with pytest.raises(Exception, match=r"tensor_model_parallel_size \(3\) does not divide the world size \(4\)"):
        run_ranks(_init_tp3, 4)


def _init_tp3(rank, world):
    parallel.initialize_model_parallel(3)


def group_layout(rank, world):
    parallel.initialize_model_parallel(2, 2)
    return {
        "tp": dist.get_process_group_ranks(parallel.get_tensor_model_parallel_group()),
        "dp": dist.get_process_group_ranks(parallel.get_data_parallel_group()),
        "pp": dist.get_process_group_ranks(parallel.get_pipeline_model_parallel_group()),
        "emb": parallel.get_pipeline_model_parallel_ranks(),
        "first": parallel.is_pipeline_first_stage(), "last": parallel.is_pipeline_last_stage(),
    }


def test_rank_order_tensor_fastest_then_data_then_pipeline():
    out = run_ranks(group_layout, 8)  # tp=2, pp=2, dp=2
    for rank, g in enumerate(out):
        pp_rank, dp_rank, tp_rank = rank // 4, (rank // 2) % 2, rank % 2
        assert g["tp"] == [pp_rank * 4 + dp_rank * 2 + t for t in range(2)]
        assert g["dp"] == [pp_rank * 4 + d * 2 + tp_rank for d in range(2)]
        assert g["pp"] == [p * 4 + dp_rank * 2 + tp_rank for p in range(2)]
        assert (g["first"], g["last"]) == (pp_rank == 0, pp_rank == 1)


def zero_centred_records(rank, world, seed, normalization):
    """The same model with plain and zero-centred (1 + w) norm weights, at this TP size."""
    parallel.initialize_model_parallel(world)
    out = []
    for centred in (False, True):
        parallel.model_parallel_manual_seed(seed)
        config = tiny_config(normalization=normalization, qk_layernorm=True, layernorm_zero_centered_gamma=centred)
        out.append(gpt_forward_backward_record(GPTModel(config, seed=seed), world, seed, VOCAB))
    return out


@pytest.mark.parametrize("normalization", ["layernorm", "rmsnorm"])
def test_zero_centred_norm_weights_compute_the_plain_model_at_every_tp(normalization):
    """--apply-layernorm-1p: norm weights start at 0 and scale by 1 + w, so the model computes what
    the plain one (weights 1) does, with the same gradients, at TP 1 and 2."""
    seed = fresh_seed()
    for world in (1, 2):
        for plain, centred in run_ranks(zero_centred_records, world, args=(seed, normalization)):
            norms = [n for n in plain["weights"] if "norm" in n and n.endswith("weight")]
            assert len(norms) >= 5  # input, post-attention, q and k of each layer, final
            for name, w in plain["weights"].items():
                want = w - 1 if name in norms else w
                assert torch.equal(centred["weights"][name], want), name
            centred["weights"] = plain["weights"]  # compared above, as 1 + w
            assert_same_model_run(centred, plain, f"zero-centred {normalization} at tp={world}")
