"""--squared-relu (Megatron-LM's flag, Nemotron's MLP): fc2(relu(fc1 x)^2), at every layout the
numbers of one rank; part of the model's shape; read from a Megatron-LM checkpoint's args; refused
beside --swiglu and for Hugging Face export."""
from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from helpers import rel_err
from megalite.testing import run_ranks
from training_ranks import parse, built_model as _built

RUN = ["--num-layers", "2", "--seq-length", "16", "--global-batch-size", "4", "--micro-batch-size", "1",
       "--log-interval", "1", "--eval-iters", "0", "--train-iters", "3", "--squared-relu"]


def test_the_mlp_computes_relu_squared():
    from megalite.models.mlp import activation_function
    from megalite.models.presets import preset

    config = preset("gpt-tiny", activation="squared_relu")
    x = torch.randn(64)
    assert torch.equal(activation_function(config)(x), torch.pow(F.relu(x), 2))
    assert parse(RUN).model.squared_relu and _built(RUN).activation == "squared_relu"


def test_with_swiglu_it_is_refused_in_one_line():
    from megalite.errors import UsageError

    with pytest.raises(UsageError, match="--squared-relu and --swiglu each choose the MLP's activation: keep one"):
        _built(RUN + ["--swiglu"])


def losses(rank, world, argv):
    import pretrain_gpt
    from megalite.training import pretrain

    return [r["loss"] for r in pretrain(parse(argv), pretrain_gpt.task()).records]


def test_training_at_tp2_gives_one_ranks_losses_and_differs_from_gelu():
    [want] = run_ranks(losses, 1, args=(RUN,))
    for got in run_ranks(losses, 2, args=(RUN + ["--tp", "2", "--sequence-parallel"],)):
        assert rel_err(torch.tensor(got), torch.tensor(want)) <= 1e-5, (got, want)
    [gelu] = run_ranks(losses, 1, args=(RUN[:-1],))
    assert gelu[0] != want[0]


def test_a_megatron_checkpoints_squared_relu_is_read_and_export_is_refused():
    from megalite.checkpoint.megatron_dist_map import translate_args
    from megalite.models import GPTModel
    from megalite.tools.convert_hf import ConversionError, to_hf

    args = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                              vocab_size=128, max_position_embeddings=32, seq_length=32, squared_relu=True,
                              add_bias_linear=True, bias_gelu_fusion=True)
    flags = translate_args(args, "ckpt").flags
    assert "--squared-relu" in flags and "--openai-gelu" not in flags
    assert _built(flags + ["--mock-data"]).activation == "squared_relu"
    config = _built(RUN)
    with pytest.raises(ConversionError, match="squared-ReLU"):
        to_hf(config, GPTModel(config, seed=1, device="cpu").state_dict())
