"""--quick-geglu, --glu-linear-offset, --activation-func-clamp-value (Megatron-LM's flags; gpt-oss's
MLPs): a gated MLP's quick_gelu(min(gate, v)) * (clamp(up, -v, v) + c), Megatron-Core's unfused GLU
written out here, in the dense MLP, the shared expert and the experts; training at tp 2 with SP, pp 2
and ep 2 gives one rank's losses; part of the model's shape; read from Megatron-LM's args and given
back by the planner; refused where it means nothing and for Hugging Face export."""
from __future__ import annotations

import argparse

import pytest
import torch

from helpers import rel_err
from megalite.models.presets import preset
from megalite.testing import run_ranks
from training_ranks import built_model, refusal, train_losses


def _megatron_glu(x: torch.Tensor, clamp, offset) -> torch.Tensor:
    """megatron.core.transformer.mlp's unfused glu on fc1's output x (bias added): first half the gate."""
    x_glu, x_linear = torch.chunk(x.double(), 2, dim=-1)
    if clamp is not None:
        x_glu, x_linear = x_glu.clamp(max=clamp), x_linear.clamp(min=-clamp, max=clamp)
    return x_glu * torch.sigmoid(1.702 * x_glu) * (x_linear + offset)


@pytest.mark.parametrize("clamp, offset", [(None, 0.0), (7.0, 1.0), (0.5, 0.0), (None, -0.25)])
def test_the_dense_mlp_and_the_experts_compute_megatron_cores_glu(clamp, offset):
    from megalite.models.mlp import mlp_layer
    from megalite.models.moe.experts import GroupedMLP

    config = preset("moe-tiny", activation="quick_gelu", glu_linear_offset=offset, activation_func_clamp_value=clamp)
    mlp = mlp_layer(config, None, None, "cpu")
    x = 3 * torch.randn(2, 5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = torch.nn.functional.linear(_megatron_glu(mlp.fc1(x), clamp, offset), mlp.fc2.weight.double())
        assert rel_err(mlp(x), want + mlp.fc2.bias.double() if mlp.fc2.bias is not None else want) <= 1e-6
    experts = GroupedMLP(config, device="cpu")
    counts = [4, 0, 5] + [0] * (config.num_moe_experts - 3)
    rows = x.reshape(-1, config.hidden_size)[:9]
    got = experts(rows, counts)
    with torch.no_grad():
        for e, (lo, hi) in ((0, (0, 4)), (2, (4, 9))):
            h = _megatron_glu(rows[lo:hi] @ experts.fc1_weight[e].T, clamp, offset)
            assert rel_err(got[lo:hi], h @ experts.fc2_weight[e].double().T) <= 1e-6
    if clamp is not None:  # the clamp is what the gradient sees: none flows past it
        big = torch.full((1, 2 * config.ffn_hidden_size), 2 * clamp, requires_grad=True)
        mlp.glu(*big.chunk(2, -1)).sum().backward()
        assert torch.count_nonzero(big.grad) == 0


def test_the_flags_build_it_and_refuse_what_means_nothing():
    config = built_model(["--model", "llama-tiny", "--quick-geglu", "--glu-linear-offset", "1",
                          "--activation-func-clamp-value", "7"])
    assert (config.activation, config.gated_linear_unit, config.glu_linear_offset,
            config.activation_func_clamp_value) == ("quick_gelu", True, 1.0, 7.0)
    assert built_model(["--model", "gpt-tiny", "--quick-geglu"]).gated_linear_unit  # gated whatever the preset
    assert "keep one" in refusal(["--model", "llama-tiny", "--quick-geglu", "--swiglu"], 1)
    assert "--swiglu or --quick-geglu" in refusal(["--model", "gpt-tiny", "--glu-linear-offset", "1"], 1)
    assert "must be > 0" in refusal(["--model", "llama-tiny", "--activation-func-clamp-value", "0"], 1)


RUN = ["--model", "moe-tiny", "--num-layers", "2", "--moe-layer-freq", "[0,1]", "--seq-length", "16", "--global-batch-size", "4",
       "--micro-batch-size", "1", "--log-interval", "1", "--eval-iters", "0", "--train-iters", "3",
       "--moe-shared-expert-intermediate-size", "32", "--quick-geglu", "--glu-linear-offset", "1",
       "--activation-func-clamp-value", "0.5"]


@pytest.mark.slow
def test_training_at_tp2_pp2_and_ep2_gives_one_ranks_losses():
    [want] = run_ranks(train_losses, 1, args=(RUN,))
    for layout in (["--tp", "2", "--sequence-parallel"], ["--pp", "2"], ["--ep", "2"]):
        for got in run_ranks(train_losses, 2, args=(RUN + layout,)):
            assert rel_err(torch.tensor(got), torch.tensor(want)) <= 1e-5, (layout, got, want)
    [unclamped] = run_ranks(train_losses, 1, args=(RUN[:-2],))
    assert unclamped[0] != want[0]


def test_checkpoints_megatron_lms_args_the_planner_and_export():
    from megalite.checkpoint.megatron_dist_map import translate_args
    from megalite.tools.plan.command import model_flags
    from megalite.training.checkpoint_shape import shape_fields

    config = built_model(["--model", "llama-tiny", "--quick-geglu", "--glu-linear-offset", "1",
                          "--activation-func-clamp-value", "7"])
    fields = shape_fields(config)
    assert (fields["quick_geglu"], fields["swiglu"], fields["glu_linear_offset"],
            fields["activation_func_clamp_value"]) == (True, False, 1.0, 7.0)
    for name in ("llama-tiny", "gpt-tiny"):
        again = built_model(model_flags(config, name) + ["--mock-data"])
        assert (again.activation, again.gated_linear_unit, again.glu_linear_offset,
                again.activation_func_clamp_value) == ("quick_gelu", True, 1.0, 7.0), name
    args = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                              vocab_size=128, max_position_embeddings=32, seq_length=32, quick_geglu=True,
                              glu_linear_offset=1.0, activation_func_clamp_value=7.0, add_bias_linear=True,
                              bias_gelu_fusion=True)
    flags = translate_args(args, "ckpt").flags
    assert "--openai-gelu" not in flags
    rebuilt = built_model(flags + ["--mock-data"])
    assert (rebuilt.activation, rebuilt.glu_linear_offset, rebuilt.activation_func_clamp_value) == (
        "quick_gelu", 1.0, 7.0)
    pytest.importorskip("transformers")
    from megalite.models import GPTModel
    from megalite.tools.convert_hf import ConversionError, to_hf

    model = GPTModel(config.replace(glu_linear_offset=0.0, activation_func_clamp_value=None), seed=1, device="cpu")
    with pytest.raises(ConversionError, match="quick-GeGLU"):
        to_hf(model.config, model.state_dict())
