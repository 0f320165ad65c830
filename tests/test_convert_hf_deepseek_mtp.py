"""Hugging Face interop for DeepSeek-V3's multi-token prediction module and the refusals
(megalite.tools.convert_hf.deepseek), on test_convert_hf_deepseek.py's tiny random models: the MTP
module in the files (layer num_hidden_layers) imports as megalite's mtp.0 with DeepSeek's MTP loss and
exports back bit for bit; another MTP copy, a missing tensor or another count, a missing or extra
expert, settings megalite cannot compute and what DeepSeek-V3 cannot hold are refused in one line."""
from __future__ import annotations

import json

import pytest
import torch

tf = pytest.importorskip("transformers")

from helpers import randomized  # noqa: E402
from megalite.models import GPTModel  # noqa: E402
from megalite.tools import convert_hf  # noqa: E402
from megalite.tools.convert_hf import ConversionError, ConversionNote, deepseek, from_hf, to_hf  # noqa: E402
from test_convert_hf_deepseek import (BATCH, EXPERTS, HIDDEN, LAYERS, MOE_FFN, ROPE, SEQ, TOL, VOCAB,  # noqa: E402
                                      _config, _ids, _load, _rewrite_weights, saved_variants)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return saved_variants(tmp_path_factory)  # the same tiny random models as test_convert_hf_deepseek.py's


# --- multi-token prediction layers and refusals -------------------------------------------------

def _mtp_layer(hf, seed: int):
    """A random DeepSeek MTP module for layer LAYERS of `hf`: ({name: tensor} as DeepSeek's files hold
    it, one tensor per expert and copies of the embedding and head; the DeepseekV3DecoderLayer; the
    other tensors by leaf)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    layer = DeepseekV3DecoderLayer(hf.config, layer_idx=LAYERS)
    layer.load_state_dict(hf.model.layers[LAYERS - 1].state_dict())  # initialised values (experts start empty),
    randomized(layer, seed=seed)  # then others
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a sharp router and correction biases that move selection, as in _hf_model
        layer.mlp.gate.weight.mul_(4.0)
        layer.mlp.gate.e_score_correction_bias.copy_(0.5 * torch.randn(EXPERTS, generator=gen))
    extra = {"enorm.weight": 1 + 0.1 * torch.randn(HIDDEN, generator=gen),
             "hnorm.weight": 1 + 0.1 * torch.randn(HIDDEN, generator=gen),
             "eh_proj.weight": torch.randn(HIDDEN, 2 * HIDDEN, generator=gen) / (2 * HIDDEN) ** 0.5,
             "shared_head.norm.weight": 8 + torch.randn(HIDDEN, generator=gen),  # sharper logits: a loss that tells
             "embed_tokens.weight": hf.model.embed_tokens.weight, "shared_head.head.weight": hf.lm_head.weight}
    files = {}
    for name, t in {**layer.state_dict(), **extra}.items():
        if name == "mlp.experts.gate_up_proj":  # [E, 2I, H]: each expert's gate rows, then its up rows
            for e in range(EXPERTS):
                files[f"mlp.experts.{e}.gate_proj.weight"], files[f"mlp.experts.{e}.up_proj.weight"] = t[e].chunk(2)
        elif name == "mlp.experts.down_proj":
            files.update({f"mlp.experts.{e}.down_proj.weight": t[e] for e in range(EXPERTS)})
        else:
            files[name] = t
    return {f"model.layers.{LAYERS}.{k}": v.detach().clone().contiguous() for k, v in files.items()}, layer, extra


@pytest.fixture(scope="module")
def mtp_dirs(hf_dirs, tmp_path_factory):
    """{variant: (directory, the MTP layer, its other tensors)}: hf_dirs' models with a random MTP
    module in their files as layer LAYERS (num_nextn_predict_layers=1, DeepseekV3Config's default)."""
    import shutil

    out = {}
    for seed, name in enumerate(("q_lora", "plain_q"), 11):
        directory = tmp_path_factory.mktemp(f"hf-mtp-{name}") / "hf"
        shutil.copytree(hf_dirs[name], directory)
        files, layer, extra = _mtp_layer(_load(directory), seed)
        _rewrite_weights(directory, add=files)
        out[name] = (directory, layer, extra)
    return out


def _tokens():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(8))


@torch.no_grad()
def _reference_mtp_loss(hf, layer, extra, ids) -> torch.Tensor:
    """DeepSeek-V3's MTP loss (depth 1) from the Hugging Face tensors: at position i,
    h' = eh_proj([enorm(Emb(t_{i+1})); hnorm(h0_i)]), h1 = DeepseekV3DecoderLayer(h'),
    logits = lm_head(shared_head.norm(h1)) predicting t_{i+2}; the mean over i = 0..s-3."""
    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + hf.config.rms_norm_eps) * w

    h0 = hf.model(ids).last_hidden_state  # the main model's output after its final norm
    emb = hf.model.embed_tokens(ids)
    x = torch.cat([rms(emb[:, 1:], extra["enorm.weight"]), rms(h0[:, :-1], extra["hnorm.weight"])], dim=-1)
    x = x @ extra["eh_proj.weight"].t()  # positions 0..s-2
    n = x.shape[1]
    positions = torch.arange(n)[None]
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
    h1 = layer.eval()(x, attention_mask=causal, position_ids=positions,
                      position_embeddings=hf.model.rotary_emb(x, positions))
    logits = rms(h1, extra["shared_head.norm.weight"]) @ hf.lm_head.weight.t()
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 2:].reshape(-1))


def _megalite_losses(config, sd, ids) -> torch.Tensor:
    """megalite's mean main and MTP losses over a whole stream `ids` (inputs ids[:, :-1])."""
    from megalite.models.mtp import with_mtp_targets

    model = GPTModel(config, seed=7, device="cpu").eval()
    model.load_state_dict(sd)
    batch = with_mtp_targets({"labels": ids[:, 1:], "loss_mask": torch.ones(BATCH, SEQ - 1)}, config.mtp_num_layers)
    with torch.no_grad():
        sums = model(ids[:, :-1], labels=batch["labels"], loss_mask=batch["loss_mask"],
                     mtp_labels=batch["mtp_labels"], mtp_loss_mask=batch["mtp_loss_mask"])
    counts = torch.stack([batch["loss_mask"].sum(), batch["mtp_loss_mask"].sum()])
    return sums / counts


@pytest.mark.parametrize("name", ["q_lora", "plain_q"])
def test_imported_mtp_loss_equals_deepseeks_equations_on_the_hf_tensors(name, mtp_dirs):
    """The MTP module in the files (layer LAYERS, one tensor per expert) becomes mtp.0; its loss equals
    one computed from the Hugging Face tensors with transformers' own decoder layer (1e-4 relative),
    and the main loss Hugging Face's; without the rotary rows' reordering in the MTP layer it does not (by 10 and
    50 x the tolerance)."""
    directory, layer, extra = mtp_dirs[name]
    config, sd = from_hf(directory)
    assert config.mtp_num_layers == 1 and list(sd) == list(GPTModel(config, seed=7, device="cpu").state_dict())
    assert torch.equal(sd["mtp.0.eh_proj.weight"], extra["eh_proj.weight"])
    hf, ids = _load(directory), _tokens()
    main, mtp = _megalite_losses(config, sd, ids)
    want = _reference_mtp_loss(hf, layer, extra, ids)
    with torch.no_grad():
        want_main = torch.nn.functional.cross_entropy(hf(ids).logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    assert abs(mtp / want - 1) <= TOL and abs(main / want_main - 1) <= TOL, (mtp, want, main, want_main)
    assert abs(mtp / main - 1) > 0.01  # a loss of its own
    query = "q_up" if config.q_lora_rank else "q"
    unordered = {**sd, **{k: deepseek.reorder_rotary_rows(sd, config, torch.argsort(
        deepseek.rotate_half_order(ROPE)))[k] for k in (f"mtp.0.layer.attention.{query}.weight",
                                                        "mtp.0.layer.attention.kv_down.weight")}}
    assert abs(_megalite_losses(config, unordered, ids)[1] / want - 1) > 5 * TOL  # about 10 and 50 x


def test_mtp_export_round_trip_is_bit_for_bit(mtp_dirs, tmp_path):
    """Import then export through a megalite checkpoint (experts one tensor each, the MTP layer's
    too) writes the MTP module as DeepSeek's files hold it: the same tensor names, the copies of the
    embedding and head included, each tensor equal to the original's, num_nextn_predict_layers 1;
    importing again, from the directory, from sharded files or from the model object, gives every
    tensor bit for bit."""
    from safetensors.torch import load_file

    directory, ckpt, out = mtp_dirs["q_lora"][0], tmp_path / "ckpt", tmp_path / "out"
    assert convert_hf.main(["import", "--hf-dir", str(directory), "--out", str(ckpt)]) == 0
    assert convert_hf.main(["export", "--load", str(ckpt), "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    original, written = load_file(str(directory / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(written) == set(original) and f"model.layers.{LAYERS}.mlp.experts.7.up_proj.weight" in written
    for key, value in original.items():
        assert torch.equal(written[key], value), key
    config, sd = from_hf(directory)
    hf = to_hf(config, sd)
    with torch.no_grad():
        assert torch.equal(hf(_ids()).logits, _load(directory)(_ids()).logits)  # the MTP layer is not run
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    for again_config, again in (from_hf(out), from_hf(tmp_path / "sharded"), from_hf(hf)):
        assert again_config == config and list(again) == list(sd)
        for key, value in sd.items():
            assert torch.equal(again[key], value), key


@pytest.mark.parametrize("change,words", [
    ("head", f"model.layers.{LAYERS}.shared_head.head.weight differs from lm_head.weight"),
    ("missing", f"the weight files lack model.layers.{LAYERS}.self_attn.kv_a_layernorm.weight"),
    ("count", f"multi-token prediction layer(s) model.layers.{LAYERS} but num_hidden_layers={LAYERS} and "
              f"num_nextn_predict_layers=2 call for model.layers.{LAYERS}, model.layers.{LAYERS + 1}"),
])
def test_a_different_mtp_copy_a_missing_mtp_tensor_or_another_count_is_refused_in_one_line(change, words, mtp_dirs,
                                                                                         tmp_path, capsys):
    import shutil

    directory = tmp_path / "hf"
    shutil.copytree(mtp_dirs["q_lora"][0], directory)
    head = f"model.layers.{LAYERS}.shared_head.head.weight"
    if change == "head":
        from safetensors.torch import load_file

        _rewrite_weights(directory, add={head: load_file(str(directory / "model.safetensors"))[head] + 1e-3})
    elif change == "missing":
        _rewrite_weights(directory, drop={f"model.layers.{LAYERS}.self_attn.kv_a_layernorm.weight"})
    else:
        cfg = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 2}))
    capsys.readouterr()
    assert convert_hf.main(["import", "--hf-dir", str(directory), "--out", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not (tmp_path / "ck").exists()


def test_weights_without_the_mtp_layers_the_config_calls_for_import_without_them_with_a_note(hf_dirs, tmp_path,
                                                                                           capsys):
    """hf_dirs' configs have num_nextn_predict_layers 1 (DeepseekV3Config's default), their files no
    MTP layer: mtp_num_layers 0, one note; the export then writes num_nextn_predict_layers 0."""
    capsys.readouterr()
    assert convert_hf.main(["import", "--hf-dir", str(hf_dirs["q_lora"]), "--out", str(tmp_path / "ck")]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "multi-token" in line]
    assert notes == [f"megalite: note: num_nextn_predict_layers=1 but the weight files hold no multi-token "
                     f"prediction layer (model.layers.{LAYERS}...): imported without them (mtp_num_layers 0)"], notes
    with pytest.warns(ConversionNote, match="num_nextn_predict_layers=1 but the weight files hold no"):
        config, sd = from_hf(hf_dirs["q_lora"])
    assert config.mtp_num_layers == 0 and not any(k.startswith("mtp.") for k in sd)
    assert to_hf(config, sd).config.num_nextn_predict_layers == 0


@pytest.mark.parametrize("drop,add,words", [
    ("model.layers.2.mlp.experts.7.down_proj.weight", None,
     "the weight files lack model.layers.2.mlp.experts.7.down_proj.weight (each expert's tensors are read"),
    (None, "model.layers.1.mlp.experts.8.down_proj.weight",
     "hold tensors DeepseekV3ForCausalLM does not have: model.layers.1.mlp.experts.8.down_proj.weight"),
])
def test_a_missing_or_extra_expert_tensor_is_refused_naming_it(drop, add, words, hf_dirs, tmp_path, capsys):
    import shutil

    shutil.copytree(hf_dirs["q_lora"], tmp_path / "hf")
    _rewrite_weights(tmp_path / "hf", drop={drop}, add={add: torch.zeros(HIDDEN, MOE_FFN)} if add else None)
    capsys.readouterr()
    assert convert_hf.main(["import", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not (tmp_path / "ck").exists()


def test_settings_megalite_cannot_compute_are_refused_in_one_message(tmp_path, capsys):
    bad = _config(hidden_act="gelu", attention_bias=True, norm_topk_prob=False, topk_group=1,
                  rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    text = "; ".join(deepseek.config_fields(bad)[1])
    for words in ("hidden_act='gelu'", "attention_bias=True", "norm_topk_prob=False with num_experts_per_tok=4",
                  "n_group=4, topk_group=1 with num_experts_per_tok=4", "rope_type 'linear'"):
        assert words in text, text
    with pytest.raises(ConversionError, match="cannot convert DeepseekV3ForCausalLM to megalite: hidden_act='gelu'"):
        from_hf(tf.DeepseekV3ForCausalLM(bad))
    bad.save_pretrained(tmp_path / "hf")  # checked from config.json, before any weight is read
    capsys.readouterr()
    assert convert_hf.main(["import", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "attention_bias=True" in err[0], err
    # the eps of the latent norms: a note, not a refusal
    with pytest.warns(ConversionNote, match="epsilon 1e-06 whatever rms_norm_eps"):
        assert deepseek.config_fields(_config(rms_norm_eps=1e-5))[1] == []


def test_export_refuses_what_deepseek_v3_cannot_hold(hf_dirs):
    config, sd = from_hf(hf_dirs["q_lora"])
    with pytest.raises(ConversionError, match="multi-head latent attention, LlamaForCausalLM none"):
        to_hf(config, sd, architecture="LlamaForCausalLM")
    with pytest.raises(ConversionError, match="has its dense layers first.*moe_layer_freq \\[1, 0, 1\\]"):
        to_hf(config.replace(moe_layer_freq=[1, 0, 1]), sd)
    with pytest.raises(ConversionError, match="moe_router_topk=4 with moe_router_group_topk=1 .*its topk / "
                                              "group_topk = 4 best"):
        to_hf(config.replace(moe_router_num_groups=2, moe_router_group_topk=1), sd)
    with pytest.raises(ConversionError, match="moe_shared_expert_intermediate_size=24 is not a multiple"):
        to_hf(config.replace(moe_shared_expert_intermediate_size=24), sd)
