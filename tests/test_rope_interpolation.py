"""--rotary-seq-len-interpolation-factor (Megatron-LM's flag; linear position interpolation, arXiv
2306.15595): rope's positions times 1 / factor. Checked against Megatron-Core's formula bit for bit in
every table megalite makes (the sequence's, context-parallel shares, per-token positions), against
Hugging Face's "linear" rope through import and export, from a Megatron-LM checkpoint's args, on resume
(a retunable setting, said in one line), and in the refusals beside YaRN and MLA."""
from __future__ import annotations

import argparse

import pytest
import torch

from helpers import rel_err
from training_ranks import parse, built_model as _built

FACTOR = 4


def _megatron_angles(positions: int, inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Megatron-Core's RotaryEmbedding.get_freqs_non_repeated, written from its formula: fp32
    positions, multiplied in place by 1 / factor, outer the inverse frequencies."""
    seq = torch.arange(positions, dtype=torch.float32)
    seq *= 1 / factor
    return torch.outer(seq, inv_freq)


@pytest.mark.parametrize("factor", [FACTOR, 2.5])
def test_every_table_is_megatron_cores_bit_for_bit(factor):
    from megalite.models.presets import preset
    from megalite.models.rope import RotaryEmbedding, inverse_frequencies
    from megalite.parallel.context_parallel import context_parallel_positions

    config = preset("llama-tiny", rotary_seq_len_interpolation_factor=factor)
    rotary = RotaryEmbedding(config)
    angles = _megatron_angles(32, inverse_frequencies(config), factor)
    cos, sin = rotary.cos_sin(32, "cpu")
    half = config.rotary_dims // 2
    assert torch.equal(cos[:, 0, 0, :half], angles.cos()) and torch.equal(sin[:, 0, 0, half:], angles.sin())
    share = context_parallel_positions(32, 1, 2)  # a CP rank's rows are the same rows of the whole table
    cp_cos, _ = rotary.cos_sin(16, "cpu", 1, 2)
    assert torch.equal(cp_cos[:, 0, 0], cos[share, 0, 0])
    # per-token positions (packed documents, generation): [b, s] of any positions, the same rows again
    positions = torch.tensor([[0, 1, 2, 3], [7, 8, 30, 31]])
    at_cos, at_sin = rotary.cos_sin_at(positions)
    assert torch.equal(at_cos[:, 1, 0], cos[positions[1], 0, 0]) and torch.equal(at_sin[:, 0, 0], sin[:4, 0, 0])
    plain_cos, _ = RotaryEmbedding(config.replace(rotary_seq_len_interpolation_factor=None)).cos_sin(32, "cpu")
    assert not torch.equal(plain_cos, cos)
    if factor == FACTOR:  # position 4k interpolated is position k: k * 4 * 0.25 is exact
        assert torch.equal(cos[::FACTOR], plain_cos[:32 // FACTOR])


def test_the_flag_sets_it_and_plain_rope_alone_takes_it():
    from megalite.errors import UsageError

    assert _built(["--model", "llama-tiny", "--rotary-seq-len-interpolation-factor", "4"]
                  ).rotary_seq_len_interpolation_factor == 4
    assert _built(["--model", "llama-tiny"]).rotary_seq_len_interpolation_factor is None
    with pytest.raises(UsageError, match="YaRN and --multi-latent-attention do not use it"):
        _built(["--model", "deepseek-tiny", "--rotary-seq-len-interpolation-factor", "2"])
    with pytest.raises(UsageError, match="YaRN and --multi-latent-attention do not use it"):
        _built(["--model", "llama-tiny", "--yarn-factor", "4", "--rotary-seq-len-interpolation-factor", "2"])
    with pytest.raises(UsageError, match="rotary-seq-len-interpolation-factor"):
        _built(["--model", "llama-tiny", "--rotary-seq-len-interpolation-factor", "0"])


def test_hugging_face_linear_rope_imports_and_exports_with_the_same_logits():
    tf = pytest.importorskip("transformers")
    from megalite.models import GPTModel
    from megalite.tools.convert_hf import from_hf, to_hf

    hf_config = tf.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=96, vocab_size=128, max_position_embeddings=64,
                               rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
                               tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(hf_config).eval()
    config, state = from_hf(hf)
    assert config.rotary_seq_len_interpolation_factor == 4.0
    model = GPTModel(config, seed=0, device="cpu").eval()
    model.load_state_dict(state)
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1))  # 48 positions: 12 in Meta's
    with torch.no_grad():
        want = hf(ids).logits
        ours = model(ids)[..., :128]
        assert rel_err(ours, want) <= 1e-5
        plain = GPTModel(config.replace(rotary_seq_len_interpolation_factor=None), seed=0, device="cpu").eval()
        plain.load_state_dict(state)
        assert rel_err(plain(ids)[..., :128], want) > 1e-3
        back = to_hf(config, model.state_dict())
        assert back.config.rope_parameters["rope_type"] == "linear"
        assert back.config.rope_parameters["factor"] == 4.0
        assert rel_err(back(ids).logits, want) <= 1e-5


def test_an_export_with_llama3_scaling_as_well_is_refused():
    pytest.importorskip("transformers")
    from megalite.models.presets import preset
    from megalite.tools.convert_hf import llama

    from megalite.tools.convert_hf import moe

    both = preset("llama-tiny", rotary_seq_len_interpolation_factor=2.0, rope_scaling_factor=8.0)
    assert any("no Hugging Face rope_type" in p for p in llama.export_problems(both, llama.LLAMA))
    experts = preset("moe-tiny", rotary_seq_len_interpolation_factor=2.0, rope_scaling_factor=8.0)
    assert any("no Hugging Face rope_type" in p for p in moe.export_problems(experts, moe.MIXTRAL))


def test_a_megatron_checkpoints_args_and_a_checkpoints_shape_carry_it():
    from megalite.checkpoint.megatron_dist_map import translate_args
    from megalite.training.checkpoint_shape import shape_fields

    config = _built(["--model", "llama-tiny", "--rotary-seq-len-interpolation-factor", "4"])
    assert shape_fields(config)["rotary_seq_len_interpolation_factor"] == 4
    assert "rotary_seq_len_interpolation_factor" not in shape_fields(_built(["--model", "llama-tiny"]))
    args = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                              vocab_size=128, max_position_embeddings=32, seq_length=32, swiglu=True,
                              position_embedding_type="rope", add_bias_linear=False,
                              rotary_seq_len_interpolation_factor=4)
    flags = translate_args(args, "ckpt").flags
    assert _built(flags + ["--mock-data"]).rotary_seq_len_interpolation_factor == 4
    args.rotary_seq_len_interpolation_factor = None
    assert "--rotary-seq-len-interpolation-factor" not in translate_args(args, "ckpt").flags


def losses_and_notes(rank, world, argv):
    """The run's losses and the lines it printed that speak of interpolation."""
    import contextlib
    import io
    import os

    import pretrain_gpt
    from megalite.training import pretrain

    os.environ.pop("MEGALITE_QUIET", None)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        records = pretrain(parse(argv), pretrain_gpt.task()).records
    return [r["loss"] for r in records], [line for line in printed.getvalue().splitlines() if "interpolation" in line]


def test_a_resume_that_interpolates_says_so_in_one_line(tmp_path):
    """A longer context on resume: the weights' function changes on purpose, told in one line."""
    from megalite.testing import run_ranks

    base = ["--model", "llama-tiny", "--num-layers", "2", "--seq-length", "16", "--global-batch-size", "2",
            "--micro-batch-size", "1", "--log-interval", "1", "--eval-iters", "0", "--save-interval", "2"]
    [(_, quiet)] = run_ranks(losses_and_notes, 1, args=(base + ["--train-iters", "2", "--save", str(tmp_path / "ck")],))
    assert quiet == []
    resumed = base + ["--load", str(tmp_path / "ck"), "--train-iters", "3",
                      "--rotary-seq-len-interpolation-factor", "2"]
    [(losses, said)] = run_ranks(losses_and_notes, 1, args=(resumed,))
    assert len(losses) == 1
    assert len(said) == 1 and "rotary_seq_len_interpolation_factor None (checkpoint) -> 2.0 (now)" in said[0], said


def test_a_model_the_checkpoint_and_the_flags_cannot_build_together_is_one_error(tmp_path, monkeypatch):
    """An interpolated checkpoint resumed with YaRN: refused in one line, not a crash of the shape check."""
    from megalite.errors import UsageError
    from megalite.testing import run_ranks
    from megalite.training.checkpoint_shape import adopt_checkpoint_shape

    base = ["--model", "llama-tiny", "--num-layers", "2", "--seq-length", "16", "--global-batch-size", "2",
            "--micro-batch-size", "1", "--log-interval", "1", "--eval-iters", "0", "--save-interval", "1",
            "--train-iters", "1", "--rotary-seq-len-interpolation-factor", "2", "--save", str(tmp_path / "ck")]
    run_ranks(losses_and_notes, 1, args=(base,))
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(UsageError, match="YaRN and --multi-latent-attention do not use it"):
        adopt_checkpoint_shape(parse(["--load", str(tmp_path / "ck"), "--yarn-factor", "4"]))
