"""Hugging Face interop for the Llama family (megalite.tools.convert_hf): randomly initialised tiny
LlamaForCausalLM (GQA, untied; Llama-3 RoPE scaling; biases), MistralForCausalLM, Qwen2ForCausalLM
(q/k/v biases, tied) and Qwen3ForCausalLM (qk norms) built from transformers configs (nothing
downloaded): tensors mapped both ways bit for bit, imported and run at (tp, pp) = (1, 1), (2, 2)
and (4, 1) (KV groups replicated) against the Hugging Face forward, exported after training at
(2, 2), and bad settings refused."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist

tf = pytest.importorskip("transformers")

from helpers import gather_tp, randomized  # noqa: E402
from megalite import parallel  # noqa: E402
from megalite.models import TransformerConfig  # noqa: E402
from megalite.testing import run_ranks  # noqa: E402
from megalite.parallel.layers import tp_shard  # noqa: E402
from megalite.tools import convert_hf  # noqa: E402
from megalite.tools.convert_hf import ConversionNote, from_hf, hf_model_kind, llama, to_hf  # noqa: E402

VOCAB, HIDDEN, HEADS, GROUPS, FFN, LAYERS, POSITIONS, BATCH, SEQ = 300, 64, 8, 2, 96, 4, 64, 2, 24
HEAD_DIM = HIDDEN // HEADS
TOL = 1e-4
PADDED = 384  # pad_vocab_size(300, 1, 128)


def _common(**overrides):
    return dict(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=GROUPS,
                intermediate_size=FFN, vocab_size=VOCAB, max_position_embeddings=POSITIONS, rms_norm_eps=1e-5,
                bos_token_id=0, eos_token_id=1, pad_token_id=None, **overrides)


# name -> (Hugging Face class, config); each a shape megalite must compute exactly.
FAMILIES = {
    "llama": ("LlamaForCausalLM", lambda: tf.LlamaConfig(**_common(
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))),
    "llama3-rope": ("LlamaForCausalLM", lambda: tf.LlamaConfig(**_common(tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}))),
    "llama-biases": ("LlamaForCausalLM", lambda: tf.LlamaConfig(**_common(
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True))),
    "mistral": ("MistralForCausalLM", lambda: tf.MistralConfig(**_common(tie_word_embeddings=False))),
    "qwen2": ("Qwen2ForCausalLM", lambda: tf.Qwen2Config(**_common(tie_word_embeddings=True))),
    # Qwen3's heads wider than hidden / heads, as the published models' (128 at hidden 2048, 32 heads)
    "qwen3": ("Qwen3ForCausalLM", lambda: tf.Qwen3Config(**_common(tie_word_embeddings=False, head_dim=2 * HEAD_DIM))),
}


def _hf_model(name: str):
    arch, config = FAMILIES[name]
    torch.manual_seed(0)
    return randomized(getattr(tf, arch)(config()), seed=sorted(FAMILIES).index(name) + 1)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """{family: save_pretrained directory of a random fp32 model}."""
    dirs = {}
    for name in FAMILIES:
        dirs[name] = tmp_path_factory.mktemp(f"hf-{name}")
        _hf_model(name).save_pretrained(dirs[name])
    return dirs


def _load_hf(name, directory):
    return getattr(tf, FAMILIES[name][0]).from_pretrained(directory, local_files_only=True).eval()


def _ids():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def _hf_logits(hf):
    return hf(_ids()).logits


def _max_err(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# --- tensors both ways  -----------------------------------------------

@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_tensors_round_trip_bit_for_bit_and_export_rebuilds_the_model(name):
    hf = _hf_model(name)
    fields, problems = llama.config_fields(hf.config, FAMILIES[name][0])
    assert problems == []
    config = TransformerConfig(**fields)
    ours = llama.tensors_from_hf(hf.state_dict(), config, PADDED)
    assert ours["word_embeddings.weight"].shape == (PADDED, HIDDEN) and not ours["word_embeddings.weight"][VOCAB:].any()
    width = getattr(hf.config, "head_dim", None) or HEAD_DIM
    assert config.head_dim == width and (config.kv_channels is None) == (width == HEAD_DIM)
    assert ours["layers.0.attention.q.weight"].shape == (HEADS * width, HIDDEN)
    assert ours["layers.0.attention.kv.weight"].shape == (2 * GROUPS * width, HIDDEN)
    assert ours["layers.0.attention.proj.weight"].shape == (HIDDEN, HEADS * width)
    assert ours["layers.0.mlp.fc1.weight"].shape == (2 * FFN, HIDDEN)
    assert ("output_layer.weight" in ours) == (not hf.config.tie_word_embeddings)
    theirs = hf.state_dict()
    back = llama.tensors_to_hf(ours, config)
    tied = {"lm_head.weight"} if hf.config.tie_word_embeddings else set()
    assert set(back) == set(theirs) - tied
    for key, value in back.items():
        assert torch.equal(value, theirs[key]), key
    # The whole Hugging Face model again: same class, weights, RoPE settings and logits.
    again = to_hf(config, ours, "gpt", architecture=FAMILIES[name][0])
    assert type(again) is type(hf) and not again.training
    assert llama.rope_parameters(again.config) == llama.rope_parameters(hf.config)
    for key, value in again.state_dict().items():
        assert torch.equal(value, theirs[key]), key
    assert torch.equal(_hf_logits(again), _hf_logits(hf))


def test_kv_rows_hold_each_group_k_then_v_and_fc1_holds_gate_then_up():
    hf = _hf_model("llama")
    attn, mlp = hf.model.layers[1].self_attn, hf.model.layers[1].mlp
    config = TransformerConfig(**llama.config_fields(hf.config, "LlamaForCausalLM")[0])
    ours = llama.tensors_from_hf(hf.state_dict(), config, PADDED)
    kv, fc1 = ours["layers.1.attention.kv.weight"], ours["layers.1.mlp.fc1.weight"]
    d = HEAD_DIM
    for g in range(GROUPS):
        assert torch.equal(kv[2 * g * d:(2 * g + 1) * d], attn.k_proj.weight[g * d:(g + 1) * d])
        assert torch.equal(kv[(2 * g + 1) * d:(2 * g + 2) * d], attn.v_proj.weight[g * d:(g + 1) * d])
    assert torch.equal(fc1, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    # So a TP rank's contiguous rows are whole groups (tp 2 here), and its fc1 shard is its half of
    # the gate rows, then its half of the up rows.
    assert torch.equal(kv.chunk(2)[1], torch.cat([attn.k_proj.weight[d:2 * d], attn.v_proj.weight[d:2 * d]]))
    assert torch.equal(tp_shard(fc1, 0, 2, 1, blocks=2),
                       torch.cat([mlp.gate_proj.weight[FFN // 2:], mlp.up_proj.weight[FFN // 2:]]))


def test_hf_settings_map_to_the_agreed_config_fields():
    fields, _ = llama.config_fields(_hf_model("llama3-rope").config, "LlamaForCausalLM")
    assert fields["position_embedding_type"] == "rope" and fields["rotary_base"] == 10000.0
    assert (fields["rope_scaling_factor"], fields["rope_low_freq_factor"], fields["rope_high_freq_factor"],
            fields["rope_original_max_position_embeddings"]) == (8.0, 1.0, 4.0, 16)
    assert fields["num_query_groups"] == GROUPS and fields["ffn_hidden_size"] == FFN
    assert fields["normalization"] == "rmsnorm" and fields["layernorm_epsilon"] == 1e-5
    assert fields["gated_linear_unit"] and fields["activation"] == "silu"
    assert fields["untie_embeddings_and_output_weights"] and not fields["add_bias_linear"]
    qwen2, _ = llama.config_fields(_hf_model("qwen2").config, "Qwen2ForCausalLM")
    assert qwen2["add_qkv_bias"] and not qwen2["add_bias_linear"] and not qwen2["untie_embeddings_and_output_weights"]
    assert "rope_scaling_factor" not in qwen2
    assert llama.config_fields(_hf_model("qwen3").config, "Qwen3ForCausalLM")[0]["qk_layernorm"]
    assert llama.config_fields(_hf_model("llama-biases").config, "LlamaForCausalLM")[0]["add_bias_linear"]
    # Multi-head attention (as many KV heads as heads) still gets separate q and kv.
    mha = tf.LlamaConfig(**{**_common(), "num_key_value_heads": HEADS})
    assert llama.config_fields(mha, "LlamaForCausalLM")[0]["num_query_groups"] == HEADS


def test_a_sliding_window_is_imported_as_megalites_window(tmp_path, capsys):
    """Mistral's sliding_window W is the window (W - 1, 0) in every layer, the positions kept, no note
    (tests/test_sliding_window.py compares the logits); Qwen2's switch off is no window."""
    cfg = tf.MistralConfig(**{**_common(), "sliding_window": 16})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConversionNote)
        fields, problems = llama.config_fields(cfg, "MistralForCausalLM")
        assert problems == [] and fields["max_position_embeddings"] == POSITIONS
        assert (fields["window_size"], fields["window_attn_skip_freq"]) == ((15, 0), None)
        # transformers' MistralConfig windows 4096 tokens unless told otherwise: kept (a longer run would see it)
        assert llama.config_fields(tf.MistralConfig(**_common()), "MistralForCausalLM")[0]["window_size"] == (4095, 0)
        qwen = tf.Qwen2Config(**{**_common(), "sliding_window": 16, "use_sliding_window": False})
        assert "window_size" not in llama.config_fields(qwen, "Qwen2ForCausalLM")[0]
    tf.MistralForCausalLM(cfg).save_pretrained(tmp_path / "mistral")
    capsys.readouterr()
    assert convert_hf.main(["import", "--hf-dir", str(tmp_path / "mistral"), "--out", str(tmp_path / "ck")]) == 0
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("megalite: note:")]


def test_unsupported_llama_settings_are_refused_in_one_message(tmp_path, capsys):
    bad = tf.LlamaConfig(**{**_common(), "hidden_act": "gelu", "attention_bias": True,
                            "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}})
    problems = llama.config_fields(bad, "LlamaForCausalLM")[1]
    text = "; ".join(problems)
    for words in ("hidden_act='gelu'", "attention_bias=True with mlp_bias=False", "rope_type 'dynamic'"):
        assert words in text
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**{**_common(), "hidden_act": "relu"}))
    with pytest.raises(ValueError, match="cannot convert LlamaForCausalLM to megalite: hidden_act='relu'"):
        from_hf(model)
    model.save_pretrained(tmp_path / "bad")
    capsys.readouterr()  # save_pretrained's progress bar
    assert convert_hf.main(["import", "--hf-dir", str(tmp_path / "bad"), "--out", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["megalite: error: cannot convert LlamaForCausalLM to megalite: hidden_act='relu' "
                   "(megalite's gated MLP is SwiGLU: silu)"]
    assert not (tmp_path / "ck").exists()
    qwen3 = tf.Qwen3Config(**_common(head_dim=HEAD_DIM, attention_bias=True))
    qwen3_problems = llama.config_fields(qwen3, "Qwen3ForCausalLM")[1]
    assert "attention_bias=True (Qwen3's biases include o_proj's" in qwen3_problems[0]
    with pytest.raises(ValueError, match="unsupported architecture LlamaForSequenceClassification"):
        hf_model_kind(tf.LlamaForSequenceClassification(tf.LlamaConfig(**_common())))


def test_export_refuses_an_architecture_that_cannot_hold_the_model():
    hf = _hf_model("qwen2")
    config = TransformerConfig(**llama.config_fields(hf.config, "Qwen2ForCausalLM")[0])
    ours = llama.tensors_from_hf(hf.state_dict(), config, PADDED)
    assert type(to_hf(config, ours, "gpt")).__name__ == "Qwen2ForCausalLM"  # chosen by its biases
    with pytest.raises(ValueError, match="MistralForCausalLM cannot hold add_bias_linear=False, add_qkv_bias=True"):
        to_hf(config, ours, "gpt", architecture="MistralForCausalLM")
    with pytest.raises(ValueError, match="exports as GPT2LMHeadModel, LlamaForCausalLM"):
        to_hf(config, ours, "gpt", architecture="BertForPreTraining")
    with pytest.raises(ValueError, match="the state dict lacks layers.0.attention.kv.bias"):
        to_hf(config, {k: v for k, v in ours.items() if k != "layers.0.attention.kv.bias"}, "gpt")


# --- against megalite's model --------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_import_single_device_matches_hf(name, hf_dirs):
    from megalite.models import GPTModel

    hf = _load_hf(name, hf_dirs[name])
    assert hf_model_kind(hf_dirs[name]) == hf_model_kind(hf) == "gpt"
    config, sd = from_hf(hf_dirs[name])
    model = GPTModel(config, seed=7, device="cpu").eval()
    expected = model.state_dict()
    assert list(sd) == list(expected)
    assert {k: tuple(v.shape) for k, v in sd.items()} == {k: tuple(v.shape) for k, v in expected.items()}
    model.load_state_dict(sd)
    with torch.no_grad():
        ours = model(_ids())
    assert torch.isinf(ours[..., VOCAB:]).all()
    assert _max_err(ours[..., :VOCAB], _hf_logits(hf)) <= TOL


def _layout_logits(rank, world_size, tp, pp, runs, cp=1):
    """Each (checkpoint, config) of `runs` loaded at (tp, pp, cp) and run: the last stage's logits
    (TP shards and CP shares gathered, padding cut), None on other stages."""
    from megalite import checkpoint
    from megalite.models import GPTModel
    from megalite.parallel.context_parallel import gather_from_context_parallel, split_for_context_parallel

    parallel.initialize_model_parallel(tp, pp, context_parallel_size=cp)
    parallel.model_parallel_manual_seed(1234)
    stage = parallel.get_pipeline_model_parallel_rank()
    first, last = parallel.get_pipeline_model_parallel_ranks()[0], parallel.get_pipeline_model_parallel_ranks()[-1]
    out = []
    for ckpt_dir, config in runs:
        per_stage = config.num_layers // pp
        model = GPTModel(config, pre_process=stage == 0, post_process=stage == pp - 1,
                         layer_numbers=range(stage * per_stage, (stage + 1) * per_stage), seed=99, device="cpu")
        checkpoint.load_model_weights(ckpt_dir, [model])
        model.eval()
        with torch.no_grad():
            if stage > 0:
                hidden = torch.empty(SEQ // cp, BATCH, config.hidden_size)
                dist.recv(hidden, src=first)
                model.set_input_tensor(hidden)
            ids = split_for_context_parallel(_ids(), 1, parallel.get_context_parallel_rank(), cp)
            result = model(ids if stage == 0 else None)
            if stage < pp - 1:
                dist.send(result.contiguous(), dst=last)
                out.append(None)
                continue
        logits = gather_tp(result, dim=-1)
        if cp > 1:
            shares = [torch.empty_like(logits) for _ in range(cp)]
            dist.all_gather(shares, logits, group=parallel.get_context_parallel_group())
            logits = gather_from_context_parallel(shares, dim=1)
        assert torch.isinf(logits[..., VOCAB:]).all()
        out.append(logits[..., :VOCAB])
    return out


@pytest.mark.parametrize("tp,pp,cp", [(2, 2, 2), (4, 1, 1)])
def test_import_at_other_layouts_matches_hf(tp, pp, cp, hf_dirs, tmp_path):
    """Every family (Qwen3 with heads wider than hidden / heads too) through a checkpoint into
    tp x pp x cp ranks; at tp 4 the 2 KV groups are replicated."""
    from megalite import checkpoint

    runs = []
    for name in sorted(FAMILIES):
        config, sd = from_hf(hf_dirs[name])
        checkpoint.save_model_checkpoint(tmp_path / name, config, "gpt", sd, iteration=0)
        runs.append((str(tmp_path / name), config))
    results = run_ranks(_layout_logits, tp * pp * cp, args=(tp, pp, runs, cp), timeout=240)
    for rank in range(tp * cp * (pp - 1), tp * cp * pp):  # every TP and CP rank of the last stage
        for name, ours in zip(sorted(FAMILIES), results[rank]):
            theirs = _hf_logits(_load_hf(name, hf_dirs[name]))
            assert _max_err(ours, theirs) <= 1e-5 * theirs.abs().max().item(), (name, rank)  # relative 1e-5


# --- export after training ---------------------------------------------------------------------

def _train_flags(config) -> list[str]:
    """The pretrain_gpt.py flags of a megalite config from a Llama (Megatron-LM's names)."""
    flags = ["--num-layers", str(config.num_layers), "--hidden-size", str(config.hidden_size),
             "--num-attention-heads", str(config.num_attention_heads), "--ffn-hidden-size", str(config.ffn_hidden_size),
             "--vocab-size", str(config.vocab_size), "--position-embedding-type", "rope",
             "--rotary-base", str(config.rotary_base), "--swiglu", "--group-query-attention",
             "--num-query-groups", str(config.num_query_groups), "--normalization", "RMSNorm",
             "--norm-epsilon", str(config.layernorm_epsilon), "--disable-bias-linear"]
    if config.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    return flags


def _train(rank, world_size, argv):
    from training_ranks import train_losses

    return train_losses(rank, world_size, argv)


def test_export_after_training_at_tp2_pp2_reloads_with_megalites_logits(hf_dirs, tmp_path):
    from megalite import checkpoint

    imported, trained, exported = tmp_path / "imported", tmp_path / "trained", tmp_path / "hf-out"
    assert convert_hf.main(["import", "--hf-dir", str(hf_dirs["llama"]), "--out", str(imported)]) == 0
    config, _ = from_hf(hf_dirs["llama"])
    argv = ["--mock-data", "--tp", "2", "--pp", "2", "--seq-length", str(SEQ), "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-2", "--lr-warmup-iters", "0",
            "--log-interval", "1", "--eval-interval", "0", "--load", str(imported), "--save", str(trained),
            *_train_flags(config)]
    losses = run_ranks(_train, 4, args=(argv,), timeout=240)
    assert all(len(losses[rank]) == 3 and all(map(math.isfinite, losses[rank])) for rank in (2, 3))
    trained_config = checkpoint.load_full_state_dict(trained)[0]
    for field in ("rotary_base", "num_query_groups", "layernorm_epsilon", "untie_embeddings_and_output_weights",
                  "add_bias_linear", "gated_linear_unit"):
        assert getattr(trained_config, field) == getattr(config, field), field
    assert convert_hf.main(["export", "--load", str(trained), "--out", str(exported)]) == 0
    hf = tf.AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    # Trained from the imported weights: moved, but by a few learning-rate steps only.
    moved = (hf.model.layers[0].self_attn.k_proj.weight - _load_hf("llama", hf_dirs["llama"]).model.layers[0]
             .self_attn.k_proj.weight).abs().max().item()
    assert 0 < moved < 0.1
    results = run_ranks(_layout_logits, 4, args=(2, 2, [(str(trained), trained_config)]), timeout=240)
    for rank in (2, 3):
        assert _max_err(results[rank][0], _hf_logits(hf)) <= TOL


def test_a_directory_without_weights_or_with_a_broken_rope_config_is_one_line(tmp_path, capsys):
    import json

    from megalite.tools.convert_hf.cli import main

    cfg = tf.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=100)
    cfg.save_pretrained(tmp_path / "no-weights")
    assert main(["import", "--hf-dir", str(tmp_path / "no-weights"), "--out", str(tmp_path / "o1")]) == 2
    assert "cannot read the LlamaForCausalLM weights" in capsys.readouterr().err
    cfg.save_pretrained(tmp_path / "rope")
    raw = json.loads((tmp_path / "rope" / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}  # low/high frequency factors missing
    (tmp_path / "rope" / "config.json").write_text(json.dumps(raw))
    assert main(["import", "--hf-dir", str(tmp_path / "rope"), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "low_freq_factor" in err, err


class _NotATensor:  # a pickled object a weights-only load refuses
    pass


@pytest.mark.parametrize("damage, message", [
    ("fewer-layers", r"the weight files hold tensors LlamaForCausalLM with this config.json does not have: "
                     r"model\.layers\.2\."),
    ("extra", r"does not have: model\.extra\.weight \(a config of another model"),
    ("shape", r"the weight files' shapes contradict config.json: model\.layers\.0\.mlp\.up_proj\.weight "
              r"\(97, 64\) \(the config makes \(96, 64\)\)"),
    ("nan", r"the weights hold NaN or inf in model\.layers\.1\.mlp\.down_proj\.weight \(damaged files"),
    ("pickle", r"cannot read the LlamaForCausalLM weights in .*: \w+Error: .* \(megalite reads safetensors, or "
               r"pytorch_model\.bin files that hold tensors only\)"),
])
def test_an_import_whose_files_contradict_their_config_is_one_line(hf_dirs, tmp_path, capsys, damage, message):
    """Issue #34: a config with fewer layers than the weights, unknown extra tensors, a size mismatch,
    NaN weights and a pickle holding more than tensors each end in one line (exit 2), nothing written."""
    import json
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    from megalite.tools.convert_hf.cli import main

    d = tmp_path / "hf"
    shutil.copytree(hf_dirs["llama"], d)
    weights = load_file(d / "model.safetensors")
    if damage == "fewer-layers":
        raw = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 2}))
    elif damage == "extra":
        weights["model.extra.weight"] = torch.zeros(3)
    elif damage == "shape":
        weights["model.layers.0.mlp.up_proj.weight"] = torch.zeros(FFN + 1, HIDDEN)
    elif damage == "nan":
        weights["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    if damage == "pickle":
        (d / "model.safetensors").unlink()
        torch.save({**weights, "note": _NotATensor()}, d / "pytorch_model.bin")
    else:
        save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["import", "--hf-dir", str(d), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("megalite: error:")]
    assert len(lines) == 1 and re.search(message, lines[0]), err
    assert not (tmp_path / "out").exists()
