"""Hugging Face interop for the mixture-of-experts families (megalite.tools.convert_hf.moe): randomly
initialised tiny MixtralForCausalLM, Qwen2MoeForCausalLM (shared expert and its sigmoid gate, a dense
layer, q/k/v biases, tied), Qwen3MoeForCausalLM (per-head qk norms, a dense layer, renormalised
top-k) and OlmoeForCausalLM (qk norms over the whole projection) built from transformers configs
(nothing downloaded), 3 layers, 4 or 8 experts, top-2, fp32: the same logits in megalite; the export
written with every expert, reloading with nothing missing and the same logits; the routing variants
mapped exactly; a missing or extra expert tensor refused by name; OLMoE's full-width qk norm at
tp 2 equal to one device."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

tf = pytest.importorskip("transformers")

from helpers import gather_tp, randomized  # noqa: E402
from megalite import parallel  # noqa: E402
from megalite.models import GPTModel, TransformerConfig  # noqa: E402
from megalite.models.moe.router import route  # noqa: E402
from megalite.testing import run_ranks  # noqa: E402
from megalite.tools import convert_hf  # noqa: E402
from megalite.tools.convert_hf import (ConversionError, ConversionNote, from_hf, hf_model_kind,  # noqa: E402
                                       moe, to_hf)

VOCAB, HIDDEN, HEADS, GROUPS, FFN, MOE_FFN, SHARED = 96, 32, 4, 2, 40, 24, 16
LAYERS, POSITIONS, BATCH, SEQ = 3, 32, 2, 12
TOL = 1e-4  # relative to the largest logit


def _common(**overrides):
    return dict(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=GROUPS,
                vocab_size=VOCAB, max_position_embeddings=POSITIONS, rms_norm_eps=1e-5, num_experts_per_tok=2,
                bos_token_id=0, eos_token_id=1, pad_token_id=None, **overrides)


# name -> (Hugging Face class, config, experts, MoE layers)
FAMILIES = {
    "mixtral": ("MixtralForCausalLM", lambda: tf.MixtralConfig(**_common(
        num_local_experts=4, intermediate_size=MOE_FFN)), 4, [1, 1, 1]),
    "qwen2_moe": ("Qwen2MoeForCausalLM", lambda: tf.Qwen2MoeConfig(**_common(
        num_experts=4, intermediate_size=FFN, moe_intermediate_size=MOE_FFN, shared_expert_intermediate_size=SHARED,
        mlp_only_layers=[1], tie_word_embeddings=True)), 4, [1, 0, 1]),
    "qwen3_moe": ("Qwen3MoeForCausalLM", lambda: tf.Qwen3MoeConfig(**_common(
        num_experts=4, intermediate_size=FFN, moe_intermediate_size=MOE_FFN, mlp_only_layers=[0], norm_topk_prob=True,
        head_dim=2 * HIDDEN // HEADS)), 4, [0, 1, 1]),  # heads wider than hidden / heads, as Qwen3-MoE's
    "olmoe": ("OlmoeForCausalLM", lambda: tf.OlmoeConfig(**_common(num_experts=8, intermediate_size=MOE_FFN)), 8,
              [1, 1, 1]),
}


def _hf_model(name: str, config=None):
    arch, make_config, _, _ = FAMILIES[name]
    torch.manual_seed(0)
    model = randomized(getattr(tf, arch)(config or make_config()), seed=sorted(FAMILIES).index(name) + 1)
    with torch.no_grad():  # routers sharper than at init, so that the routing variant matters
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "weight"):
                layer.mlp.gate.weight.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """{family: save_pretrained directory of a random fp32 model}."""
    dirs = {}
    for name in FAMILIES:
        dirs[name] = tmp_path_factory.mktemp(f"hf-{name}")
        _hf_model(name).save_pretrained(dirs[name])
    return dirs


def _ids():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def _hf_logits(hf):
    return hf(_ids()).logits


def _rel_err(ours, theirs) -> float:
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


@torch.no_grad()
def _megalite_logits(config, sd):
    model = GPTModel(config, seed=7, device="cpu").eval()
    model.load_state_dict(sd)
    return model(_ids())[..., :VOCAB]


def _stored(directory) -> dict[str, tuple]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def _expert_names(name: str, layer: int, experts: int) -> list[str]:
    """The per-expert tensors a released checkpoint (and save_pretrained) holds for one MoE layer."""
    if name == "mixtral":
        block, leaves = f"model.layers.{layer}.block_sparse_moe", ("w1", "w2", "w3")
    else:
        block, leaves = f"model.layers.{layer}.mlp", ("gate_proj", "up_proj", "down_proj")
    return [f"{block}.experts.{e}.{leaf}.weight" for e in range(experts) for leaf in leaves]


# --- import and export, per family ---------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_import_matches_hf_and_export_writes_every_expert_and_reloads(name, hf_dirs, tmp_path):
    arch, _, experts, moe_layers = FAMILIES[name]
    hf = getattr(tf, arch).from_pretrained(hf_dirs[name], local_files_only=True).eval()
    assert hf_model_kind(hf_dirs[name]) == "gpt"
    config, sd = from_hf(hf_dirs[name])
    assert config.num_moe_experts == experts and config.moe_layer_freq == moe_layers
    assert list(sd) == list(GPTModel(config, seed=7, device="cpu").state_dict())
    first_moe = moe_layers.index(1)
    assert sd[f"layers.{first_moe}.mlp.experts.fc1_weight"].shape == (experts, 2 * MOE_FFN, HIDDEN)
    theirs = _hf_logits(hf)
    assert _rel_err(_megalite_logits(config, sd), theirs) <= TOL

    exported = to_hf(config, sd)
    assert type(exported).__name__ == arch
    exported.save_pretrained(tmp_path / "out")
    stored = _stored(tmp_path / "out")
    for layer, is_moe in enumerate(moe_layers):  # every expert, as its own tensors, in the shapes released
        names = _expert_names(name, layer, experts)
        if not is_moe:
            assert not any(n in stored for n in names)
            continue
        assert all(n in stored for n in names), sorted(set(names) - set(stored))
        down = [n for n in names if n.endswith(("w2.weight", "down_proj.weight"))]
        assert {stored[n] for n in down} == {(HIDDEN, MOE_FFN)}
    assert sum(".experts." in k for k in stored) == 3 * experts * sum(moe_layers)
    again, info = getattr(tf, arch).from_pretrained(tmp_path / "out", local_files_only=True, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}  # nothing missing, unexpected or re-initialised
    for key, value in hf.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    assert torch.equal(_hf_logits(again.eval()), theirs)


def test_cli_round_trip_through_a_checkpoint(hf_dirs, tmp_path):
    """import, then export of a checkpoint: the Qwen2-MoE (shared expert, a dense layer, tied) back bit for bit."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    assert convert_hf.main(["import", "--hf-dir", str(hf_dirs["qwen2_moe"]), "--out", str(ckpt)]) == 0
    assert convert_hf.main(["export", "--load", str(ckpt), "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2MoeForCausalLM"]
    assert _stored(out).keys() == _stored(hf_dirs["qwen2_moe"]).keys()
    original = tf.Qwen2MoeForCausalLM.from_pretrained(hf_dirs["qwen2_moe"], local_files_only=True)
    again = tf.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    for key, value in original.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    # What --load reads: the experts one tensor each, into the model as it is built.
    from megalite import checkpoint

    config, _ = from_hf(hf_dirs["qwen2_moe"])
    model = GPTModel(config, seed=7, device="cpu")
    checkpoint.load_model_weights(ckpt, [model])
    with torch.no_grad():
        assert _rel_err(model.eval()(_ids())[..., :VOCAB], _hf_logits(original.eval())) <= TOL


# --- routing and the config ----------------------------------------------------------------------

def test_hugging_faces_routing_variants_are_megalites_routers():
    """softmax over all experts then top-k, renormalised: megalite's default (top-k logits, then a
    softmax); not renormalised: moe_router_pre_softmax."""
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) * 3
    probs = torch.softmax(logits, dim=-1)
    top, indices = probs.topk(2, dim=-1)
    for renormalised in (True, False):
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=8,
                                   moe_router_pre_softmax=not renormalised)
        weights, chosen, _ = route(logits, config)
        assert torch.equal(chosen, indices)
        expected = top / top.sum(-1, keepdim=True) if renormalised else top
        assert (weights - expected).abs().max().item() < 1e-6
    assert (top.sum(-1) - 1).abs().max().item() > 0.1  # so the two variants differ here


def test_hf_settings_map_to_the_moe_config_fields():
    fields = {name: moe.config_fields(FAMILIES[name][1](), FAMILIES[name][0])[0] for name in FAMILIES}
    assert not fields["mixtral"]["moe_router_pre_softmax"]  # Mixtral renormalises always
    assert fields["qwen2_moe"]["moe_router_pre_softmax"] and fields["olmoe"]["moe_router_pre_softmax"]
    assert not fields["qwen3_moe"]["moe_router_pre_softmax"]  # norm_topk_prob=True
    q2 = fields["qwen2_moe"]
    assert (q2["moe_shared_expert_intermediate_size"], q2["moe_shared_expert_gate"], q2["add_qkv_bias"]) == (
        SHARED, True, True)
    assert (q2["ffn_hidden_size"], q2["moe_ffn_hidden_size"]) == (FFN, MOE_FFN)
    assert (fields["mixtral"]["ffn_hidden_size"], fields["mixtral"]["moe_ffn_hidden_size"]) == (MOE_FFN, MOE_FFN)
    assert fields["qwen3_moe"]["qk_layernorm"] and not fields["qwen3_moe"]["qk_layernorm_full_width"]
    assert fields["olmoe"]["qk_layernorm"] and fields["olmoe"]["qk_layernorm_full_width"]
    # decoder_sparse_step: layers whose number + 1 it divides, less mlp_only_layers
    sparse = tf.Qwen2MoeConfig(**{**_common(num_experts=4), "num_hidden_layers": 6, "decoder_sparse_step": 2,
                                  "mlp_only_layers": [5]})
    assert moe.config_fields(sparse, "Qwen2MoeForCausalLM")[0]["moe_layer_freq"] == [0, 1, 0, 1, 0, 0]
    # The balancing loss: Hugging Face's is on with output_router_logits; the coefficient is kept either way.
    off = fields["mixtral"]
    assert (off["moe_router_load_balancing_type"], off["moe_aux_loss_coeff"]) == ("none", 0.001)
    on, sd = from_hf(_hf_model("olmoe", tf.OlmoeConfig(**_common(
        num_experts=8, intermediate_size=MOE_FFN, output_router_logits=True, router_aux_loss_coef=0.02))))
    assert (on.moe_router_load_balancing_type, on.moe_aux_loss_coeff) == ("aux_loss", 0.02)
    hf = to_hf(on, sd)
    assert (hf.config.output_router_logits, hf.config.router_aux_loss_coef) == (True, 0.02)


def test_mixtrals_sliding_window_is_the_window_and_router_jitter_a_note():
    """Mixtral windows every layer (no use_sliding_window switch); its jitter only acts in training."""
    windowed = tf.MixtralConfig(**_common(num_local_experts=4, sliding_window=16, router_jitter_noise=0.1))
    with pytest.warns(ConversionNote) as notes:
        fields, problems = moe.config_fields(windowed, "MixtralForCausalLM")
    assert problems == [] and fields["max_position_embeddings"] == POSITIONS
    assert (fields["window_size"], fields["window_attn_skip_freq"]) == ((15, 0), None)
    assert [str(n.message) for n in notes if "--moe-input-jitter-eps" in str(n.message)] and len(notes) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConversionNote)  # Qwen2-MoE's window off (stored as 0): no window
        assert "window_size" not in moe.config_fields(FAMILIES["qwen2_moe"][1](), "Qwen2MoeForCausalLM")[0]


def test_the_other_routing_variant_gives_other_logits(hf_dirs):
    """The mapping is what makes the logits equal: OLMoE's probabilities with renormalisation are off."""
    config, sd = from_hf(hf_dirs["olmoe"])
    theirs = _hf_logits(tf.OlmoeForCausalLM.from_pretrained(hf_dirs["olmoe"], local_files_only=True).eval())
    assert _rel_err(_megalite_logits(config, sd), theirs) <= TOL
    assert _rel_err(_megalite_logits(config.replace(moe_router_pre_softmax=False), sd), theirs) > 100 * TOL


# --- refusals ------------------------------------------------------------------------------------

def _rewrite_weights(directory, drop=(), add=None):
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = {k: v for k, v in load_file(str(path)).items() if k not in drop}
    save_file({**tensors, **(add or {})}, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("name,missing", [
    ("mixtral", "model.layers.1.block_sparse_moe.experts.3.w2.weight"),
    ("qwen3_moe", "model.layers.1.mlp.experts.3.down_proj.weight"),
])
def test_a_file_missing_an_expert_tensor_is_refused_naming_it(name, missing, tmp_path, capsys):
    _hf_model(name).save_pretrained(tmp_path / "hf")
    _rewrite_weights(tmp_path / "hf", drop={missing})
    capsys.readouterr()
    assert convert_hf.main(["import", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"the weight files lack {missing} (each expert's tensors are read" in err[0], err
    assert FAMILIES[name][0] in err[0] and not (tmp_path / "ck").exists()


@pytest.mark.parametrize("name,wrong", [
    ("mixtral", "model.layers.1.block_sparse_moe.experts.3.w1.weight"),
    ("qwen3_moe", "model.layers.1.mlp.experts.3.down_proj.weight"),
])
def test_an_expert_tensor_of_the_wrong_shape_is_one_line_naming_it(name, wrong, tmp_path, capsys):
    """Issue #48: it gave transformers' report and a line naming no tensor."""
    _hf_model(name).save_pretrained(tmp_path / "hf")
    _rewrite_weights(tmp_path / "hf", drop={wrong}, add={wrong: torch.zeros(3, 5)})
    capsys.readouterr()
    assert convert_hf.main(["import", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and f"expert shapes contradict config.json: {wrong} (3, 5) (the config makes" in err[0], err
    assert not captured.out and not (tmp_path / "ck").exists()


def test_a_config_field_of_the_wrong_type_is_one_line(tmp_path, capsys):
    """Issue #48: routed_scaling_factor 0 (an int) ended in transformers' validation traceback."""
    import json

    _hf_model("qwen3_moe").save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["rms_norm_eps"] = "tiny"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert convert_hf.main(["import", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.json cannot be read by transformers:" in err[0] and "rms_norm_eps" in err[0], err


def test_an_extra_expert_tensor_is_refused_and_fused_experts_on_disk_are_read(tmp_path):
    hf = _hf_model("qwen3_moe")
    hf.save_pretrained(tmp_path / "hf")
    extra = "model.layers.2.mlp.experts.4.down_proj.weight"
    _rewrite_weights(tmp_path / "hf", add={extra: torch.zeros(HIDDEN, MOE_FFN)})
    with pytest.raises(ConversionError, match=f"hold tensors Qwen3MoeForCausalLM does not have: {extra}"):
        from_hf(tmp_path / "hf")
    # The layout transformers holds in memory (fused experts), stored as it is, reads too.
    (tmp_path / "fused").mkdir()
    hf.config.save_pretrained(tmp_path / "fused")
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "fused" / "model.safetensors"),
              metadata={"format": "pt"})
    config, sd = from_hf(tmp_path / "fused")
    assert _rel_err(_megalite_logits(config, sd), _hf_logits(hf)) <= TOL


def test_unsupported_moe_settings_are_refused_in_one_message():
    bad = tf.OlmoeConfig(**_common(num_experts=8, hidden_act="gelu", clip_qkv=8.0, attention_bias=True))
    text = "; ".join(moe.config_fields(bad, "OlmoeForCausalLM")[1])
    for words in ("hidden_act='gelu'", "clip_qkv=8.0", "attention_bias=True"):
        assert words in text
    with pytest.raises(ValueError, match="cannot convert OlmoeForCausalLM to megalite: hidden_act='gelu'"):
        from_hf(tf.OlmoeForCausalLM(bad))


def test_export_refuses_an_architecture_that_cannot_hold_the_model(hf_dirs):
    config, sd = from_hf(hf_dirs["qwen3_moe"])  # a dense first layer, per-head qk norms
    with pytest.raises(ValueError, match="MixtralForCausalLM cannot hold qk norm=per head, dense layers=True "
                                         r"\(choose the architecture Qwen3MoeForCausalLM\)"):
        to_hf(config, sd, architecture="MixtralForCausalLM")
    with pytest.raises(ValueError, match="this model has experts, LlamaForCausalLM none"):
        to_hf(config, sd, architecture="LlamaForCausalLM")
    nowhere = config.replace(qk_layernorm=False, moe_router_pre_softmax=True)
    unnormed = {k: v for k, v in sd.items() if "_norm." not in k}
    with pytest.raises(ValueError, match="no Hugging Face MoE class here holds it"):
        to_hf(nowhere, unnormed)
    dense = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                              position_embedding_type="rope", gated_linear_unit=True, activation="silu",
                              normalization="rmsnorm", add_bias_linear=False)
    with pytest.raises(ValueError, match="MixtralForCausalLM has experts, this model none"):
        to_hf(dense, GPTModel(dense, seed=0, device="cpu").state_dict(), architecture="MixtralForCausalLM")
    with pytest.raises(ValueError, match="qk_layernorm_full_width needs qk_layernorm=True"):
        TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, qk_layernorm_full_width=True)


# --- OLMoE's full-width qk norm under tensor parallelism -----------------------------------------

def _tp2_logits_and_grads(rank, world_size, runs):
    """Each (checkpoint, config) at tp 2 with sequence parallelism: the logits and the attention's
    weight gradients of the mean loss, gathered to full tensors (qk-norm weights summed over TP)."""
    import torch.distributed as dist

    from megalite import checkpoint

    parallel.initialize_model_parallel(2, 1)
    parallel.model_parallel_manual_seed(1234)
    out = []
    for ckpt_dir, config in runs:
        model = GPTModel(config.replace(sequence_parallel=True), seed=99, device="cpu")
        checkpoint.load_model_weights(ckpt_dir, [model])
        model.eval()
        with torch.no_grad():
            logits = gather_tp(model(_ids()), dim=-1)[..., :VOCAB]
        model(_ids(), labels=_labels()).mean().backward()
        attn = model.layers[1].attention
        norms = {}
        for what in ("q_norm", "k_norm"):
            grad = getattr(attn, what).weight.grad.clone()
            dist.all_reduce(grad, group=parallel.get_tensor_model_parallel_group())
            norms[what] = grad
        out.append((logits, gather_tp(attn.q.weight.grad, 0), gather_tp(attn.kv.weight.grad, 0), norms))
    return out


def _labels():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))


def test_full_width_qk_norm_at_tp2_equals_one_device(hf_dirs, tmp_path):
    """Whole key groups per rank (2 groups) and one group replicated on both ranks (1 group)."""
    runs, expected = [], []
    for groups in (2, 1):
        hf = _hf_model("olmoe", tf.OlmoeConfig(**{**_common(num_experts=8, intermediate_size=MOE_FFN),
                                                 "num_key_value_heads": groups}))
        hf.save_pretrained(tmp_path / f"hf{groups}")
        ckpt = tmp_path / f"ckpt{groups}"
        assert convert_hf.main(["import", "--hf-dir", str(tmp_path / f"hf{groups}"), "--out", str(ckpt)]) == 0
        config, sd = from_hf(hf)
        runs.append((str(ckpt), config))
        model = GPTModel(config, seed=7, device="cpu").eval()
        model.load_state_dict(sd)
        model(_ids(), labels=_labels()).mean().backward()
        attn = model.layers[1].attention
        expected.append((_hf_logits(hf), attn.q.weight.grad, attn.kv.weight.grad,
                         {"q_norm": attn.q_norm.weight.grad, "k_norm": attn.k_norm.weight.grad}))
    results = run_ranks(_tp2_logits_and_grads, 2, args=(runs,), timeout=240)
    for rank in (0, 1):
        for (logits, q, kv, norms), (hf_logits, q1, kv1, norms1) in zip(results[rank], expected):
            assert _rel_err(logits, hf_logits) <= TOL
            for ours, one in [(q, q1), (kv, kv1), *((norms[k], norms1[k]) for k in norms1)]:
                assert _rel_err(ours, one) <= 1e-4


def _tp2_cp2_logits(rank, world_size, ckpt_dir, config):
    """A checkpoint at tp 2 (with SP) x cp 2: the logits, TP shards and CP shares gathered, padding cut."""
    import torch.distributed as dist

    from megalite import checkpoint
    from megalite.parallel.context_parallel import gather_from_context_parallel, split_for_context_parallel

    parallel.initialize_model_parallel(2, 1, context_parallel_size=2)
    model = GPTModel(config.replace(sequence_parallel=True), seed=99, device="cpu")  # MoE at tp > 1 needs SP
    checkpoint.load_model_weights(ckpt_dir, [model])
    with torch.no_grad():
        ids = split_for_context_parallel(_ids(), 1, parallel.get_context_parallel_rank(), 2)
        logits = gather_tp(model.eval()(ids), dim=-1)
    shares = [torch.empty_like(logits) for _ in range(2)]
    dist.all_gather(shares, logits, group=parallel.get_context_parallel_group())
    return gather_from_context_parallel(shares, dim=1)[..., :VOCAB]


def test_qwen3_moe_with_wide_heads_matches_hf_at_tp2_cp2(hf_dirs, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert convert_hf.main(["import", "--hf-dir", str(hf_dirs["qwen3_moe"]), "--out", str(ckpt)]) == 0
    config, _ = from_hf(hf_dirs["qwen3_moe"])
    assert config.kv_channels == 2 * HIDDEN // HEADS  # heads wider than hidden / heads
    expected = _hf_logits(tf.AutoModelForCausalLM.from_pretrained(hf_dirs["qwen3_moe"], local_files_only=True).eval())
    for logits in run_ranks(_tp2_cp2_logits, 4, args=(str(ckpt), config), timeout=240):
        assert _rel_err(logits, expected) <= TOL


# --- training an imported checkpoint ------------------------------------------------------------

def _train_from(rank, world_size, argvs):
    from training_ranks import train_losses

    return [train_losses(rank, world_size, argv) for argv in argvs]


@pytest.mark.parametrize("name", ["mixtral", "olmoe"])
def test_an_imported_checkpoint_trains_from_load_alone_at_ep1_and_ep2_alike(name, hf_dirs, tmp_path):
    """--load with no model flags: the shape, the experts and the router (and OLMoE's full-width qk
    norm) come from the imported checkpoint, which has no run configuration of its own."""
    ckpt = tmp_path / "ckpt"
    assert convert_hf.main(["import", "--hf-dir", str(hf_dirs[name]), "--out", str(ckpt)]) == 0
    argv = ["--mock-data", "--load", str(ckpt), "--no-load-optim", "--train-iters", "2", "--log-interval", "1",
            "--global-batch-size", "4", "--micro-batch-size", "2", "--eval-interval", "0", "--lr", "1e-3"]
    one = run_ranks(_train_from, 1, args=([argv],))[0][0]
    two = run_ranks(_train_from, 2, args=([argv + ["--ep", "2"]],))[0][0]
    assert len(one) == 2 and abs(one[0] - 4.56) < 1.0, one  # about ln(vocabulary 96) from random weights
    assert max(abs(a - b) / abs(b) for a, b in zip(two, one)) <= 1e-5, (two, one)
