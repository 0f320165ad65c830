"""Hugging Face GptOssForCausalLM <-> megalite (convert_hf/gpt_oss.py): learned sinks, biases on attention,
router and experts, interleaved gate/up columns, quick-GeGLU experts clamped and offset, a window in
every other layer and YaRN without rounding give Hugging Face's logits both ways (every setting moving
them when changed); the command line imports a save_pretrained directory, trains it at tp 2 with SP,
ep 2, cp 2 (the ring with sinks and the window) and pp 2 as at one rank, and exports it back;
Megatron-LM's gpt-oss flags build the preset's model; YaRN imports and exports for the Llama family
too; what gpt-oss cannot hold is refused."""
from __future__ import annotations

import pytest
import torch

from helpers import rel_err
from megalite.models import GPTModel
from megalite.models.presets import preset
from megalite.testing import run_ranks
from training_ranks import built_model, train_losses

tf = pytest.importorskip("transformers")
if not hasattr(tf, "GptOssConfig"):
    pytest.skip("this transformers has no gpt-oss", allow_module_level=True)

from megalite.tools.convert_hf import ConversionError, from_hf, to_hf  # noqa: E402

ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 16}


def _hf(**changes):
    fields = dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                  max_position_embeddings=64, rope_parameters=dict(ROPE), swiglu_limit=0.5, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.GptOssForCausalLM(tf.GptOssConfig(**{**fields, **changes})).eval()
    with torch.no_grad():  # off the init: every weight, bias and sink matters
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape))
    return model


IDS = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))


def _ours(hf):
    config, sd = from_hf(hf)
    model = GPTModel(config, seed=0, device="cpu").eval()
    model.load_state_dict(sd)
    return config, model


def test_logits_equal_hugging_faces_both_ways():
    hf = _hf()
    config, model = _ours(hf)
    assert (config.softmax_type, config.activation, config.glu_linear_offset, config.activation_func_clamp_value,
            config.window_size, config.window_attn_skip_freq, config.yarn_correction_range_round_to_int,
            config.add_bias_linear) == ("learnable", "quick_gelu", 1.0, 0.5, (3, 0), [1, 0], False, True)
    with torch.no_grad():
        want, got = hf(IDS).logits, model(IDS)[..., :96]
        assert rel_err(got, want) <= 1e-5
        back = to_hf(config, model.state_dict())
        assert type(back).__name__ == "GptOssForCausalLM"
        assert torch.equal(back(IDS).logits, want)
    theirs = hf.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in back.state_dict().items())
    for change in (dict(swiglu_limit=7.0), dict(sliding_window=8), dict(rope_parameters={**ROPE, "factor": 8.0})):
        other = _hf(**change)
        with torch.no_grad():
            moved = _ours(other)[1](IDS)[..., :96]
            assert rel_err(moved, want) > 1e-4, change  # each setting is read
            assert rel_err(moved, other(IDS).logits) <= 1e-5, change


def test_refusals():
    with pytest.raises(ConversionError, match="swiglu_alpha=1.5"):
        from_hf(_hf(swiglu_alpha=1.5))
    with pytest.raises(ConversionError, match="attention_bias=False"):
        from_hf(_hf(attention_bias=False))
    moe = GPTModel(preset("moe-tiny"), seed=0, device="cpu")
    with pytest.raises(ConversionError, match="GptOssForCausalLM needs"):
        to_hf(moe.config, moe.state_dict(), architecture="GptOssForCausalLM")
    both = GPTModel(preset("gpt-oss-tiny", yarn_factor=None, rope_scaling_factor=8.0,
                           rotary_seq_len_interpolation_factor=2.0), seed=0, device="cpu")
    with pytest.raises(ConversionError, match="scales rope one way"):
        to_hf(both.config, both.state_dict())
    dense = GPTModel(preset("llama-tiny", softmax_type="learnable"), seed=0, device="cpu")
    with pytest.raises(ConversionError, match="only GptOssForCausalLM holds"):
        to_hf(dense.config, dense.state_dict())


def test_megatron_lms_gpt_oss_flags_build_the_presets_model():
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
             "--num-query-groups", "2", "--kv-channels", "16", "--ffn-hidden-size", "32", "--normalization", "RMSNorm",
             "--vocab-size", "1024", "--max-position-embeddings", "128", "--seq-length", "32",
             "--position-embedding-type", "yarn", "--rotary-base", "150000", "--rotary-scaling-factor", "4",
             "--yarn-original-max-position-embeddings", "16", "--no-yarn-correction-range-round-to-int",
             "--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0",
             "--softmax-type", "learnable", "--window-size", "3,0", "--window-attn-skip-freq", "2",
             "--untie-embeddings-and-output-weights", "--num-experts", "4", "--moe-router-topk", "2",
             "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "0.01"]
    ours, want = built_model(flags), preset("gpt-oss-tiny")
    fields = ("softmax_type", "activation", "gated_linear_unit", "glu_linear_offset", "activation_func_clamp_value",
              "window_size", "window_attn_skip_freq", "position_embedding_type", "rotary_base", "yarn_factor",
              "yarn_original_max_position_embeddings", "yarn_correction_range_round_to_int", "add_bias_linear",
              "num_query_groups", "kv_channels", "num_moe_experts", "moe_router_topk", "normalization")
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(want, f) for f in fields}


def test_yarn_imports_and_exports_for_the_llama_family():
    hf = tf.Qwen2ForCausalLM(tf.Qwen2Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16})).eval()
    config, model = _ours(hf)
    assert (config.yarn_factor, config.yarn_original_max_position_embeddings) == (4.0, 16)
    with torch.no_grad():
        want = hf(IDS).logits
        assert rel_err(model(IDS)[..., :96], want) <= 1e-5
        back = to_hf(config, model.state_dict())
        assert back.config.rope_parameters["rope_type"] == "yarn" and torch.equal(back(IDS).logits, want)


@pytest.mark.slow
def test_the_command_line_imports_trains_at_tp2_and_ep2_and_exports(tmp_path):
    from megalite.tools.convert_hf import main

    _hf().save_pretrained(tmp_path / "hf")
    assert main(["import", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 0
    run = ["--seq-length", "16", "--global-batch-size", "4", "--micro-batch-size", "1", "--log-interval", "1",
           "--eval-iters", "0", "--train-iters", "2", "--load", str(tmp_path / "ck"), "--finetune"]
    [want] = run_ranks(train_losses, 1, args=(run,))
    for layout in (["--tp", "2", "--sequence-parallel", "--etp", "1"], ["--ep", "2"], ["--cp", "2"], ["--pp", "2"]):
        for got in run_ranks(train_losses, 2, args=(run + layout,)):
            assert rel_err(torch.tensor(got), torch.tensor(want)) <= 1e-5, (layout, got, want)
    assert main(["export", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "back")]) == 0
    back = tf.GptOssForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert torch.equal(back(IDS).logits, _hf()(IDS).logits)


def test_greedy_generation_equals_transformers():
    """The key/value cache with sinks, the window (prompt and completion four windows long) and YaRN."""
    from megalite.generation import generate

    hf = _hf()
    model = _ours(hf)[1]
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11]]
    ours = generate([model], prompts, max_new_tokens=9, eos_id=None).tokens
    with torch.no_grad():
        for prompt, tokens in zip(prompts, ours):
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=9, do_sample=False, pad_token_id=0)
            assert out[0, len(prompt):].tolist() == tokens
