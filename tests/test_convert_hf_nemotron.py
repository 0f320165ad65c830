"""Hugging Face interop for NVIDIA's Nemotron family (NemotronForCausalLM: squared-ReLU MLPs,
zero-centred LayerNorms with biases, rope on half of each head, grouped-query attention): a random
tiny model imported with Hugging Face's logits (each of the three settings moving them when changed),
through save_pretrained files and the CLI, trained at tp 2 from the imported checkpoint as at tp 1, a
model of Megatron-LM's Nemotron flags exported back with the same logits, and bad settings refused."""
from __future__ import annotations

import pytest
import torch

tf = pytest.importorskip("transformers")

from helpers import randomized, rel_err  # noqa: E402
from megalite.models import GPTModel  # noqa: E402
from megalite.testing import run_ranks  # noqa: E402
from megalite.tools import convert_hf  # noqa: E402
from megalite.tools.convert_hf import ConversionError, from_hf, nemotron, to_hf  # noqa: E402
from training_ranks import parse, train_losses as losses  # noqa: E402

VOCAB = 128


def _hf_model(**changes):
    config = tf.NemotronConfig(**{**dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=96, vocab_size=VOCAB,
                                         max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
                                         pad_token_id=None), **changes})
    torch.manual_seed(0)
    return randomized(tf.NemotronForCausalLM(config), seed=3)


def _ids():
    return torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _ours(config, state):
    model = GPTModel(config, seed=0, device="cpu").eval()
    model.load_state_dict(state)
    return model(_ids())[..., :VOCAB]


@pytest.mark.parametrize("changes", [{}, dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
                                     dict(num_key_value_heads=4)], ids=["default", "biases-tied", "mha"])
def test_import_gives_hugging_faces_logits_and_every_setting_matters(changes):
    hf = _hf_model(**changes)
    config, state = from_hf(hf)
    assert (config.activation, config.layernorm_zero_centered_gamma, config.rotary_percent) == ("squared_relu", True,
                                                                                                  0.5)
    with torch.no_grad():
        want = hf(_ids()).logits
    assert rel_err(_ours(config, state), want) <= 1e-5
    for wrong in (dict(rotary_percent=1.0), dict(layernorm_zero_centered_gamma=False), dict(activation="gelu")):
        assert rel_err(_ours(config.replace(**wrong), state), want) > 1e-2, wrong
    back = to_hf(config, state)  # and back: every tensor and the logits as they were
    assert isinstance(back, tf.NemotronForCausalLM)
    theirs = dict(hf.state_dict())
    assert all(torch.equal(t, theirs[k]) for k, t in back.state_dict().items())
    with torch.no_grad():
        assert torch.equal(back(_ids()).logits, want)


def test_the_cli_import_trains_at_tp2_as_at_tp1_and_exports_back(tmp_path, monkeypatch):
    """Heads wider than hidden / heads (Minitron's): --load without flags builds the imported model."""
    from megalite.config import model_config
    from megalite.training.checkpoint_shape import adopt_checkpoint_shape

    hf = _hf_model(head_dim=32)
    hf.save_pretrained(tmp_path / "hf")
    assert convert_hf.main(["import", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 0
    monkeypatch.setenv("WORLD_SIZE", "1")
    adopted = model_config(adopt_checkpoint_shape(parse(["--load", str(tmp_path / "ck"), "--mock-data"])))
    imported, _ = from_hf(hf)
    for name in ("kv_channels", "activation", "layernorm_zero_centered_gamma", "rotary_percent", "normalization",
                 "num_query_groups", "gated_linear_unit", "untie_embeddings_and_output_weights", "layernorm_epsilon"):
        assert getattr(adopted, name) == getattr(imported, name), name
    run = ["--load", str(tmp_path / "ck"), "--mock-data", "--seq-length", "16", "--global-batch-size", "4",
           "--micro-batch-size", "2", "--train-iters", "2", "--log-interval", "1", "--eval-iters", "0"]
    [one] = run_ranks(losses, 1, args=(run,))
    for got in run_ranks(losses, 2, args=(run + ["--tp", "2", "--sequence-parallel"],)):
        assert rel_err(torch.tensor(got), torch.tensor(one)) <= 1e-5
    assert convert_hf.main(["export", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "back")]) == 0
    again = tf.NemotronForCausalLM.from_pretrained(tmp_path / "back", local_files_only=True).eval()
    with torch.no_grad():
        assert rel_err(again(_ids()).logits, hf(_ids()).logits) <= 1e-6


def test_a_model_of_megatron_lms_nemotron_flags_exports_as_nemotron():
    from megalite.config import model_config

    config = model_config(parse(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                 "--ffn-hidden-size", "96", "--vocab-size", str(VOCAB), "--seq-length", "32",
                                 "--position-embedding-type", "rope", "--rotary-percent", "0.5",
                                 "--normalization", "LayerNorm", "--apply-layernorm-1p", "--squared-relu",
                                 "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
                                 "--untie-embeddings-and-output-weights", "--mock-data"]))
    model = randomized(GPTModel(config, seed=0, device="cpu"), seed=4)
    hf = to_hf(config, model.state_dict())
    assert isinstance(hf, tf.NemotronForCausalLM) and hf.config.rope_parameters["partial_rotary_factor"] == 0.5
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(hf(ids).logits, model(ids)[..., :VOCAB]) <= 1e-5


def test_what_nemotron_cannot_hold_is_refused_in_one_line():
    from megalite.models.presets import preset

    with pytest.raises(ConversionError, match="hidden_act='gelu'"):
        from_hf(_hf_model(hidden_act="gelu"))
    with pytest.raises(ConversionError, match="attention_bias=True with mlp_bias=False"):
        from_hf(_hf_model(attention_bias=True))
    gated = preset("llama-tiny", activation="squared_relu")  # squared ReLU in a gated MLP: no Hugging Face class
    with pytest.raises(ConversionError, match="gated_linear_unit=False"):
        to_hf(gated, GPTModel(gated, seed=0, device="cpu").state_dict())
    one_p = preset("llama-tiny", layernorm_zero_centered_gamma=True)  # zero-centred RMSNorm in a Llama
    with pytest.raises(ConversionError, match="zero-centred"):
        to_hf(one_p, GPTModel(one_p, seed=0, device="cpu").state_dict())
    llama4 = preset("llama-tiny", qk_l2_norm=True)  # no class here holds Llama 4's norm: not dropped silently
    with pytest.raises(ConversionError, match="--qk-l2-norm"):
        to_hf(llama4, GPTModel(llama4, seed=0, device="cpu").state_dict())
    assert nemotron.ARCHITECTURES == ("NemotronForCausalLM",) and "NemotronForCausalLM" in convert_hf.SUPPORTED
