"""--rotary-interleaved (Megatron-LM's flag): rope rotates neighbouring dims (2i, 2i + 1) at frequency i.
Checked against Megatron-Core's formula bit for bit, as the same model as rotate-half rope with its
query and key rows permuted, at tp 2 with SP and at cp 2 against one rank, through Hugging Face export
(logits of LlamaForCausalLM), as a checkpoint's shape, from a Megatron-LM checkpoint's args, and in
the refusals beside MLA and learned positions."""
from __future__ import annotations

import argparse

import pytest
import torch

from helpers import rel_err
from megalite.testing import run_ranks
from training_ranks import parse, built_model as _built

RUN = ["--model", "llama-tiny", "--num-layers", "2", "--seq-length", "16", "--global-batch-size", "4",
       "--micro-batch-size", "1", "--log-interval", "1", "--eval-iters", "0", "--train-iters", "3",
       "--rotary-interleaved"]


def _megatron_interleaved(x: torch.Tensor, base: float, dims: int) -> torch.Tensor:
    """Megatron-Core's interleaved rope, written from its formula: channel pair (2i, 2i + 1) turns by
    position * base^(-2i / dims); rotate-half pairs (-x_odd, x_even) in place."""
    inv_freq = 1.0 / base ** (torch.arange(0, dims, 2, dtype=torch.float32) / dims)
    angles = torch.arange(x.shape[0], dtype=torch.float32)[:, None] * inv_freq
    emb = torch.stack([angles, angles], dim=-1).flatten(-2)[:, None, None, :]
    t = x[..., :dims]
    rotated = torch.stack([-t[..., 1::2], t[..., 0::2]], dim=-1).flatten(-2)
    return torch.cat([t * emb.cos() + rotated * emb.sin(), x[..., dims:]], dim=-1)


@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_the_rotation_is_megatron_cores_interleaved_rope_bit_for_bit(percent):
    from megalite.models.presets import preset
    from megalite.models.rope import RotaryEmbedding

    config = preset("llama-tiny", rotary_interleaved=True, rotary_percent=percent)
    x = torch.randn(12, 2, 3, config.head_dim, generator=torch.Generator().manual_seed(0))
    got = RotaryEmbedding(config)(x)
    assert torch.equal(got, _megatron_interleaved(x, config.rotary_base, config.rotary_dims))
    assert not torch.equal(got, RotaryEmbedding(config.replace(rotary_interleaved=False))(x))


@pytest.mark.parametrize("groups", [None, 2])  # fused qkv rows, and separate q and kv rows
@pytest.mark.parametrize("qk_norm", [None, "per-head", "full-width"])
def test_it_is_rotate_half_rope_with_the_query_and_key_rows_permuted(groups, qk_norm):
    from megalite.models import GPTModel
    from megalite.models.presets import preset
    from megalite.tools.convert_hf.rotary_rows import interleaved_to_rotate_half

    config = preset("llama-tiny", num_layers=2, num_query_groups=groups, qk_layernorm=qk_norm is not None,
                    qk_layernorm_full_width=qk_norm == "full-width", rotary_interleaved=True, add_qkv_bias=True)
    interleaved = GPTModel(config, seed=3, device="cpu").eval()
    with torch.no_grad():
        for name, p in interleaved.named_parameters():
            if "norm" in name or name.endswith("bias"):  # make the norms' and biases' rows tell apart
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    halves = GPTModel(config.replace(rotary_interleaved=False), seed=4, device="cpu").eval()
    halves.load_state_dict(interleaved_to_rotate_half(interleaved.state_dict(), config))
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = interleaved(ids), halves(ids)
    assert rel_err(got, want) <= 1e-6
    unpermuted = GPTModel(config.replace(rotary_interleaved=False), seed=4, device="cpu").eval()
    unpermuted.load_state_dict(interleaved.state_dict())
    with torch.no_grad():
        assert rel_err(unpermuted(ids), want) > 1e-3


def test_hugging_face_export_computes_the_same_logits():
    transformers = pytest.importorskip("transformers")
    from megalite.models import GPTModel
    from megalite.tools.convert_hf import to_hf

    config = _built(RUN)
    assert config.rotary_interleaved
    model = GPTModel(config, seed=5, device="cpu").eval()
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    hf = to_hf(config, model.state_dict())
    assert isinstance(hf, transformers.LlamaForCausalLM)
    with torch.no_grad():
        ours = model(ids)[..., :config.vocab_size]
        assert rel_err(hf(ids).logits, ours) <= 1e-5


def losses(rank, world, argv):
    import pretrain_gpt
    from megalite.training import pretrain

    return [r["loss"] for r in pretrain(parse(argv), pretrain_gpt.task()).records]


def test_training_at_tp2_with_sp_and_at_cp2_gives_one_ranks_losses():
    [want] = run_ranks(losses, 1, args=(RUN,))
    for layout in (["--tp", "2", "--sequence-parallel"], ["--cp", "2"]):
        for got in run_ranks(losses, 2, args=(RUN + layout,)):
            assert rel_err(torch.tensor(got), torch.tensor(want)) <= 1e-5, (layout, got, want)
    [halves] = run_ranks(losses, 1, args=(RUN[:-1],))
    assert halves[0] != want[0]


def test_a_checkpoint_keeps_the_layout_and_a_megatron_checkpoints_args_give_it():
    from megalite.checkpoint.megatron_dist_map import translate_args
    from megalite.training.checkpoint_shape import shape_fields

    assert shape_fields(_built(RUN))["rotary_interleaved"] is True
    args = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                              vocab_size=128, max_position_embeddings=32, seq_length=32, rotary_interleaved=True,
                              position_embedding_type="rope", add_bias_linear=False, swiglu=True)
    flags = translate_args(args, "ckpt").flags
    assert "--rotary-interleaved" in flags and _built(flags + ["--mock-data"]).rotary_interleaved
    args.position_embedding_type = "learned_absolute"  # Megatron-LM reads the flag with rope alone
    assert "--rotary-interleaved" not in translate_args(args, "ckpt").flags


def test_a_checkpoint_of_the_interleaved_layout_resumes_in_it(tmp_path):
    save = ["--save", str(tmp_path / "ck"), "--save-interval", "2"]
    run_ranks(losses, 1, args=(RUN[:-2] + ["2", "--rotary-interleaved"] + save,))
    shapeless = ["--seq-length", "16", "--global-batch-size", "4", "--micro-batch-size", "1", "--log-interval", "1",
                 "--eval-iters", "0", "--train-iters", "3", "--load", str(tmp_path / "ck")]
    [resumed] = run_ranks(losses, 1, args=(shapeless,))
    [straight] = run_ranks(losses, 1, args=(RUN,))
    assert resumed == straight[2:]


def test_it_is_refused_beside_mla_and_without_rope():
    from megalite.errors import UsageError

    with pytest.raises(UsageError, match="--rotary-interleaved does not apply to --multi-latent-attention"):
        _built(["--model", "deepseek-tiny", "--rotary-interleaved"])
    with pytest.raises(UsageError, match="--rotary-interleaved lays out rope's pairs"):
        _built(["--model", "gpt-tiny", "--rotary-interleaved"])
