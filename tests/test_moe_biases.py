"""Experts and routers with biases: what add_bias_linear (Megatron-LM's default) gives a MoE model, as
Megatron-Core builds it (gpt-oss): each expert's fc1 and fc2 biases, zero at init, fc2's inside the
router's weight, p (fc2(h) + b); the router's bias on its fp32 logits, drawn like its weight. Checked by
hand on one layer, the chunked dispatch included; training at ep 2, tp 2 with SP and ETP 1, pp 2 x ep 2
and ZeRO-3 gives one rank's losses; ETP 2 is refused as in Megatron-Core; checkpoints resume, and
Megatron-LM's args and dist-checkpoint keys read."""
from __future__ import annotations

import argparse

import pytest
import torch

from helpers import rel_err
from megalite.models import TransformerConfig
from megalite.testing import run_ranks
from training_ranks import built_model, refusal, train_losses


def _config(**extra) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                             moe_router_topk=2, moe_ffn_hidden_size=8, gated_linear_unit=True, activation="silu",
                             **extra)


def test_each_expert_adds_its_biases_and_the_router_its_own():
    from megalite.models.moe import MoELayer

    layer = MoELayer(_config(), device="cpu")
    experts, router = layer.experts, layer.router
    assert experts.fc1_bias.shape == (4, 16) and experts.fc2_bias.shape == (4, 16) and router.bias.shape == (4,)
    assert not experts.fc1_bias.any() and router.bias.std() > 0  # zero at init, as Megatron-Core's; drawn
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in (experts.fc1_bias, experts.fc2_bias, router.bias):
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(6, 1, 16, generator=g)
    with torch.no_grad():
        got = layer(x)
        tokens = x.reshape(-1, 16).double()
        logits = tokens @ router.weight.double().T + router.bias.double()
        top, index = logits.topk(2, dim=-1)
        weights = top.softmax(-1)
        want = torch.zeros_like(tokens)
        for t in range(6):
            for w, e in zip(weights[t], index[t]):
                h = tokens[t] @ experts.fc1_weight[e].double().T + experts.fc1_bias[e].double()
                gate, up = h.chunk(2)
                y = (torch.nn.functional.silu(gate) * up) @ experts.fc2_weight[e].double().T
                want[t] += w * (y + experts.fc2_bias[e].double())
        if layer.shared_experts is not None:
            want += layer.shared_experts(x).reshape(-1, 16).double()
    assert rel_err(got.reshape(-1, 16), want) <= 1e-6
    rows, counts = torch.randn(7, 16, generator=g), [3, 0, 4, 0]  # two groups of two experts: their biases
    shared = experts.shared_gradients(2)
    apart = torch.cat([experts(rows[:3], counts[:2], (0, 2, shared)), experts(rows[3:], counts[2:], (2, 4, shared))])
    assert torch.equal(apart, experts(rows, counts))


def test_without_biases_there_are_none_and_etp2_is_refused():
    from megalite.models.moe import MoELayer

    bare = MoELayer(_config(add_bias_linear=False), device="cpu")
    assert bare.experts.fc1_bias is None and bare.router.bias is None
    assert not [n for n, _ in bare.named_parameters() if "bias" in n]
    assert "run at --etp 1, as Megatron-Core's: --etp 2 (--etp defaults to --tp); add --etp 1" in refusal(
        RUN + ["--tp", "2", "--sequence-parallel"], 2)


def _decay_step(rank, world):
    from megalite import parallel
    from megalite.models.moe import MoELayer
    from megalite.optim import MegaliteOptimizer, ParamAndGradBuffer

    parallel.initialize_model_parallel(1)
    layer = MoELayer(_config(), device="cpu")
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(1.0)  # off zero: decay would move every one
    buf = ParamAndGradBuffer(list(layer.parameters()), param_dtype=torch.float32, grad_dtype=torch.float32,
                             bucket_numel=10 ** 9, dp_group=None, dp_size=1, reduce_scatter=False)
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    MegaliteOptimizer([buf], lr=0.1, weight_decay=0.5).step(lr=0.1, clip_grad=0)  # zero gradients: decay alone
    return {n: torch.equal(p.detach(), before[n]) for n, p in layer.named_parameters()}


def test_biases_are_not_decayed_the_weights_are():
    """Megatron-Core decays no bias: each expert's is 1-D there ([experts, width] here, marked)."""
    unchanged = run_ranks(_decay_step, 1)[0]
    assert unchanged == {n: "bias" in n for n in unchanged}, unchanged
    assert {"router.bias", "experts.fc1_bias", "experts.fc2_bias"} <= set(unchanged)


RUN = ["--model", "gpt-tiny", "--num-layers", "2", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "[0,1]", "--seq-length", "16",
       "--global-batch-size", "4", "--micro-batch-size", "1", "--log-interval", "1", "--eval-iters", "0",
       "--train-iters", "3"]  # gpt-tiny's biases: Megatron-LM's default


@pytest.mark.slow
def test_training_at_ep2_tp2_etp1_pp2_ep2_and_zero3_gives_one_ranks_losses():
    [want] = run_ranks(train_losses, 1, args=(RUN,))
    for world, layout in ((2, ["--ep", "2"]), (2, ["--tp", "2", "--sequence-parallel", "--etp", "1"]),
                          (2, ["--ep", "2", "--moe-dispatch-chunks", "2", "--delay-wgrad-compute"]),
                          (2, ["--ep", "2", "--overlap-moe-expert-parallel-comm"]),
                          (2, ["--pp", "2", "--pipeline-schedule", "zb-h1", "--zero-stage", "2",
                               "--use-distributed-optimizer"]),
                          (2, ["--use-distributed-optimizer", "--zero-stage", "3"]), (4, ["--pp", "2", "--ep", "2"])):
        got = run_ranks(train_losses, world, args=(RUN + layout,))[-1]  # the last stage logs
        assert rel_err(torch.tensor(got), torch.tensor(want)) <= 1e-5, (layout, got, want)
    [bare] = run_ranks(train_losses, 1, args=(RUN + ["--disable-bias-linear"],))
    assert bare[0] != want[0]


def test_checkpoints_and_megatron_lms_args_and_keys(tmp_path):
    from megalite.checkpoint.megatron_dist_map import EXPERT_KEYS, LAYER_KEYS, expected_names, translate_args

    args = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                              vocab_size=128, max_position_embeddings=32, seq_length=32, swiglu=True,
                              position_embedding_type="rope", add_bias_linear=True, num_experts=4,
                              moe_router_topk=2, moe_ffn_hidden_size=32)
    config = built_model(translate_args(args, "ckpt").flags + ["--mock-data"])
    assert config.add_bias_linear and config.is_moe
    names = expected_names(config)
    assert {"layers.0.mlp.router.bias", "layers.1.mlp.experts.3.fc1_bias", "layers.1.mlp.experts.0.fc2_bias"} <= set(names)
    assert LAYER_KEYS["mlp.router.bias"] == ("mlp.router.bias",)
    assert EXPERT_KEYS["fc2_bias"][1] == "mlp.experts.linear_fc2.bias{e}"  # TEGroupedMLP's, one a expert
    save = RUN[:-2] + ["--train-iters", "2", "--save", str(tmp_path / "ck"), "--save-interval", "2"]
    run_ranks(train_losses, 1, args=(save,))
    resumed = run_ranks(train_losses, 2, args=(RUN + ["--ep", "2", "--load", str(tmp_path / "ck")],))[0]
    [straight] = run_ranks(train_losses, 1, args=(RUN,))
    assert rel_err(torch.tensor(resumed), torch.tensor(straight[2:])) <= 1e-5
