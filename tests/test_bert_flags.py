"""Megatron-LM's BERT flags: --bert-no-binary-head (one segment a sample, no token types, no
sentence-order head: the masked-LM loss alone), --mask-prob and --short-seq-prob; refused for GPT."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import rel_err
from megalite.data import IndexedDatasetWriter
from megalite.data.bert_dataset import build_bert_datasets
from megalite.data.indexed import DatasetError
from megalite.errors import UsageError
from megalite.testing import run_ranks
from test_bert_data import CLS, SEP, _Tok, write_documents  # the same ids, tokenizer stand-in, documents
from training_ranks import parse

TRAIN = ["--model", "bert-tiny", "--vocab-size", "300", "--seq-length", "32", "--global-batch-size", "8",
         "--micro-batch-size", "2", "--log-interval", "1", "--eval-iters", "0", "--num-layers", "2"]


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    """40 documents, every fourth of one sentence (no pair in it)."""
    return write_documents(tmp_path_factory.mktemp("bertflags") / "b", 1,
                           lambda doc, rng: 1 if doc % 4 == 0 else rng.randint(2, 8))


def _train(prefix, **kw):
    return build_bert_datasets(prefix, "1,0,0", 48, (400, 0, 0), 5, _Tok(), **kw)[0]


def test_without_the_binary_head_a_sample_is_one_segment_of_type_0(prefix):
    one = _train(prefix, binary_head=False)
    pair = _train(prefix)
    singles = 0
    for k in range(400):
        s = one.sample(k)
        n = int(s["padding_mask"].sum())
        toks = np.where(s["loss_mask"] > 0, s["labels"], s["tokens"])[:n]
        assert toks[0] == CLS and np.flatnonzero(toks == SEP).tolist() == [n - 1]
        assert not s["token_types"].any() and int(s["sop_labels"]) == 0
        lo, hi = one.segments[k % len(one.segments)]
        singles += int(hi - lo == 1)
    assert singles > 0  # one-sentence documents make samples too
    assert all(hi - lo >= 2 for lo, hi in pair.segments)  # a pair needs two
    assert np.mean([int(pair.sample(k)["sop_labels"]) for k in range(400)]) > 0.3


def test_with_the_binary_head_the_samples_are_those_of_before_the_flags(prefix):
    """A fingerprint of the first 20 samples, computed by the dataset before the three flags existed
    (commit 14e92a8): a run resumed across the change reads the same samples."""
    pos, total = np.arange(48), 0
    pair = _train(prefix)
    for k in range(20):
        s = pair.sample(k)
        total += int((s["tokens"] * pos).sum()) + 7 * int((s["labels"] * pos).sum())
        total += 13 * int((s["token_types"] * pos).sum()) + 17 * int(s["sop_labels"])
    assert total == 3422814


def test_a_split_without_one_sentence_is_refused_either_way(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "e")
    w.add_document([[11, 12, 13]])
    w.finalize()
    with pytest.raises(DatasetError, match="no document with 2 sentences"):
        build_bert_datasets(str(tmp_path / "e"), "1,0,0", 48, (4, 0, 0), 5, _Tok())
    assert len(build_bert_datasets(str(tmp_path / "e"), "1,0,0", 48, (4, 0, 0), 5, _Tok(), binary_head=False)[0]) == 4


def test_mask_prob_and_short_seq_prob_are_honoured(prefix):
    def masked_share(data):
        masked = candidates = 0
        for k in range(300):
            s = data.sample(k)
            masked += int(s["loss_mask"].sum())
            candidates += int(s["padding_mask"].sum()) - 3
        return masked / candidates

    assert 0.13 <= masked_share(_train(prefix)) <= 0.17
    assert 0.27 <= masked_share(_train(prefix, mask_prob=0.3)) <= 0.33

    def mean_tokens(data):
        return np.mean([int(data.sample(k)["padding_mask"].sum()) for k in range(300)])

    assert mean_tokens(_train(prefix, short_seq_prob=1.0)) < 0.8 * mean_tokens(_train(prefix, short_seq_prob=0.0))


def bert_records(rank, world, argv):
    import pretrain_bert
    from megalite.training import pretrain

    run = pretrain(parse(argv), pretrain_bert.task())
    names = {n for c in run.model_chunks for n, _ in c.named_parameters()}
    return run.records, names


@pytest.mark.parametrize("flags", [["--bert-no-binary-head"], ["--bert-no-binary-head", "--mask-prob", "0.3"]])
def test_bert_without_the_binary_head_trains_the_masked_lm_alone_at_pp2_as_on_one_rank(flags):
    argv = TRAIN + ["--train-iters", "3"] + flags
    [(want, names)] = run_ranks(bert_records, 1, args=(argv,))
    assert not {"tokentype_embeddings.weight", "pooler.weight", "binary_head.weight"} & names, names
    for r in want:
        assert r["sop_loss"] == 0 and r["mlm_loss"] == pytest.approx(r["loss"], rel=1e-6)
    for got, _ in run_ranks(bert_records, 2, args=(argv + ["--pp", "2"],)):
        assert rel_err(torch.tensor([r["loss"] for r in got]), torch.tensor([r["loss"] for r in want])) <= 1e-5
    [(other, _)] = run_ranks(bert_records, 1, args=(TRAIN + ["--train-iters", "3"],))
    assert other[0]["loss"] != want[0]["loss"]


def test_a_checkpoint_without_the_head_resumes_as_it_is_and_a_run_with_the_head_is_refused(tmp_path):
    save = ["--save", str(tmp_path / "ck"), "--save-interval", "2"]
    run_ranks(bert_records, 1, args=(TRAIN + ["--train-iters", "2", "--bert-no-binary-head"] + save,))
    shapeless = ["--seq-length", "32", "--global-batch-size", "8", "--micro-batch-size", "2", "--log-interval", "1",
                 "--eval-iters", "0", "--train-iters", "3", "--load", str(tmp_path / "ck")]
    [(records, names)] = run_ranks(bert_records, 1, args=(shapeless,))  # no shape flag: the checkpoint's model
    assert records[-1]["iteration"] == 3 and "binary_head.weight" not in names
    with pytest.raises(Exception, match=r"add_binary_head False \(checkpoint\) vs True \(now\)"):
        run_ranks(bert_records, 1, args=(TRAIN + shapeless,))  # shape flags given, without --bert-no-binary-head


def test_the_bert_flags_are_refused_for_gpt_in_one_line():
    import pretrain_gpt
    from megalite.training.task import check_task_flags

    for flags in (["--bert-no-binary-head"], ["--mask-prob", "0.2"], ["--short-seq-prob", "0.2"]):
        with pytest.raises(UsageError, match=f"^{flags[0]} is for BERT's masked samples"):
            check_task_flags(parse(flags), pretrain_gpt.task())


def test_a_bert_without_the_head_is_not_exported_as_bert_for_pre_training():
    from megalite.models import BERTModel
    from megalite.models.presets import preset
    from megalite.tools.convert_hf import ConversionError, to_hf

    config = preset("bert-tiny", num_layers=1, vocab_size=300, add_binary_head=False)
    model = BERTModel(config, seed=1, device="cpu")
    with pytest.raises(ConversionError, match="--bert-no-binary-head"):
        to_hf(config, model.state_dict())
