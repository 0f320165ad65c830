"""Llama 4's attention variants as Megatron-LM's flags name them: --qk-l2-norm (queries and keys per
head at unit root-mean-square, Megatron-Core's L2Norm) and --no-rope-freq (layers without rope). The
norm is Megatron-Core's formula bit for bit and a weightless RMSNorm's numbers; rope skipped in every
layer is the model without positions; tp 2 with SP and cp 2 train as one rank; generation's cache
gives the whole prefix's logits; checkpoints and Megatron-LM's args carry both; bad settings are
refused in one line."""
from __future__ import annotations

import argparse

import pytest
import torch

from helpers import rel_err
from megalite.models import GPTModel
from megalite.models.presets import preset
from megalite.models.qk_variants import l2_normalized, no_rope_pattern
from megalite.testing import run_ranks
from training_ranks import built_model as _built, train_losses as losses


def _megatron_l2(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Megatron-Core's L2Norm._norm, from its formula."""
    x_float = x.float()
    return (x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_is_megatron_cores_l2norm_bit_for_bit(dtype):
    x = torch.randn(5, 2, 4, 16, generator=torch.Generator().manual_seed(0)).to(dtype) * 3
    got = l2_normalized(x, 1e-6)
    assert got.dtype == dtype and torch.equal(got, _megatron_l2(x, 1e-6))
    assert torch.allclose(got.float().pow(2).mean(-1), torch.ones(5, 2, 4), atol=1e-2 if dtype == torch.bfloat16
                          else 1e-5)


def test_the_model_is_a_weightless_rmsnorm_on_queries_and_keys():
    """qk_l2_norm computes what qk_layernorm's RMSNorm computes with its weights at one."""
    config = preset("llama-tiny", qk_l2_norm=True)
    l2 = GPTModel(config, seed=3, device="cpu").eval()
    normed = GPTModel(config.replace(qk_l2_norm=False, qk_layernorm=True), seed=3, device="cpu").eval()
    state = dict(normed.state_dict())
    for name, t in l2.state_dict().items():
        state[name] = t
    normed.load_state_dict(state)  # q_norm / k_norm weights stay at their init, ones
    norm_weights = [p for n, p in normed.named_parameters() if "q_norm" in n or "k_norm" in n]
    assert norm_weights and all(torch.equal(p, torch.ones_like(p)) for p in norm_weights)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = l2(ids), normed(ids)
        assert rel_err(got, want) <= 1e-6
        plain = GPTModel(config.replace(qk_l2_norm=False), seed=3, device="cpu").eval()
        assert rel_err(plain(ids), got) > 1e-3


def test_which_layers_skip_rope_is_megatron_cores_rule_and_skipping_all_is_no_positions():
    assert no_rope_pattern(4, 8) == [0, 0, 0, 1, 0, 0, 0, 1]
    assert no_rope_pattern("[0,1]*2", 4) == [0, 1, 0, 1]
    config = _built(["--model", "llama-tiny", "--no-rope-freq", "2"])
    model = GPTModel(config, seed=3, device="cpu").eval()
    assert [layer.attention.rotary is None for layer in model.layers] == [False, True, False, True]
    nowhere = preset("llama-tiny", no_rope_freq=1)
    ids = torch.randint(0, nowhere.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    none = GPTModel(nowhere.replace(no_rope_freq=None, position_embedding_type="none"), seed=3, device="cpu").eval()
    with torch.no_grad():
        assert torch.equal(GPTModel(nowhere, seed=3, device="cpu").eval()(ids), none(ids))
        assert rel_err(model(ids), GPTModel(preset("llama-tiny"), seed=3, device="cpu").eval()(ids)) > 1e-3


def test_the_generation_cache_gives_the_whole_prefixs_logits():
    pytest.importorskip("transformers")
    from test_generate import _model as generation_model, assert_cached_decode_is_the_whole_prefixs

    assert_cached_decode_is_the_whole_prefixs(generation_model("llama", qk_l2_norm=True, no_rope_freq=[0, 1]), 5)


RUN = ["--model", "llama-tiny", "--num-layers", "4", "--seq-length", "16", "--global-batch-size", "4",
       "--micro-batch-size", "1", "--log-interval", "1", "--eval-iters", "0", "--train-iters", "3",
       "--qk-l2-norm", "--no-rope-freq", "[0,1,0,1]"]


@pytest.mark.slow
def test_training_at_tp2_with_sp_and_cp2_gives_one_ranks_losses():
    [want] = run_ranks(losses, 1, args=(RUN,))
    for layout in (["--tp", "2", "--sequence-parallel"], ["--cp", "2"]):
        for got in run_ranks(losses, 2, args=(RUN + layout,)):
            assert rel_err(torch.tensor(got), torch.tensor(want)) <= 1e-5, (layout, got, want)


def test_checkpoints_and_megatron_lms_args_carry_them():
    from megalite.checkpoint.megatron_dist_map import translate_args
    from megalite.tools.plan.command import model_flags
    from megalite.training.checkpoint_shape import shape_fields

    config = _built(RUN)
    fields = shape_fields(config)
    assert fields["qk_l2_norm"] is True and fields["no_rope_freq"] == "[0,1,0,1]"
    assert _built(model_flags(config, "llama-tiny") + ["--mock-data"]).no_rope_freq == [0, 1, 0, 1]
    args = argparse.Namespace(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                              vocab_size=128, max_position_embeddings=32, seq_length=32, swiglu=True,
                              position_embedding_type="rope", add_bias_linear=False, qk_l2_norm=True, no_rope_freq=4)
    rebuilt = _built(translate_args(args, "ckpt").flags + ["--mock-data"])
    assert rebuilt.qk_l2_norm and rebuilt.no_rope_freq == [0, 0, 0, 1]


def test_beside_qk_layernorm_the_l2_norm_wins_and_megatron_lms_spellings_read():
    """As Megatron-Core chooses the norm class: qk_l2_norm over qk_layernorm (no norm weights built)."""
    both = _built(["--model", "llama-tiny", "--qk-layernorm", "--qk-l2-norm"])
    assert both.qk_l2_norm and not both.qk_layernorm
    assert not [n for n, _ in GPTModel(both, seed=0, device="cpu").named_parameters() if "q_norm" in n]
    assert _built(["--model", "llama-tiny", "--no-rope-freq", "0"]).no_rope_freq is None  # Megatron-Core's off
    assert no_rope_pattern("([0]*1+[1]*1)*2", 4) == [0, 1, 0, 1]  # the whole pattern repeated, as in its help


def test_a_flag_given_with_use_checkpoint_args_is_compared_by_what_it_says():
    from megalite.training.checkpoint_shape import _same_flag

    assert _same_flag("no_rope_freq", "4", "[0,0,0,1,0,0,0,1]", 8)
    assert not _same_flag("no_rope_freq", "2", "[0,0,0,1,0,0,0,1]", 8)
    assert _same_flag("window_attn_skip_freq", "2", "[1,0,1,0]", 4) and _same_flag("window_size", "(5, 0)", "5,0", 4)
    assert not _same_flag("window_size", "6,0", "5,0", 4) and not _same_flag("num_layers", 4, 8, 4)


@pytest.mark.parametrize("argv, message", [
    (["--no-rope-freq", "3"], "divide the 4 layers"),
    (["--no-rope-freq", "[0,1]"], "lists 2 entries"),
    (["--no-rope-freq", "2", "--position-embedding-type", "learned_absolute"], "add --position-embedding-type rope")])
def test_bad_settings_are_refused_in_one_line(argv, message):
    from megalite.errors import UsageError

    with pytest.raises(UsageError, match=message):
        _built(["--model", "llama-tiny"] + argv)
    if argv[0] == "--no-rope-freq" and argv[1] == "3":  # the one refusal of the other family, once
        with pytest.raises(UsageError, match="does not apply to --multi-latent-attention"):
            _built(["--model", "deepseek-tiny", "--qk-l2-norm"])


def test_expert_inputs_scaled_by_their_weight_are_megatron_cores_top1_experts():
    """--moe-apply-probs-on-input: each token's one expert computes on (weight x token), cast back to the
    token's dtype, and its output joins unweighted; written out here from the experts' weights."""
    from megalite.models.moe.layer import MoELayer

    # Llama 4's sigmoid router: a weight below one (top-1 softmax would give exactly one)
    config = preset("moe-tiny", moe_router_topk=1, moe_apply_probs_on_input=True,
                    moe_shared_expert_intermediate_size=None, moe_router_score_function="sigmoid")
    layer = MoELayer(config, None, None, "cpu").eval()
    x = torch.randn(6, 2, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = layer(x)
        tokens = x.reshape(-1, config.hidden_size)
        weights, indices, _, _ = layer.router(tokens)
        want = torch.empty_like(tokens)
        for t in range(tokens.shape[0]):
            e = int(indices[t, 0])
            scaled = (weights[t, 0] * tokens[t]).to(tokens.dtype)
            hidden = layer.experts.fc1_weight[e] @ scaled
            act = torch.nn.functional.silu(hidden[:hidden.shape[0] // 2]) * hidden[hidden.shape[0] // 2:] \
                if config.gated_linear_unit else torch.nn.functional.gelu(hidden, approximate="tanh")
            want[t] = layer.experts.fc2_weight[e] @ act
        assert rel_err(got.reshape(-1, config.hidden_size), want) <= 1e-5
        after = MoELayer(config.replace(moe_apply_probs_on_input=False), None, None, "cpu").eval()
        after.load_state_dict(layer.state_dict())
        assert rel_err(after(x), got) > 1e-3  # the weight after the expert is another function


def test_expert_inputs_scaled_need_top1_and_travel_with_megatron_args():
    from megalite.checkpoint.megatron_dist_map import translate_args
    from megalite.errors import UsageError

    with pytest.raises(UsageError, match="needs --moe-router-topk 1"):
        _built(["--model", "moe-tiny", "--moe-apply-probs-on-input"])
    top1 = _built(["--model", "moe-tiny", "--moe-router-topk", "1", "--moe-apply-probs-on-input"])
    assert top1.moe_apply_probs_on_input
    args = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                              vocab_size=128, max_position_embeddings=32, seq_length=32, swiglu=True,
                              position_embedding_type="rope", add_bias_linear=False, num_experts=4,
                              moe_router_topk=1, moe_apply_probs_on_input=True)
    assert _built(translate_args(args, "ckpt").flags + ["--mock-data"]).moe_apply_probs_on_input
