"""Megatron-LM's per-split data (--train/valid/test-data-path, --per-split-data-args-path) and
--data-args-path: each split reads every document of its own data, the same samples as that data cut
by --split to the one split; the files are read as Megatron-LM reads them; mixed or partial data
flags are refused in one line; GPT and BERT train on them."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import sentencepiece_fixture
from megalite.data import BlendedDataset, IndexedDatasetWriter
from megalite.data.bert_dataset import build_bert_datasets
from megalite.data.blends import split_blends
from megalite.data.gpt_dataset import build_gpt_datasets
from megalite.testing import run_ranks
from training_ranks import parse, refusal, several


def _write(prefix, docs: int, base: int) -> str:
    """`docs` documents whose ids are base + (0..9): which data a sample came from shows in its ids."""
    rng = np.random.RandomState(base)
    with IndexedDatasetWriter(prefix) as w:
        for _ in range(docs):
            w.add_document([base + rng.randint(0, 10, rng.randint(4, 12)) for _ in range(rng.randint(2, 4))])
        w.finalize()
    return str(prefix)


def _samples(ds, n=12):
    return np.stack([ds.sample(k) for k in range(n)])


def test_each_split_reads_every_document_of_its_own_data(tmp_path):
    a, b = _write(tmp_path / "a", 40, 100), _write(tmp_path / "b", 30, 200)
    train, valid, test = build_gpt_datasets(None, "969,30,1", 8, (40, 12, 5), seed=3, per_split=([a], [b], None))
    assert test is None
    # the same samples as each data cut to that one split by --split
    assert np.array_equal(_samples(train), _samples(build_gpt_datasets([a], "1,0,0", 8, (40, 0, 0), seed=3)[0]))
    assert np.array_equal(_samples(valid), _samples(build_gpt_datasets([b], "0,1,0", 8, (0, 12, 0), seed=3)[1]))
    assert _samples(train).min() >= 100 and _samples(train).max() < 110
    assert _samples(valid, 12).min() >= 200
    # a blend per split, as --data-path blends
    blend = ["0.7", a, "0.3", b]
    per_split = build_gpt_datasets(None, "1", 8, (60, 0, 0), seed=3, per_split=(blend, None, None))[0]
    whole = build_gpt_datasets(blend, "1,0,0", 8, (60, 0, 0), seed=3)[0]
    assert isinstance(per_split, BlendedDataset)
    assert np.array_equal(_samples(per_split, 60), _samples(whole, 60))


class _BertTok:
    cls, sep, mask, pad, vocab_size = 4, 5, 6, 3, 600

    def require(self, *names):
        pass


def test_bert_splits_read_their_own_prefix(tmp_path):
    a, b = _write(tmp_path / "a", 40, 100), _write(tmp_path / "b", 30, 200)
    kw = dict(seq_length=16, seed=3, tokenizer=_BertTok())
    train, valid, test = build_bert_datasets(None, "969,30,1", num_samples=(20, 8, 4), per_split=(a, b, None), **kw)
    want_train = build_bert_datasets(a, "1,0,0", num_samples=(20, 0, 0), **kw)[0]
    want_valid = build_bert_datasets(b, "0,1,0", num_samples=(0, 8, 0), **kw)[1]
    assert test is None
    for got, want in ((train, want_train), (valid, want_valid)):
        g, w = got.batch(range(len(got))), want.batch(range(len(want)))
        assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in g)


def test_the_files_are_read_as_megatron_lm_reads_them(tmp_path):
    (tmp_path / "args.txt").write_text("0.7 /d/a\n0.3 /d/b\n")
    data = parse(["--data-args-path", str(tmp_path / "args.txt")]).data
    assert split_blends(data) == (["0.7", "/d/a", "0.3", "/d/b"], None)
    (tmp_path / "split.json").write_text(json.dumps({"train": "0.5 /d/a 0.5 /d/b", "valid": ["/d/c"], "test": []}))
    data = parse(["--per-split-data-args-path", str(tmp_path / "split.json")]).data
    assert split_blends(data) == (None, (["0.5", "/d/a", "0.5", "/d/b"], ["/d/c"], None))
    data = parse(["--train-data-path", "/d/a", "--valid-data-path", "0.2", "/d/b", "0.8", "/d/c"]).data
    assert split_blends(data) == (None, (["/d/a"], ["0.2", "/d/b", "0.8", "/d/c"], None))
    assert split_blends(parse(["--data-path", "/d/a"]).data) == (["/d/a"], None)
    for text, says in (("{not json", "not JSON"), (json.dumps({"valid": ["/d/c"]}), 'with "train"'),
                       (json.dumps({"train": {"a": 1}}), '"train" is neither a list nor a string'),
                       (json.dumps({"train": [True]}), '"train" is neither a list nor a string'),
                       (json.dumps({"train": ["/d/a"], "validation": ["/d/b"]}),
                        "'validation' is not a split (did you mean 'valid'?)"),
                       (json.dumps({"train": " ", "valid": ["/d/b"]}), '"train" names no data')):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ValueError, match=re.escape(says)) as e:
            split_blends(parse(["--per-split-data-args-path", str(tmp_path / "bad.json")]).data)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="--data-args-path .*missing.txt: cannot be read"):
        split_blends(parse(["--data-args-path", str(tmp_path / "missing.txt")]).data)
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="empty.txt is empty: it should hold --data-path's words"):
        split_blends(parse(["--data-args-path", str(tmp_path / "empty.txt")]).data)


@pytest.mark.parametrize("argv,says", [
    (["--data-path", "/d/a", "--train-data-path", "/d/b"], "--data-path and --train-data-path both name the data"),
    (["--data-path", "/d/a", "--data-args-path", "f"], "--data-path and --data-args-path both name the data"),
    (["--valid-data-path", "/d/b"], "--valid-data-path needs --train-data-path"),
    (["--train-data-path", "/d/a", "--per-split-data-args-path", "f"], "--per-split-data-args-path names every split"),
    (["--mock-data", "--train-data-path", "/d/a"], "--mock-data and --train-data-path exclude each other"),
    (["--sft-data-path", "c.jsonl", "--train-data-path", "/d/a"], "drop --train-data-path"),
    (["--mock-data", "--valid-data-path", "/d/b"], "--mock-data and --valid-data-path exclude each other"),
    (["--train-data-path", "/d/a", "--valid-data-path", "/d/b", "--per-split-data-args-path", "f"],
     "drop --train-data-path and --valid-data-path"),
    (["--data-args-path", ""], "--data-args-path is empty: give the file's path"),
    (["--per-split-data-args-path", " "], "--per-split-data-args-path is empty"),
])
def test_mixed_or_partial_data_flags_are_refused_in_one_line(argv, says):
    assert says in refusal(argv, 1)


tokenizer = sentencepiece_fixture("\n".join(f"the value {i} is {i * 7} and not {i * 3}" for i in range(300)))


def _records(rank, world, argv):
    """Training losses and (from its --metrics-file) validation losses of a run."""
    from training_ranks import gpt_run

    run = gpt_run(argv)
    with open(argv[argv.index("--metrics-file") + 1]) as f:
        valid = [r["valid_loss"] for r in map(json.loads, f) if "valid_loss" in r]
    return [r["loss"] for r in run.records], valid


@pytest.mark.slow
def test_a_run_trains_on_its_training_data_and_validates_on_its_validation_data(tmp_path, tokenizer):
    from megalite.data.preprocess import preprocess

    for name, offset in (("a", 0), ("b", 1000)):
        (tmp_path / f"{name}.jsonl").write_text("".join(
            json.dumps({"text": " ".join(f"the value {i} is {i * 7}" for i in range(j, j + 30))}) + "\n"
            for j in range(offset, offset + 40)))
        preprocess([tmp_path / f"{name}.jsonl"], tokenizer.path, str(tmp_path / name), progress=False)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    (tmp_path / "split.json").write_text(json.dumps({"train": [a], "valid": b, "test": []}))
    run = ["--tokenizer", str(tokenizer.path), "--seq-length", "16", "--global-batch-size", "4", "--micro-batch-size",
           "2", "--train-iters", "4", "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1"]
    flags = run + ["--train-data-path", a, "--valid-data-path", b]
    from_file = run + ["--per-split-data-args-path", str(tmp_path / "split.json")]
    whole = run + ["--data-path", a, "--split", "1,0,0"]  # the same training data; no validation split
    other = run + ["--train-data-path", a, "--valid-data-path", a]
    runs = [argv + ["--metrics-file", str(tmp_path / f"m{i}.jsonl")] for i, argv in enumerate([flags, from_file, whole,
                                                                                            other])]
    got = run_ranks(several, 1, args=(_records, runs))[0]
    (losses, valid), (file_losses, file_valid), (whole_losses, no_valid), (_, other_valid) = got
    assert losses == whole_losses == file_losses and len(losses) == 4
    assert valid == file_valid and len(valid) == 2 and no_valid == []
    assert other_valid != valid  # validated on b, not on a


def test_the_entry_points_build_each_splits_data_and_bert_refuses_a_blend(tmp_path, monkeypatch):
    import pretrain_bert
    import pretrain_gpt
    from megalite.errors import UsageError

    a, b = _write(tmp_path / "a", 40, 100), _write(tmp_path / "b", 30, 200)
    run = ["--tokenizer", "unused", "--seq-length", "16", "--eval-iters", "1", "--global-batch-size", "2",
           "--train-iters", "2", "--train-data-path", a, "--valid-data-path", b]
    monkeypatch.setattr(pretrain_bert, "data_tokenizer", lambda data: _BertTok())
    model = SimpleNamespace(vocab_size=600, add_binary_head=True)
    train, valid = pretrain_gpt.build_data(model, parse(run))
    assert train.sample(0).max() < 110 and valid.sample(0).min() >= 200
    train, valid = pretrain_bert.build_data(model, parse(run))
    tokens = [valid.batch([k])["tokens"] for k in range(4)]
    assert max(int(t[(t >= 10)].min()) for t in tokens) >= 200  # beyond the special ids, b's alone
    (tmp_path / "args.txt").write_text(f"0.5 {a} 0.5 {b}")
    blend = run[:-4] + ["--data-args-path", str(tmp_path / "args.txt"), "--split", "50,50,0"]
    assert len(pretrain_gpt.build_data(model, parse(blend))[0]) >= 4
    with pytest.raises(UsageError, match="pretrain_bert.py reads one prefix a split, not 0.5"):
        pretrain_bert.build_data(model, parse(blend))
    # a message about a split's words names the flag they came from
    for argv, says in ((["--valid-data-path", "x", b, "0.5"], "--valid-data-path: x .* 0.5 mixes weights and prefixes"),
                       (["--valid-data-path", "0", b], "--valid-data-path: weights must be positive")):
        with pytest.raises(UsageError, match=says):
            pretrain_gpt.build_data(model, parse(run[:-2] + argv))
    (tmp_path / "odd.txt").write_text(f"0.5 {a} {b}")
    with pytest.raises(UsageError, match="--data-args-path .*odd.txt: 0.5 .* mixes weights and prefixes"):
        pretrain_gpt.build_data(model, parse(run[:-4] + ["--data-args-path", str(tmp_path / "odd.txt")]))
    assert "--split (each split reads every document of its own data" in parse(run + ["--split", "1,0,0"]).ignored_flags[0]
