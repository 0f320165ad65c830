"""Hugging Face interop for DeepSeek-V3 (megalite.tools.convert_hf.deepseek): randomly initialised tiny
DeepseekV3ForCausalLM built from transformers configs (nothing downloaded), 3 layers (the first
dense), 8 experts in 4 groups, top-4 of 2 groups, a shared expert, random nonzero correction biases,
interleaved rope, fp32: with and without a query low rank, and with YaRN, the same logits in megalite
(1e-4 relative); each mapping (rotary row order, biases, groups, scaling, YaRN) is what makes them
equal; the export reloads with nothing missing, bit for bit; the multi-token prediction module in the
files (layer num_hidden_layers) imports as megalite's mtp.0 with DeepSeek's MTP loss and exports back
bit for bit; refusals in one line; an imported checkpoint trains."""
from __future__ import annotations

import json

import pytest
import torch

tf = pytest.importorskip("transformers")

from helpers import randomized  # noqa: E402
from megalite import checkpoint  # noqa: E402
from megalite.models import GPTModel, TransformerConfig  # noqa: E402
from megalite.models.rope import RotaryEmbedding, apply_rotary  # noqa: E402
from megalite.parallel.layers import pad_vocab_size  # noqa: E402
from megalite.testing import run_ranks  # noqa: E402
from megalite.tools import convert_hf  # noqa: E402
from megalite.tools.convert_hf import deepseek, from_hf, to_hf  # noqa: E402

VOCAB, HIDDEN, HEADS, LAYERS, FFN, MOE_FFN, EXPERTS = 96, 32, 4, 3, 40, 16, 8
Q_RANK, KV_RANK, NOPE, ROPE, V_DIM = 20, 12, 6, 8, 10
BATCH, SEQ = 2, 12
TOL = 1e-4  # relative to the largest logit
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7}


def _config(**overrides):
    fields = dict(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                  vocab_size=VOCAB, max_position_embeddings=64, intermediate_size=FFN, moe_intermediate_size=MOE_FFN,
                  n_routed_experts=EXPERTS, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                  n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=KV_RANK, q_lora_rank=Q_RANK,
                  qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM, bos_token_id=0, eos_token_id=1)
    return tf.DeepseekV3Config(**{**fields, **overrides})


VARIANTS = {
    "q_lora": {},
    # a plain query projection, two shared experts' width, tied embeddings
    "plain_q": dict(q_lora_rank=None, n_shared_experts=2, tie_word_embeddings=True),
    "yarn": dict(rope_parameters=YARN),
}


def _hf_model(**overrides):
    torch.manual_seed(0)
    model = randomized(tf.DeepseekV3ForCausalLM(_config(**overrides)), seed=1)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # routers sharper than at init and biases that move selection: routing decides
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.mul_(4.0)
                layer.mlp.gate.e_score_correction_bias.copy_(0.5 * torch.randn(EXPERTS, generator=gen))
    return model


def saved_variants(tmp_path_factory) -> dict:
    """{variant: save_pretrained directory of a random fp32 model}."""
    dirs = {}
    for name, overrides in VARIANTS.items():
        dirs[name] = tmp_path_factory.mktemp(f"hf-{name}")
        _hf_model(**overrides).save_pretrained(dirs[name])
    return dirs


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return saved_variants(tmp_path_factory)


def _ids():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def _hf_logits(hf):
    return hf(_ids()).logits


@torch.no_grad()
def _megalite_logits(config, sd):
    model = GPTModel(config, seed=7, device="cpu").eval()
    model.load_state_dict(sd)
    return model(_ids())[..., :VOCAB]


def _rel_err(ours, theirs) -> float:
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def _load(directory):
    return tf.DeepseekV3ForCausalLM.from_pretrained(directory, local_files_only=True).eval()


def _stored(directory) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def _rewrite_weights(directory, drop=(), add=None):
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = {k: v for k, v in load_file(str(path)).items() if k not in drop}
    save_file({**tensors, **(add or {})}, str(path), metadata={"format": "pt"})


# --- import and export -------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_import_matches_hf_and_export_reloads_bit_for_bit(name, hf_dirs, tmp_path):
    hf = _load(hf_dirs[name])
    config, sd = from_hf(hf_dirs[name])
    assert config.multi_latent_attention and config.moe_layer_freq == [0, 1, 1]
    assert list(sd) == list(GPTModel(config, seed=7, device="cpu").state_dict())
    assert sd["layers.1.mlp.router.expert_bias"].abs().min() > 0  # the correction biases came along
    theirs = _hf_logits(hf)
    assert _rel_err(_megalite_logits(config, sd), theirs) <= TOL

    to_hf(config, sd).save_pretrained(tmp_path / "out")
    stored = _stored(tmp_path / "out")
    experts = {f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight" for i in (1, 2) for e in range(EXPERTS)
               for p in ("gate", "up", "down")}
    assert experts <= stored and "model.layers.2.mlp.gate.e_score_correction_bias" in stored
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rope_interleave"] is True
    again, info = tf.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True,
                                                           output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}  # nothing missing, unexpected or re-initialised
    for key, value in hf.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    assert torch.equal(_hf_logits(again.eval()), theirs)


def test_each_mapping_is_what_makes_the_logits_equal(hf_dirs):
    """Rotary rows left interleaved, the correction biases dropped, no group limit, no scaling factor,
    YaRN off or without its softmax factor: each moves the logits by over 100 x the tolerance."""
    hf = _load(hf_dirs["q_lora"])
    config, sd = from_hf(hf)
    theirs = _hf_logits(hf)
    padded = pad_vocab_size(VOCAB, 1, config.make_vocab_size_divisible_by)
    interleaved = deepseek.tensors_from_hf(hf.state_dict(), config, padded, interleaved=False)
    unbiased = {k: torch.zeros_like(v) if k.endswith("expert_bias") else v for k, v in sd.items()}
    wrong = [(config, interleaved), (config, unbiased),
             (config.replace(moe_router_num_groups=None, moe_router_group_topk=None), sd),
             (config.replace(moe_router_topk_scaling_factor=None), sd)]
    yarn_hf = _load(hf_dirs["yarn"])
    yarn_config, yarn_sd = from_hf(yarn_hf)
    for c, s in wrong:
        assert _rel_err(_megalite_logits(c, s), theirs) > 100 * TOL
    yarn_theirs = _hf_logits(yarn_hf)
    for c in (yarn_config.replace(yarn_factor=None), yarn_config.replace(yarn_mscale_all_dim=0.0)):
        assert _rel_err(_megalite_logits(c, yarn_sd), yarn_theirs) > 100 * TOL


def test_interleaved_rope_is_rotate_half_of_the_reordered_dims():
    """Hugging Face's interleaved rotation of x equals megalite's rotate-half rotation of x's dims in
    rotate_half_order (the order import gives the rows), so q.k is the same."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    assert deepseek.rotate_half_order(8).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, SEQ, ROPE, generator=gen), torch.randn(1, 1, SEQ, ROPE, generator=gen)
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               position_embedding_type="rope", multi_latent_attention=True,
                               qk_pos_emb_head_dim=ROPE)
    rotary = RotaryEmbedding(config)
    angles = torch.outer(torch.arange(SEQ, dtype=torch.float32), rotary.inv_freq)
    emb = torch.cat([angles, angles], dim=-1)
    q_hf, k_hf = apply_rotary_pos_emb_interleave(q, k, emb.cos()[None], emb.sin()[None])
    cos, sin = rotary.cos_sin(SEQ, "cpu")  # [s, 1, 1, d]: to [1, 1, s, d]
    cos, sin = cos.permute(1, 2, 0, 3), sin.permute(1, 2, 0, 3)
    order = deepseek.rotate_half_order(ROPE)
    q_ours, k_ours = apply_rotary(q[..., order], cos, sin, ROPE), apply_rotary(k[..., order], cos, sin, ROPE)
    assert (q_ours - q_hf).abs().max() < 1e-6 and (k_ours - k_hf).abs().max() < 1e-6
    assert (q_hf - apply_rotary(q, cos, sin, ROPE)).abs().max() > 0.1  # without the reordering: other numbers


def test_cli_round_trip_and_load_model_weights(hf_dirs, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    assert convert_hf.main(["import", "--hf-dir", str(hf_dirs["q_lora"]), "--out", str(ckpt)]) == 0
    assert convert_hf.main(["export", "--load", str(ckpt), "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    assert _stored(out) == _stored(hf_dirs["q_lora"])
    original = _load(hf_dirs["q_lora"])
    again = tf.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    for key, value in original.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    config, _ = from_hf(hf_dirs["q_lora"])
    model = GPTModel(config, seed=7, device="cpu")
    checkpoint.load_model_weights(ckpt, [model])  # what --load reads, expert biases included
    with torch.no_grad():
        assert _rel_err(model.eval()(_ids())[..., :VOCAB], _hf_logits(original)) <= TOL


# --- the config --------------------------------------------------------------------------------

def test_deepseek_v3s_published_config_maps_to_megalites_fields():
    """DeepseekV3Config's defaults are DeepSeek-V3's published sizes; its config.json's rope_scaling
    is YaRN with factor 40 over 4096 positions, mscale = mscale_all_dim = 1."""
    published = tf.DeepseekV3Config(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}, max_position_embeddings=163840)
    fields, problems = deepseek.config_fields(published)
    assert problems == []
    config = TransformerConfig(**fields)
    expected = dict(num_layers=61, hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                    qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, ffn_hidden_size=18432,
                    num_moe_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
                    moe_shared_expert_intermediate_size=2048, moe_router_num_groups=8, moe_router_group_topk=4,
                    moe_router_topk_scaling_factor=2.5, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, moe_router_load_balancing_type="none", yarn_factor=40.0,
                    yarn_original_max_position_embeddings=4096, yarn_mscale=1.0, yarn_mscale_all_dim=1.0,
                    layernorm_epsilon=1e-6, untie_embeddings_and_output_weights=True)
    assert {k: getattr(config, k) for k in expected} == expected
    assert config.moe_layer_freq == [0] * 3 + [1] * 58
    back = deepseek.hf_config(config)
    for name in ("n_group", "topk_group", "first_k_dense_replace", "n_shared_experts", "routed_scaling_factor",
                 "norm_topk_prob", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"):
        assert getattr(back, name) == getattr(published, name), name
    assert back.rope_parameters == {**published.rope_parameters, "beta_fast": 32.0, "beta_slow": 1.0}


def test_yarns_attention_factor_survives_both_ways():
    """Hugging Face ignores mscale without mscale_all_dim; megalite does not: export writes the
    factor as attention_factor then, and import reads an attention_factor back into mscale."""
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                               position_embedding_type="rope", multi_latent_attention=True, q_lora_rank=None,
                               kv_lora_rank=KV_RANK, qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE, v_head_dim=V_DIM,
                               normalization="rmsnorm", gated_linear_unit=True, activation="silu",
                               add_bias_linear=False, layernorm_epsilon=1e-6, yarn_factor=4.0, yarn_mscale=0.7)
    rope = deepseek.hf_rope_parameters(config)
    assert rope["attention_factor"] == pytest.approx(1 + 0.07 * torch.log(torch.tensor(4.0)).item(), rel=1e-6)
    fields = deepseek.config_fields(deepseek.hf_config(config))[0]
    assert (fields["yarn_mscale"], fields["yarn_mscale_all_dim"]) == (pytest.approx(0.7, rel=1e-9), 0.0)
    model = randomized(GPTModel(config, seed=3, device="cpu"), seed=4)  # a dense MLA model: no experts
    sd = model.state_dict()
    hf = to_hf(config, sd)
    assert hf.config.first_k_dense_replace == 1 and hf.config.rope_parameters["attention_factor"] > 1.09
    with torch.no_grad():
        assert _rel_err(model(_ids())[..., :VOCAB], _hf_logits(hf)) <= TOL


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # torch, on the zero-width shared experts
def test_a_megalite_router_without_expert_biases_exports_zero_biases():
    """Top-1 (norm_topk_prob False), no shared expert (zero-width shared experts in Hugging Face), no
    groups, no expert bias: the same logits; in bf16 the routers stay fp32, as transformers keeps them."""
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                               position_embedding_type="rope", multi_latent_attention=True, q_lora_rank=Q_RANK,
                               kv_lora_rank=KV_RANK, qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE, v_head_dim=V_DIM,
                               normalization="rmsnorm", gated_linear_unit=True, activation="silu",
                               add_bias_linear=False, ffn_hidden_size=FFN, num_moe_experts=4, moe_router_topk=1,
                               moe_ffn_hidden_size=MOE_FFN, moe_layer_freq=[0, 1], moe_router_score_function="sigmoid",
                               layernorm_epsilon=1e-6)
    model = randomized(GPTModel(config, seed=3, device="cpu"), seed=4)
    hf = to_hf(config, model.state_dict())
    assert (hf.config.norm_topk_prob, hf.config.n_shared_experts) == (False, 0)
    assert not hf.model.layers[1].mlp.gate.e_score_correction_bias.any()
    with torch.no_grad():
        assert _rel_err(model(_ids())[..., :VOCAB], _hf_logits(hf)) <= TOL
    again, sd = from_hf(hf)  # back: the router gains a (zero) expert bias, nothing else changes
    assert again.moe_router_enable_expert_bias and again.moe_shared_expert_intermediate_size is None
    unpadded = {k: v[:VOCAB] if k == "word_embeddings.weight" else v for k, v in model.state_dict().items()}
    assert all(torch.equal(sd[k][:len(v)], v) for k, v in unpadded.items())
    half = to_hf(config.replace(params_dtype=torch.bfloat16), {k: v.bfloat16() for k, v in model.state_dict().items()})
    gate = half.model.layers[1].mlp.gate
    assert (gate.weight.dtype, gate.e_score_correction_bias.dtype, half.lm_head.weight.dtype) == (
        torch.float32, torch.float32, torch.bfloat16)


# --- training an imported checkpoint ------------------------------------------------------------

def _train_from(rank, world_size, argv):
    from training_ranks import train_losses

    return train_losses(rank, world_size, argv)


def test_an_imported_checkpoint_trains_from_load_alone(hf_dirs, tmp_path):
    """--load with no model flags: MLA's sizes, the experts, the sigmoid router with its groups,
    scaling and expert biases come from the imported checkpoint."""
    ckpt = tmp_path / "ckpt"
    assert convert_hf.main(["import", "--hf-dir", str(hf_dirs["plain_q"]), "--out", str(ckpt)]) == 0
    argv = ["--mock-data", "--load", str(ckpt), "--no-load-optim", "--train-iters", "2", "--log-interval", "1",
            "--global-batch-size", "4", "--micro-batch-size", "2", "--eval-interval", "0", "--lr", "1e-3",
            "--seq-length", "16"]
    losses = run_ranks(_train_from, 1, args=(argv,))[0]
    assert len(losses) == 2 and all(abs(x - 4.56) < 1.5 for x in losses), losses  # about ln(vocabulary 96)


def test_an_imported_yarn_checkpoint_trains_from_load_alone_at_ep1_and_ep2_alike(hf_dirs, tmp_path):
    """--load with no model flags: MLA, the experts, DeepSeek's router and YaRN come from the
    imported checkpoint (which has no run configuration of its own)."""
    from megalite import config as C
    from megalite.training.checkpoint_shape import adopt_checkpoint_shape

    ckpt = tmp_path / "ckpt"
    assert convert_hf.main(["import", "--hf-dir", str(hf_dirs["yarn"]), "--out", str(ckpt)]) == 0
    argv = ["--mock-data", "--load", str(ckpt), "--no-load-optim", "--train-iters", "2", "--log-interval", "1",
            "--global-batch-size", "4", "--micro-batch-size", "2", "--eval-interval", "0", "--lr", "1e-3",
            "--seq-length", "16"]
    model = C.model_config(adopt_checkpoint_shape(C.build_parser("test", "gpt-tiny").parse_args(argv)))
    assert (model.multi_latent_attention, model.yarn_factor, model.yarn_mscale_all_dim) == (True, 4.0, 0.7)
    assert model.moe_router_enable_expert_bias and model.moe_router_num_groups == 4
    one = run_ranks(_train_from, 1, args=(argv,))[0]
    two = run_ranks(_train_from, 2, args=(argv + ["--ep", "2"],))[0]
    assert len(one) == 2 and max(abs(a - b) / abs(b) for a, b in zip(two, one)) <= 1e-5, (two, one)
