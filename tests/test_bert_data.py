"""BERT samples: sentence pairs from one document, [CLS] A [SEP] B [SEP] layout, 15% masking
with 80/10/10, balanced sentence-order labels, determinism; and BERT training end to end."""
import numpy as np
import pytest
import torch

from helpers import rel_err, train_on_the_embedded_corpus
from megalite.data import IndexedDatasetWriter
from megalite.data.bert_dataset import build_bert_datasets
from megalite.testing import run_ranks
from training_ranks import parse

CLS, SEP, MASK, PAD, VOCAB = 4, 5, 6, 3, 200


class _Tok:
    cls, sep, mask, pad, vocab_size = CLS, SEP, MASK, PAD, VOCAB

    def require(self, *names):
        pass


def write_documents(prefix, seed: int, sentences) -> str:
    """40 documents of `sentences(doc, rng)` sentences of 3-11 tokens, each sentence's first token its
    document's (10 + doc), so pairs can be traced back. Returns the prefix."""
    rng = np.random.RandomState(seed)
    w = IndexedDatasetWriter(prefix)
    for doc in range(40):
        n = sentences(doc, rng)
        w.add_document([[10 + doc] + list(rng.randint(60, VOCAB, rng.randint(3, 12))) for _ in range(n)])
    w.finalize()
    return str(prefix)


@pytest.fixture(scope="module")
def bert_data(tmp_path_factory):
    prefix = write_documents(tmp_path_factory.mktemp("bert") / "b", 0, lambda doc, rng: rng.randint(2, 8))
    train, _, _ = build_bert_datasets(prefix, "1,0,0", 48, (600, 0, 0), 5, _Tok())
    return train


def test_layout_types_padding_and_pairs(bert_data):
    for k in range(50):
        s = bert_data.sample(k)
        n = int(s["padding_mask"].sum())
        assert s["padding_mask"][:n].all() and not s["padding_mask"][n:].any()
        toks = np.where(s["loss_mask"] > 0, s["labels"], s["tokens"])[:n]  # unmasked view
        seps = np.flatnonzero(toks == SEP)
        assert toks[0] == CLS and len(seps) == 2 and seps[1] == n - 1
        assert (s["token_types"][:seps[0] + 1] == 0).all() and (s["token_types"][seps[0] + 1:n] == 1).all()
        assert (s["tokens"][n:] == PAD).all()
        docs = {int(t) for t in toks if 10 <= t < 50}
        assert len(docs) <= 1, "a pair must come from one document"


def test_masking_proportions_and_sentence_order_balance(bert_data):
    masked = replaced_by_mask = kept = candidates = 0
    orders = []
    for k in range(600):
        s = bert_data.sample(k)
        n = int(s["padding_mask"].sum())
        chosen = s["loss_mask"] > 0
        candidates += n - 3
        masked += int(chosen.sum())
        replaced_by_mask += int((s["tokens"][chosen] == MASK).sum())
        kept += int((s["tokens"][chosen] == s["labels"][chosen]).sum())
        orders.append(int(s["sop_labels"]))
    assert 0.13 <= masked / candidates <= 0.17
    assert 0.75 <= replaced_by_mask / masked <= 0.85
    assert 0.06 <= kept / masked <= 0.14
    assert 0.42 <= np.mean(orders) <= 0.58


def test_samples_are_deterministic(bert_data):
    again = build_bert_datasets(bert_data.indexed.prefix, "1,0,0", 48, (600, 0, 0), 5, _Tok())[0]
    for k in (0, 17, 599):
        a, b = bert_data.sample(k), again.sample(k)
        assert all(np.array_equal(a[key], b[key]) for key in a)


def bert_losses(rank, world, argv):
    import pretrain_bert
    from megalite.training import pretrain

    args = parse(argv) if "--model" in argv else parse(argv + ["--model", "bert-tiny"])
    return [r["loss"] for r in pretrain(args, pretrain_bert.task()).records]


def test_bert_trains_to_the_same_losses_in_every_layout():
    argv = ["--train-iters", "3", "--log-interval", "1", "--seq-length", "32", "--global-batch-size", "8",
            "--micro-batch-size", "2", "--vocab-size", "300", "--num-layers", "4", "--lr-warmup-iters", "0"]
    reference = run_ranks(bert_losses, 1, args=(argv,))[0]
    for tp, pp, dp in [(2, 2, 1), (1, 2, 2), (2, 1, 2)]:
        for losses in run_ranks(bert_losses, tp * pp * dp, args=(argv + ["--tp", str(tp), "--pp", str(pp)],)):
            assert rel_err(torch.tensor(losses), torch.tensor(reference)) <= 1e-5, (tp, pp, dp, losses, reference)


def test_default_bert_run_trains_on_the_embedded_corpus(tmp_path):
    train_on_the_embedded_corpus("pretrain_bert.py", tmp_path / "m.jsonl")
