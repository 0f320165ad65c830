"""YaRN rope scaling (megalite.models.rope): the frequencies, the cos/sin attention factor and MLA's
softmax factor against values worked out by hand, and against transformers' own YaRN for
DeepSeek-V3's published settings; the config's checks and the command line's flags."""
from __future__ import annotations

import math

import pytest
import torch

from megalite import config as C
from megalite.errors import UsageError
from megalite.models import TransformerConfig
from megalite.models.rope import (RotaryEmbedding, inverse_frequencies, yarn_attention_factor, yarn_ramp,
                                  yarn_softmax_scale)


def _mla(**fields) -> TransformerConfig:
    """8 rotary dims per head (MLA's d_r) unless `fields` say otherwise, base 10000."""
    return TransformerConfig(**{**dict(num_layers=1, hidden_size=32, num_attention_heads=4, kv_lora_rank=12,
                                       position_embedding_type="rope", multi_latent_attention=True, qk_head_dim=6,
                                       qk_pos_emb_head_dim=8, v_head_dim=10), **fields})


@pytest.mark.parametrize("original, ramp, inv_freq", [
    # The blend's bounds: the dim turning beta times over the original context is
    # d(beta) = 8 ln(original / (2 pi beta)) / (2 ln 10000). original 64: d(32) = -0.50 -> 0,
    # d(1) = 1.008 -> 2: ramp i / 2.
    (64, [0.0, 0.5, 1.0, 1.0], [1.0, 0.5 * 0.1 + 0.5 * 0.1 / 4, 0.01 / 4, 0.001 / 4]),
    # original 4096: d(32) = 1.31 -> 1, d(1) = 2.81 -> 3: ramp (i - 1) / 2.
    (4096, [0.0, 0.0, 0.5, 1.0], [1.0, 0.1, 0.5 * 0.01 + 0.5 * 0.01 / 4, 0.001 / 4]),
])
def test_yarn_frequencies_are_kept_divided_or_blended_as_worked_out_by_hand(original, ramp, inv_freq):
    c = _mla(yarn_factor=4.0, yarn_original_max_position_embeddings=original)
    assert yarn_ramp(c).tolist() == ramp
    assert torch.allclose(inverse_frequencies(c), torch.tensor(inv_freq), rtol=1e-6, atol=0)
    assert torch.allclose(inverse_frequencies(c.replace(yarn_factor=None)), torch.tensor([1.0, 0.1, 0.01, 0.001]))


def test_attention_and_softmax_factors_as_worked_out_by_hand():
    m1 = 1 + 0.1 * math.log(4.0)  # 1.1386294...
    assert m1 == pytest.approx(1.1386294361, abs=1e-10)
    defaults = _mla(yarn_factor=4.0)  # mscale 1, mscale_all_dim 0: cos/sin carry it all, the softmax nothing
    assert (yarn_attention_factor(defaults), yarn_softmax_scale(defaults)) == (pytest.approx(m1), 1.0)
    deepseek = _mla(yarn_factor=4.0, yarn_mscale=1.0, yarn_mscale_all_dim=1.0)  # all in the softmax
    assert (yarn_attention_factor(deepseek), yarn_softmax_scale(deepseek)) == (1.0, pytest.approx(1.2964769877))
    half = _mla(yarn_factor=4.0, yarn_mscale=1.0, yarn_mscale_all_dim=0.5)
    m_half = 1 + 0.05 * math.log(4.0)
    assert yarn_attention_factor(half) == pytest.approx(m1 / m_half)  # 1.0648...
    assert yarn_softmax_scale(half) == pytest.approx(m_half ** 2)
    unstretched = _mla(yarn_factor=1.0, yarn_mscale_all_dim=1.0)
    assert (yarn_attention_factor(unstretched), yarn_softmax_scale(unstretched)) == (1.0, 1.0)
    assert (yarn_attention_factor(_mla()), yarn_softmax_scale(_mla())) == (1.0, 1.0)


def test_the_cos_sin_tables_carry_the_attention_factor():
    c = _mla(yarn_factor=4.0, yarn_original_max_position_embeddings=64)
    factor = 1 + 0.1 * math.log(4.0)
    cos, sin = RotaryEmbedding(c).cos_sin(5, "cpu")
    angles = torch.outer(torch.arange(5.0), inverse_frequencies(c))
    cos, sin = cos[:, 0, 0], sin[:, 0, 0]  # [positions, 8]: the 4 angles twice, the sine's first half negated
    assert torch.allclose(cos[:, :4], angles.cos() * factor) and torch.equal(cos[:, 4:], cos[:, :4])
    assert torch.allclose(sin[:, 4:], angles.sin() * factor) and torch.equal(sin[:, :4], -sin[:, 4:])
    plain_cos, _ = RotaryEmbedding(c.replace(yarn_factor=None)).cos_sin(5, "cpu")  # another table, not the cached one
    assert torch.allclose(plain_cos[:, 0, 0, :4], torch.outer(torch.arange(5.0), inverse_frequencies(
        c.replace(yarn_factor=None))).cos())


@pytest.mark.parametrize("fields, cp_rank, cp", [
    ({}, 0, 1), (dict(yarn_factor=4.0, yarn_original_max_position_embeddings=64), 0, 1),
    (dict(rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
          rope_original_max_position_embeddings=8), 0, 1), ({}, 1, 2)], ids=["plain", "yarn", "llama3", "cp2-rank1"])
def test_compiled_code_makes_the_cached_tables_in_its_graph(fields, cp_rank, cp):
    """Under torch.compile the tables are made in the graph, on the device (no cache to fill, no copy
    from the host): the same numbers as the cached tables, every scaling, context-parallel positions too."""
    import torch._dynamo
    torch._dynamo.reset()
    rotary = RotaryEmbedding(_mla(**fields))
    cached = rotary.cos_sin(8, "cpu", cp_rank, cp)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    compiled = torch.compile(lambda: rotary.cos_sin(8, "cpu", cp_rank, cp), backend=backend)()
    assert len(graphs) == 1 and any(n.target is torch.outer for n in graphs[0].graph.nodes)
    assert all(torch.equal(a, b) for a, b in zip(compiled, cached))


def test_deepseek_v3s_yarn_equals_transformers():
    """DeepSeek-V3's published rope: d_r 64, base 10000, factor 40 over 4096 positions, betas 32 and
    1, mscale = mscale_all_dim = 1: transformers' frequencies and factors (its softmax factor
    through DeepseekV3Attention's own function)."""
    tf = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    hf = tf.DeepseekV3Config(rope_parameters=dict(rope), max_position_embeddings=163840)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours = _mla(qk_pos_emb_head_dim=64, yarn_factor=40.0, yarn_original_max_position_embeddings=4096,
                yarn_mscale=1.0, yarn_mscale_all_dim=1.0)
    assert ((inverse_frequencies(ours) - inv_freq).abs() / inv_freq).max() < 1e-6
    assert 0.0 < yarn_ramp(ours).sum() < 32  # some frequencies kept, some divided
    assert yarn_attention_factor(ours) == pytest.approx(attention_factor, rel=1e-12)
    scale = 1 / math.sqrt(128 + 64)
    assert scale * yarn_softmax_scale(ours) == pytest.approx(yarn_apply_mscale(hf.rope_parameters, scale), rel=1e-12)
    assert yarn_softmax_scale(ours) == pytest.approx((1 + 0.1 * math.log(40.0)) ** 2)  # 1.87...


@pytest.mark.parametrize("truncate", [False, True])
def test_gpt_osss_yarn_equals_transformers_with_and_without_rounding(truncate):
    """gpt-oss's rope on grouped-query heads of 64 dims: base 150000, factor 32 over 4096 positions, betas
    32 and 1, truncate=False (Megatron-LM's --no-yarn-correction-range-round-to-int): transformers'
    frequencies and attention factor, the ramp's ends fractional; with truncate, rounded."""
    tf = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if not hasattr(tf, "GptOssConfig"):
        pytest.skip("this transformers has no gpt-oss")
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate}
    hf = tf.GptOssConfig(rope_parameters=dict(rope), hidden_size=256, num_attention_heads=4, head_dim=64)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    argv = ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "32", "--rotary-base", "150000",
            "--kv-channels", "64"] + ([] if truncate else ["--no-yarn-correction-range-round-to-int"])
    ours = _parse(argv)
    assert ours.position_embedding_type == "rope" and ours.yarn_correction_range_round_to_int is truncate
    assert ((inverse_frequencies(ours) - inv_freq).abs() / inv_freq).max() < 1e-6
    assert yarn_attention_factor(ours) == pytest.approx(attention_factor, rel=1e-12)
    rounded = _parse(argv[:8] + ["--yarn-correction-range-round-to-int"])
    assert torch.equal(yarn_ramp(ours), yarn_ramp(rounded)) is truncate  # the rounding moves the ramp


@pytest.mark.parametrize("fields, message", [
    (dict(yarn_factor=4.0, rope_scaling_factor=8.0), "either Llama 3.1's .* or YaRN's"),
    (dict(yarn_factor=0.5), "--yarn-factor must be >= 1"),
    (dict(yarn_factor=4.0, yarn_beta_fast=1.0, yarn_beta_slow=32.0), "--yarn-beta-slow .* at most --yarn-beta-fast"),
    (dict(yarn_factor=4.0, yarn_mscale=-1.0), "must be >= 0"),
])
def test_the_config_refuses_bad_yarn_settings(fields, message):
    with pytest.raises(ValueError, match=message):
        _mla(**fields)


def _parse(argv):
    return C.model_config(C.build_parser("test", "llama-tiny").parse_args(argv))


def test_yarn_flags():
    built = _parse(["--yarn-factor", "40", "--yarn-original-max-position-embeddings", "4096", "--yarn-mscale", "1",
                    "--yarn-mscale-all-dim", "1", "--yarn-beta-fast", "16"])
    assert (built.yarn_factor, built.yarn_original_max_position_embeddings, built.yarn_mscale,
            built.yarn_mscale_all_dim, built.yarn_beta_fast, built.yarn_beta_slow) == (40.0, 4096, 1.0, 1.0, 16.0, 1.0)
    assert _parse([]).yarn_factor is None
    with pytest.raises(UsageError, match="--yarn-beta-fast: YaRN settings, but YaRN is off: add --yarn-factor"):
        _parse(["--yarn-beta-fast", "16"])
    with pytest.raises(UsageError, match="--yarn-factor: for rotary positions only"):
        C.model_config(C.build_parser("test", "gpt-tiny").parse_args(["--yarn-factor", "4"]))


MEGATRON_MLA = ["--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "32", "--qk-head-dim", "16",
                "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16"]


def test_megatron_lms_deepseek_flags_as_its_scripts_pass_them():
    """Megatron-LM's names: --rotary-scaling-factor is YaRN's factor under MLA (whose --rope-type defaults
    to yarn) and Llama 3.1's with --use-rope-scaling; --mscale / --mscale-all-dim are YaRN's; its MLA
    scripts add --qk-layernorm (the latent norms megalite's MLA always has) and a --kv-channels MLA never
    reads; a sigmoid router ignores --moe-router-pre-softmax."""
    built = _parse(MEGATRON_MLA + ["--rotary-scaling-factor", "40", "--mscale", "1.0", "--mscale-all-dim", "0.707",
                                   "--qk-layernorm", "--kv-channels", "128", "--num-experts", "8",
                                   "--moe-router-score-function", "sigmoid", "--moe-router-pre-softmax"])
    assert (built.yarn_factor, built.yarn_mscale, built.yarn_mscale_all_dim) == (40.0, 1.0, 0.707)
    assert built.multi_latent_attention and not built.qk_layernorm and built.rope_scaling_factor is None
    assert built.moe_router_score_function == "sigmoid" and not built.moe_router_pre_softmax
    llama = _parse(["--use-rope-scaling", "--rotary-scaling-factor", "32"])
    assert (llama.rope_scaling_factor, llama.yarn_factor) == (32.0, None)
    assert _parse(["--rope-type", "yarn", "--rotary-scaling-factor", "4"]).yarn_factor == 4.0
    assert _parse(["--rotary-scaling-factor", "1"]).yarn_factor is None  # plain rope, factor 1: nothing scales
    with pytest.raises(UsageError, match=r"--rotary-scaling-factor 4 scales rope only with --use-rope-scaling"):
        _parse(["--rotary-scaling-factor", "4"])
    with pytest.raises(UsageError, match=r"--rotary-scaling-factor 40 and --yarn-factor 8 disagree"):
        _parse(MEGATRON_MLA + ["--rotary-scaling-factor", "40", "--yarn-factor", "8"])
    with pytest.raises(UsageError, match=r"--use-rope-scaling .* and --rope-type yarn are two rope scalings"):
        _parse(["--use-rope-scaling", "--rope-type", "yarn"])


def test_a_megatron_checkpoints_yarn_position_type_is_read():
    import argparse

    from megalite.checkpoint.megatron_dist_map import translate_args

    args = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                              vocab_size=128, max_position_embeddings=64, seq_length=64, swiglu=True,
                              add_bias_linear=False, position_embedding_type="yarn", rotary_base=150000,
                              rotary_scaling_factor=32.0, yarn_original_max_position_embeddings=16,
                              yarn_correction_range_round_to_int=False, mscale=1.0)
    built = _parse(translate_args(args, "ckpt").flags)
    assert (built.position_embedding_type, built.rotary_base, built.yarn_factor,
            built.yarn_original_max_position_embeddings, built.yarn_correction_range_round_to_int) == (
        "rope", 150000, 32.0, 16, False)


def test_the_yarn_position_type_keeps_a_presets_factor_and_rotates_whole_heads():
    keep = C.model_config(C.build_parser("test", "gpt-oss-tiny").parse_args(["--position-embedding-type", "yarn"]))
    assert (keep.yarn_factor, keep.yarn_correction_range_round_to_int) == (4.0, False)
    with pytest.raises(UsageError, match="drop --rotary-percent 0.5"):
        _parse(["--position-embedding-type", "yarn", "--rotary-percent", "0.5"])


def test_the_cached_tables_tell_the_rounding_apart():
    rounded = _mla(qk_pos_emb_head_dim=64, yarn_factor=40.0, yarn_original_max_position_embeddings=4096)
    exact = rounded.replace(yarn_correction_range_round_to_int=False)
    a, b = RotaryEmbedding(rounded).cos_sin(64, "cpu"), RotaryEmbedding(exact).cos_sin(64, "cpu")
    assert not torch.equal(a[0], b[0])


def test_use_checkpoint_args_reads_the_yarn_position_type_as_the_checkpoints_rope():
    from megalite.training.checkpoint_shape import _same_flag

    assert _same_flag("position_embedding_type", "yarn", "rope", 2)
    assert not _same_flag("position_embedding_type", "learned_absolute", "rope", 2)
