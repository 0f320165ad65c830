"""Hugging Face interop (megalite.tools.convert_hf): randomly initialised GPT-2 and BERT built from
small transformers configs (nothing downloaded), imported and run at (tp, pp) = (1, 1) and (2, 2)
against the Hugging Face forward, exported back bit for bit, and bad input refused."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

tf = pytest.importorskip("transformers")

from helpers import gather_tp, randomized  # noqa: E402
from megalite import parallel  # noqa: E402
from megalite.models import BERTModel, GPTModel  # noqa: E402
from megalite.testing import run_ranks  # noqa: E402
from megalite.tools import convert_hf  # noqa: E402
from megalite.tools.convert_hf import from_hf, hf_model_kind, model_kind, to_hf  # noqa: E402

VOCAB, HIDDEN, HEADS, LAYERS, POSITIONS, BATCH, SEQ = 300, 64, 4, 4, 64, 2, 24
TOL = 1e-4
HF_CLASS = {"gpt": "GPT2LMHeadModel", "bert": "BertForPreTraining"}


def _gpt2_config(**overrides):
    return tf.GPT2Config(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, n_positions=POSITIONS,
                         bos_token_id=0, eos_token_id=0, **overrides)


def _bert_config(**overrides):
    return tf.BertConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                         max_position_embeddings=POSITIONS, intermediate_size=3 * HIDDEN, layer_norm_eps=1e-7,
                         **overrides)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """{"gpt": dir, "bert": dir}: save_pretrained directories of random fp32 models."""
    torch.manual_seed(0)
    dirs = {}
    for kind, model in (("gpt", tf.GPT2LMHeadModel(_gpt2_config())), ("bert", tf.BertForPreTraining(_bert_config()))):
        dirs[kind] = tmp_path_factory.mktemp(f"hf-{kind}")
        randomized(model, seed=1 if kind == "gpt" else 2).save_pretrained(dirs[kind])
    return dirs


def _load_hf(kind, directory):
    return getattr(tf, HF_CLASS[kind]).from_pretrained(directory, local_files_only=True).eval()


def _inputs():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    types = torch.randint(0, 2, (BATCH, SEQ), generator=gen)
    real = torch.ones(BATCH, SEQ, dtype=torch.bool)
    real[1, SEQ - 5:] = False  # the second sample ends in padding
    return ids, types, real


@torch.no_grad()
def _hf_outputs(kind, hf):
    ids, types, real = _inputs()
    if kind == "gpt":
        return (hf(ids).logits,)
    out = hf(ids, token_type_ids=types, attention_mask=real.long())
    return out.prediction_logits, out.seq_relationship_logits


def _max_err(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# --- import, single device -----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_import_single_device_matches_hf(kind, hf_dirs):
    hf = _load_hf(kind, hf_dirs[kind])
    assert hf_model_kind(hf_dirs[kind]) == hf_model_kind(hf) == kind
    config, sd = from_hf(hf_dirs[kind])
    assert model_kind(sd) == kind
    cls = GPTModel if kind == "gpt" else BERTModel
    model = cls(config, seed=7, device="cpu").eval()
    expected = model.state_dict()
    assert list(sd) == list(expected)
    assert {k: tuple(v.shape) for k, v in sd.items()} == {k: tuple(v.shape) for k, v in expected.items()}
    padded = parallel.pad_vocab_size(VOCAB, 1, config.make_vocab_size_divisible_by)
    assert sd["word_embeddings.weight"].shape[0] == padded > VOCAB
    assert not sd["word_embeddings.weight"][VOCAB:].any()
    model.load_state_dict(sd)

    ids, types, real = _inputs()
    with torch.no_grad():
        ours = model(ids) if kind == "gpt" else model(ids, token_type_ids=types, padding_mask=real)
    ours = (ours,) if kind == "gpt" else ours
    theirs = _hf_outputs(kind, hf)
    assert torch.isinf(ours[0][..., VOCAB:]).all()  # padding columns never win
    assert _max_err(ours[0][..., :VOCAB], theirs[0]) <= TOL
    if kind == "bert":
        assert config.layernorm_position == "post" and config.activation == "gelu"
        assert config.layernorm_epsilon == 1e-7
        assert _max_err(ours[1], theirs[1]) <= TOL


def test_import_gpt2_model_without_lm_head(tmp_path):
    """A GPT2Model (no lm_head; the output layer is the tied word embedding) imports the same way."""
    torch.manual_seed(0)
    lm = randomized(tf.GPT2LMHeadModel(_gpt2_config(n_inner=3 * HIDDEN)), seed=4)
    lm.transformer.save_pretrained(tmp_path)
    assert hf_model_kind(lm.transformer) == hf_model_kind(tmp_path) == "gpt"
    for source in (lm.transformer, tmp_path):
        config, sd = from_hf(source)
        assert config.ffn_hidden_size == 3 * HIDDEN
        reference = from_hf(lm)[1]
        assert all(torch.equal(sd[k], reference[k]) for k in reference)


# --- import, (tp, pp) = (2, 2) through a checkpoint --------------------------------------------------

def _stage_forward(rank, world_size, kind, ckpt_dir, config):
    from megalite import checkpoint

    parallel.initialize_model_parallel(2, 2)
    parallel.model_parallel_manual_seed(1234)  # the attention runs inside the tracked TP stream
    stage = parallel.get_pipeline_model_parallel_rank()
    per_stage = config.num_layers // 2
    cls = GPTModel if kind == "gpt" else BERTModel
    model = cls(config, pre_process=stage == 0, post_process=stage == 1,
                layer_numbers=range(stage * per_stage, (stage + 1) * per_stage), seed=99, device="cpu")
    checkpoint.load_model_weights(ckpt_dir, [model])
    model.eval()
    ids, types, real = _inputs()
    first, last = parallel.get_pipeline_model_parallel_ranks()
    with torch.no_grad():
        if stage == 0:
            hidden = model(ids) if kind == "gpt" else model(ids, token_type_ids=types, padding_mask=real)
            dist.send(hidden.contiguous(), dst=last)
            return None
        hidden = torch.empty(SEQ, BATCH, config.hidden_size)
        dist.recv(hidden, src=first)
        model.set_input_tensor(hidden)
        out = model() if kind == "gpt" else model(padding_mask=real)
    outs = (out,) if kind == "gpt" else out
    logits = gather_tp(outs[0], dim=-1)  # [b, s, padded vocab]: TP shards side by side
    assert torch.isinf(logits[..., VOCAB:]).all()
    return (logits[..., :VOCAB],) + tuple(o.clone() for o in outs[1:])


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_import_tp2_pp2_matches_hf(kind, hf_dirs, tmp_path):
    from megalite import checkpoint

    config, sd = from_hf(hf_dirs[kind])
    checkpoint.save_model_checkpoint(tmp_path / "ckpt", config, kind, sd, iteration=0)
    results = run_ranks(_stage_forward, 4, args=(kind, str(tmp_path / "ckpt"), config), timeout=120)
    assert results[0] is None and results[1] is None
    theirs = _hf_outputs(kind, _load_hf(kind, hf_dirs[kind]))
    for last_stage_rank in (2, 3):  # both TP ranks of the last stage gathered the same logits
        ours = results[last_stage_rank]
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert _max_err(a, b) <= TOL


# --- export ------------------------------------------------------------------------------------

def _assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_to_hf_inverts_from_hf(kind, hf_dirs):
    hf = _load_hf(kind, hf_dirs[kind])
    config, sd = from_hf(hf)
    back = to_hf(config, sd)
    assert type(back).__name__ == HF_CLASS[kind] and not back.training
    _assert_same_weights(hf, back)
    # Unpadded input exports the same; from_hf of the export gives the same megalite tensors.
    unpadded = dict(sd, **{"word_embeddings.weight": sd["word_embeddings.weight"][:VOCAB]})
    _assert_same_weights(hf, to_hf(config, unpadded, kind))
    again = from_hf(back)[1]
    assert all(torch.equal(again[k], sd[k]) for k in sd)


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_cli_import_export_round_trip(kind, hf_dirs, tmp_path, capsys):
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf-out"
    assert convert_hf.main(["import", "--hf-dir", str(hf_dirs[kind]), "--out", str(ckpt)]) == 0
    assert convert_hf.main(["export", "--load", str(ckpt), "--out", str(out)]) == 0
    assert "imported" in capsys.readouterr().out
    reloaded = _load_hf(kind, out)
    assert type(reloaded).__name__ == HF_CLASS[kind]
    _assert_same_weights(_load_hf(kind, hf_dirs[kind]), reloaded)
    a, b = _hf_outputs(kind, reloaded), _hf_outputs(kind, _load_hf(kind, hf_dirs[kind]))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_an_export_that_fails_midway_leaves_nothing_and_one_line(hf_dirs, tmp_path, capsys, monkeypatch):
    """Issue #48: a full disk during export ended in a traceback and left a folder holding config.json
    and no weights. The export is written beside --out and renamed; a failure removes it."""
    import transformers.modeling_utils as hf_saving

    ckpt, out = tmp_path / "ckpt", tmp_path / "hf-out"
    assert convert_hf.main(["import", "--hf-dir", str(hf_dirs["gpt"]), "--out", str(ckpt)]) == 0

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_saving, "safe_save_file", full_disk)  # after config.json, as a disk fills
    capsys.readouterr()
    assert convert_hf.main(["export", "--load", str(ckpt), "--out", str(out)]) == 2
    ours = [x for x in capsys.readouterr().err.splitlines() if x.startswith("megalite:")]  # (and a progress bar)
    assert ours == [f"megalite: error: export into {out} failed (No space left on device); nothing was written there"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no --out, no partial folder
    monkeypatch.undo()
    (out / "keep.txt").parent.mkdir()
    (out / "keep.txt").write_text("mine")
    assert convert_hf.main(["export", "--load", str(ckpt), "--out", str(out)]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"


# --- bad input ---------------------------------------------------------------------------------

def test_unsupported_gpt2_settings_are_refused(tmp_path, capsys):
    model = tf.GPT2LMHeadModel(_gpt2_config(scale_attn_by_inverse_layer_idx=True))
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx=True"):
        from_hf(model)
    model.save_pretrained(tmp_path / "bad")
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx=True"):
        from_hf(tmp_path / "bad")
    assert convert_hf.main(["import", "--hf-dir", str(tmp_path / "bad"), "--out", str(tmp_path / "ck")]) == 2
    assert "megalite: error: cannot convert GPT2LMHeadModel" in capsys.readouterr().err
    assert not (tmp_path / "ck").exists()
    # Every problem in one message.
    several = tf.GPT2LMHeadModel(_gpt2_config(scale_attn_weights=False, reorder_and_upcast_attn=True,
                                              activation_function="relu"))
    with pytest.raises(ValueError) as err:
        from_hf(several)
    for words in ("scale_attn_weights=False", "reorder_and_upcast_attn=True", "activation_function='relu'"):
        assert words in str(err.value)


def test_unsupported_architectures_are_refused(tmp_path):
    masked_lm = tf.BertForMaskedLM(_bert_config())
    with pytest.raises(ValueError, match="unsupported architecture BertForMaskedLM"):
        from_hf(masked_lm)
    masked_lm.save_pretrained(tmp_path / "mlm")
    with pytest.raises(ValueError, match="unsupported architecture BertForMaskedLM"):
        from_hf(tmp_path / "mlm")
    with pytest.raises(ValueError, match="unsupported architecture GPT2DoubleHeadsModel"):
        hf_model_kind(tf.GPT2DoubleHeadsModel(_gpt2_config()))
    with pytest.raises(ValueError, match="type_vocab_size=3"):
        from_hf(tf.BertForPreTraining(_bert_config(type_vocab_size=3)))


def test_to_hf_refuses_what_hf_cannot_hold(hf_dirs):
    config, sd = from_hf(hf_dirs["bert"])
    with pytest.raises(ValueError, match="post-LayerNorm"):
        to_hf(config.replace(layernorm_position="pre"), sd)
    no_heads = {k: v for k, v in sd.items() if not k.startswith(("pooler", "binary_head"))}
    with pytest.raises(ValueError, match="lacks pooler.weight"):
        to_hf(config, no_heads)
