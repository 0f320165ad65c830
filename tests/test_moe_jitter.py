"""--moe-input-jitter-eps (Megatron-LM's flag; the Switch Transformer's router jitter): while training the
router's input, not the experts', times noise U(1 - eps, 1 + eps) in its dtype; drawn as hidden dropout's
mask, so tp 2 with SP trains as one rank and full recomputation draws it again alike; nothing in
evaluation; read from Megatron-LM's args and given back by the planner."""
from __future__ import annotations

import argparse

import torch

from helpers import rel_err
from megalite.models import TransformerConfig
from megalite.testing import run_ranks
from training_ranks import built_model, refusal, train_losses


def _layer(eps):
    from megalite.models.moe import MoELayer

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                               moe_router_topk=2, moe_ffn_hidden_size=8, add_bias_linear=False,
                               moe_input_jitter_eps=eps)
    return MoELayer(config, device="cpu")


def test_the_router_reads_its_input_times_the_noise_and_the_experts_read_it_plain():
    layer = _layer(0.3)
    x = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(0))
    seen = {}
    real_router, real_dispatch = layer.router.forward, layer.dispatcher.__call__

    def router(tokens):
        seen["router"] = tokens.clone()
        return real_router(tokens)

    def dispatcher(tokens, *args, **kwargs):
        seen["experts"] = tokens.clone()
        return real_dispatch(tokens, *args, **kwargs)
    layer.router.forward, layer.dispatcher = router, dispatcher
    torch.manual_seed(3)
    layer.train()(x)
    torch.manual_seed(3)
    noise = torch.empty_like(x).uniform_(0.7, 1.3)
    assert torch.equal(seen["router"], (x * noise).view(-1, 16))
    assert torch.equal(seen["experts"], x.view(-1, 16))
    assert not torch.equal(seen["router"], seen["experts"]) and 0.7 <= noise.min() and noise.max() <= 1.3
    layer.eval()(x)
    assert torch.equal(seen["router"], x.view(-1, 16))  # evaluation: no noise


RUN = ["--model", "moe-tiny", "--num-layers", "2", "--moe-layer-freq", "[0,1]", "--seq-length", "16",
       "--global-batch-size", "4", "--micro-batch-size", "1", "--log-interval", "1", "--eval-iters", "0",
       "--train-iters", "3", "--moe-input-jitter-eps", "0.5"]


def test_tp2_with_sp_and_full_recomputation_jitter_as_one_rank():
    [want] = run_ranks(train_losses, 1, args=(RUN,))
    [again] = run_ranks(train_losses, 1, args=(RUN + ["--recompute", "full"],))
    assert rel_err(torch.tensor(again), torch.tensor(want)) <= 1e-6
    for got in run_ranks(train_losses, 2, args=(RUN + ["--tp", "2", "--sequence-parallel"],)):
        assert rel_err(torch.tensor(got), torch.tensor(want)) <= 1e-5, (got, want)
    [plain] = run_ranks(train_losses, 1, args=(RUN[:-2],))
    assert plain[1] != want[1]


def test_flags_megatron_lms_args_and_the_planner():
    from megalite.checkpoint.megatron_dist_map import translate_args
    from megalite.tools.plan.command import model_flags

    config = built_model(RUN)
    assert config.moe_input_jitter_eps == 0.5
    assert built_model(model_flags(config, "moe-tiny") + ["--mock-data"]).moe_input_jitter_eps == 0.5
    args = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                              vocab_size=128, max_position_embeddings=32, seq_length=32, swiglu=True,
                              add_bias_linear=False, num_experts=4, moe_router_topk=2, moe_input_jitter_eps=0.01)
    assert built_model(translate_args(args, "ckpt").flags + ["--mock-data"]).moe_input_jitter_eps == 0.01
    assert "in [0, 1)" in refusal(RUN[:-1] + ["1.5"], 1)
