"""BERTModel: TP = 2 and 4 equal TP = 1 from the same seed (weights, MLM and binary logits and
losses, every gradient), pre- and post-LayerNorm; a pipeline split equals the whole model; padding
is never attended to. fp32, <= 1e-5 relative, fresh random inputs each run. (Sequence parallelism
and recomputation equal plain TP: test_sequence_parallel.py.)"""
import pytest
import torch
import torch.distributed as dist

from helpers import assert_rel_close, fresh_seed, gather_tp, rel_err
from megalite import parallel
from megalite.models import BERTModel, TransformerConfig
from megalite.testing import run_ranks

VOCAB, SEQ, BATCH = 100, 16, 3  # vocabulary padded to 128 * tp, differently for each TP size
# Pre-LN runs the tanh GELU, post-LN (BERT as published) the exact one: both paths are covered.
ACTIVATION = {"pre": "gelu_tanh", "post": "gelu"}


def tiny_config(layernorm_position="post", **kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                layernorm_position=layernorm_position, activation=ACTIVATION[layernorm_position])
    return TransformerConfig(**{**base, **kw})


def make_batch(seed):
    """Random tokens, token types, lengths (>= 1 real token, one sample unpadded), labels, loss mask."""
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    types = torch.randint(0, 2, (BATCH, SEQ), generator=gen)
    lengths = torch.randint(1, SEQ + 1, (BATCH,), generator=gen)
    lengths[0] = SEQ
    padding_mask = torch.arange(SEQ) < lengths[:, None]
    lm_labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    loss_mask = (torch.rand(BATCH, SEQ, generator=gen) < 0.5) & padding_mask
    loss_mask[:, 0] = True
    sop_labels = torch.randint(0, 2, (BATCH,), generator=gen)
    return dict(ids=ids, types=types, padding_mask=padding_mask, lm_labels=lm_labels, loss_mask=loss_mask,
                sop_labels=sop_labels)


def objective(lm_loss, sop_loss, batch):
    mask = batch["loss_mask"].float()
    return (lm_loss * mask).sum() / mask.sum() + sop_loss.mean()


def _full(name, t, p):
    """A parameter (or its gradient) as the full tensor: TP shards gathered, vocab padding cut."""
    full = gather_tp(t, p.partition_dim) if getattr(p, "tensor_model_parallel", False) else t.detach().clone()
    return full[:VOCAB] if name in ("word_embeddings.weight", "lm_bias") else full


def bert_forward_backward(rank, world, seed, layernorm_position, config_changes=None):
    parallel.initialize_model_parallel(world)
    parallel.model_parallel_manual_seed(seed)
    model = BERTModel(tiny_config(layernorm_position, **(config_changes or {})), seed=seed)
    b = make_batch(seed)
    weights = {n: _full(n, p, p) for n, p in model.named_parameters()}
    logits, sop_logits = model(b["ids"], b["types"], b["padding_mask"])
    logits = gather_tp(logits, -1)
    assert logits.shape == (BATCH, SEQ, model.padded_vocab_size)
    assert torch.isinf(logits[..., VOCAB:]).all(), "vocabulary padding must be -inf"
    lm_loss, sop_loss = model(b["ids"], b["types"], b["padding_mask"], lm_labels=b["lm_labels"],
                              sop_labels=b["sop_labels"])
    assert lm_loss.dtype == sop_loss.dtype == torch.float32
    assert lm_loss.shape == (BATCH, SEQ) and sop_loss.shape == (BATCH,)
    objective(lm_loss, sop_loss, b).backward()
    for p in model.parameters():
        if getattr(p, "sequence_parallel", False):  # partial over the sequence shards: the loop sums them
            dist.all_reduce(p.grad, group=parallel.get_tensor_model_parallel_group())
    grads = {n: _full(n, p.grad, p) for n, p in model.named_parameters()}
    return {"weights": weights, "logits": logits[..., :VOCAB], "sop_logits": sop_logits.detach(),
            "lm_loss": lm_loss.detach(), "sop_loss": sop_loss.detach(), "grads": grads}


def assert_same_results(got, want, what):
    for key in ("logits", "sop_logits", "lm_loss", "sop_loss"):
        assert_rel_close(got[key], want[key], what=f"{key} {what}")
    assert got["grads"].keys() == want["grads"].keys()
    for name, g in want["grads"].items():
        assert_rel_close(got["grads"][name], g, what=f"grad of {name} {what}")


@pytest.fixture(scope="module")
def seed():
    return fresh_seed()


@pytest.fixture(scope="module")
def references(seed):
    return {ln: run_ranks(bert_forward_backward, 1, args=(seed, ln))[0] for ln in ("pre", "post")}


@pytest.mark.parametrize("layernorm_position", ["pre", "post"])
@pytest.mark.parametrize("tp", [2, 4])
def test_bert_tensor_parallel_matches_single_device(tp, layernorm_position, seed, references):
    reference = references[layernorm_position]
    for r in run_ranks(bert_forward_backward, tp, args=(seed, layernorm_position)):
        for name, w in reference["weights"].items():
            assert torch.equal(r["weights"][name], w), f"initial {name} differs at tp={tp}"
        assert_same_results(r, reference, f"tp={tp} {layernorm_position}-LN")


@pytest.mark.parametrize("layernorm_position", ["pre", "post"])
def test_pipeline_stages_equal_the_whole_model(layernorm_position):
    """Three stages (embeddings + layer 0 | layer 1 | layer 2 + heads) chained by set_input_tensor,
    in one process at tp = 1: the same weights, logits, losses and gradients as one model."""
    seed = fresh_seed()
    b = make_batch(seed)
    config = tiny_config(layernorm_position, num_layers=3)
    whole = BERTModel(config, seed=seed)
    stages = [BERTModel(config, pre_process=True, post_process=False, layer_numbers=[0], seed=seed),
              BERTModel(config, pre_process=False, post_process=False, layer_numbers=[1], seed=seed),
              BERTModel(config, pre_process=False, post_process=True, layer_numbers=[2], seed=seed)]
    assert not hasattr(stages[1], "word_embeddings")
    first, last = stages[0].word_embeddings.weight, stages[2].word_embeddings.weight
    assert first.tied_embedding and last.tied_embedding
    assert not first.shared_embedding and last.shared_embedding  # the last stage's copy is counted once

    # Each stage parameter is the whole model's parameter of the same role.
    def whole_name(stage, name):
        if name.startswith("layers."):
            i, rest = name.split(".", 2)[1:]
            return f"layers.{stage.layer_numbers[int(i)]}.{rest}"
        return name

    whole_params = dict(whole.named_parameters())
    seen = set()
    for stage in stages:
        for name, p in stage.named_parameters():
            seen.add(whole_name(stage, name))
            assert torch.equal(p, whole_params[whole_name(stage, name)]), f"initial {name} differs"
    assert seen == set(whole_params), "the stages must hold every parameter of the whole model"

    x, mask = stages[0](b["ids"], b["types"], b["padding_mask"]), b["padding_mask"]
    assert x.shape == (SEQ, BATCH, config.hidden_size)
    for stage in stages[1:-1]:
        stage.set_input_tensor(x)
        x = stage(padding_mask=mask)
    stages[-1].set_input_tensor(x)
    logits, sop_logits = stages[-1](padding_mask=mask)
    lm_loss, sop_loss = stages[-1](padding_mask=mask, lm_labels=b["lm_labels"], sop_labels=b["sop_labels"])
    objective(lm_loss, sop_loss, b).backward()

    want_logits, want_sop_logits = whole(b["ids"], b["types"], mask)
    want_lm, want_sop = whole(b["ids"], b["types"], mask, lm_labels=b["lm_labels"], sop_labels=b["sop_labels"])
    objective(want_lm, want_sop, b).backward()
    assert_rel_close(logits[..., :VOCAB], want_logits[..., :VOCAB], what="mlm logits")
    assert_rel_close(sop_logits, want_sop_logits, what="sop logits")
    assert_rel_close(lm_loss, want_lm, what="mlm loss")
    assert_rel_close(sop_loss, want_sop, what="sop loss")
    grads = {}
    for stage in stages:  # the tied embedding's two gradients add up, as over the embedding group
        for name, p in stage.named_parameters():
            key = whole_name(stage, name)
            grads[key] = grads[key] + p.grad if key in grads else p.grad
    for name, p in whole.named_parameters():
        assert_rel_close(grads[name], p.grad, what=f"grad of {name}")


@pytest.mark.parametrize("backend", ["sdpa", "torch"])
def test_padding_is_never_attended_to(backend):
    """Tokens and token types at padded positions do not change any output at real positions
    (nor the binary head, which reads the first token); without the mask they would."""
    seed = fresh_seed()
    b = make_batch(seed)
    b["padding_mask"][1:, SEQ // 2:] = False  # at least half of two samples is padding
    pad = ~b["padding_mask"]
    config = tiny_config("post", attention_backend=backend, init_method_std=0.2)  # attention far from uniform
    model = BERTModel(config, seed=seed).eval()
    gen = torch.Generator().manual_seed(seed + 2)
    ids = torch.where(pad, torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), b["ids"])
    types = torch.where(pad, 1 - b["types"], b["types"])
    real = b["padding_mask"]
    with torch.no_grad():
        logits, sop = model(b["ids"], b["types"], b["padding_mask"])
        logits2, sop2 = model(ids, types, b["padding_mask"])
        unmasked, _ = model(ids, types)
        logits, logits2, unmasked = (t[..., :VOCAB] for t in (logits, logits2, unmasked))  # not the -inf
        loss, _ = model(b["ids"], b["types"], b["padding_mask"], lm_labels=b["lm_labels"])
        loss2, _ = model(ids, types, b["padding_mask"], lm_labels=b["lm_labels"])
    assert_rel_close(logits2[real], logits[real], tol=1e-6, what="logits at real positions")
    assert_rel_close(sop2, sop, tol=1e-6, what="sop logits")
    assert_rel_close(loss2[real], loss[real], tol=1e-6, what="mlm loss at real positions")
    assert rel_err(unmasked[real], logits[real]) > 1e-4, "without the mask padding must leak in"
    # The two attention backends agree on the masked, bidirectional model.
    other = BERTModel(config.replace(attention_backend="torch" if backend == "sdpa" else "sdpa"), seed=seed).eval()
    with torch.no_grad():
        assert_rel_close(other(b["ids"], b["types"], b["padding_mask"])[0][..., :VOCAB][real], logits[real],
                         what="attention backends")


def test_attention_is_bidirectional_even_from_a_causal_config():
    """BERTModel attends both ways whatever config.causal says; the last token sees the first."""
    model = BERTModel(tiny_config("pre", causal=True), seed=fresh_seed()).eval()
    assert model.config.causal is False and all(layer.config.causal is False for layer in model.layers)
    ids = torch.randint(0, VOCAB, (1, SEQ))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % VOCAB
    with torch.no_grad():
        assert (model(ids)[0][0, 0, :VOCAB] - model(changed)[0][0, 0, :VOCAB]).abs().max() > 1e-4


def bad_heads(rank, world):
    parallel.initialize_model_parallel(world)
    try:
        BERTModel(tiny_config(num_attention_heads=2, hidden_size=32))
    except ValueError as e:
        return str(e)
    return None


def test_heads_not_divisible_by_tp_is_a_value_error_naming_both():
    for message in run_ranks(bad_heads, 4):
        assert message is not None and "num_attention_heads (2)" in message and "tensor-parallel size (4)" in message


@pytest.mark.parametrize("change, words", [
    ({"layernorm_position": "middle"}, "layernorm_position must be pre or post"),
    ({"activation": "relu"}, "activation must be gelu_tanh, gelu, silu, squared_relu or quick_gelu, got .relu."),
    ({"causal": "yes"}, "causal must be True or False"),
])
def test_config_rejects_unknown_architecture_switches(change, words):
    with pytest.raises(ValueError, match=words):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, **change)


def test_forward_argument_errors():
    model = BERTModel(tiny_config(), seed=1, num_tokentypes=0, add_binary_head=False)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    logits, sop = model(ids)
    assert sop is None and logits.shape == (BATCH, SEQ, model.padded_vocab_size)
    with pytest.raises(ValueError, match="num_tokentypes=0"):
        model(ids, token_type_ids=torch.zeros_like(ids))
    with pytest.raises(ValueError, match="add_binary_head=False"):
        model(ids, lm_labels=ids, sop_labels=torch.zeros(BATCH, dtype=torch.long))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.randint(0, VOCAB, (1, SEQ + 1)))
