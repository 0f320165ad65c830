"""Megatron-LM's --multiple-validation-sets (each prefix of the validation data its own loss, named
by --validation-set-names) and --full-validation (every sample of the validation data once, in
whole global batches): each set's loss is the loss of a run validating on that prefix alone, a
whole pass reads every sample of each set once, and what they cannot apply to is refused in
one line."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from helpers import sentencepiece_fixture
from megalite.data.gpt_dataset import GPTDataset, build_gpt_datasets, epoch_samples
from megalite.data.indexed import IndexedDataset
from megalite.errors import UsageError
from megalite.testing import run_ranks
from megalite.training.validation_sets import validation_sets
from test_data_per_split import _write
from training_ranks import gpt_run, parse, several

SEQ, GBS = 16, 4
tokenizer = sentencepiece_fixture("\n".join(f"the value {i} is {i * 7} and not {i * 3}" for i in range(300)))


def test_each_prefix_is_a_set_and_a_whole_pass_reads_every_sample_once(tmp_path):
    a, b, c = (_write(tmp_path / n, 30, base) for n, base in (("a", 100), ("b", 20), ("c", 200)))
    _, sets, _ = build_gpt_datasets(None, "1", SEQ, (8, 12, 0), seed=3, per_split=([a], [b, c], None), valid_sets=True)
    assert [p for p, _ in sets] == [b, c]
    for prefix, data in sets:  # each set: the samples of that prefix validated alone
        alone = build_gpt_datasets(None, "1", SEQ, (8, 12, 0), seed=3, per_split=([a], [prefix], None))[1]
        assert all(np.array_equal(data.sample(k), alone.sample(k)) for k in range(12))
    for valid in ([b, c], ["0.5", b, "0.5", c]):  # weights unused, as Megatron-LM's
        assert [p for p, _ in build_gpt_datasets(None, "1", SEQ, (8, 12, 0), seed=3, per_split=([a], valid, None),
                                                 valid_sets=True)[1]] == [b, c]
    # --full-validation: one epoch of the prefix, or of each (without weights), whatever --eval-iters asked
    whole = build_gpt_datasets(None, "1", SEQ, (8, 4, 0), seed=3, per_split=([a], [b], None), valid_epoch=True)[1]
    assert len(whole) == epoch_samples(IndexedDataset(b), (0, 30), SEQ)
    blend = build_gpt_datasets(None, "1", SEQ, (8, 4, 0), seed=3, per_split=([a], [b, c], None), valid_epoch=True)[1]
    assert len(blend) == sum(epoch_samples(IndexedDataset(p), (0, 30), SEQ) for p in (b, c))
    each = build_gpt_datasets(None, "1", SEQ, (8, 4, 0), seed=3, per_split=([a], [b, c], None), valid_epoch=True,
                              valid_sets=True)[1]
    assert [len(d) for _, d in each] == [epoch_samples(IndexedDataset(p), (0, 30), SEQ) for p in (b, c)]
    assert isinstance(each[0][1], GPTDataset)
    with pytest.raises(ValueError, match="--valid-data-path: --full-validation reads every sample .* without weights"):
        build_gpt_datasets(None, "1", SEQ, (8, 4, 0), seed=3, per_split=([a], ["0.5", b, "0.5", c], None),
                           valid_epoch=True)
    # as sets, each read whole: the weights unused, as Megatron-LM's
    weighted = build_gpt_datasets(None, "1", SEQ, (8, 4, 0), seed=3, per_split=([a], ["0.5", b, "0.5", c], None),
                                  valid_epoch=True, valid_sets=True)[1]
    assert [(p, len(d)) for p, d in weighted] == [(p, len(d)) for p, d in each]
    # every sample of a set once: all distinct
    whole_b = each[0][1]
    assert len({tuple(whole_b.sample(k)) for k in range(len(whole_b))}) == len(whole_b)
    # with --split: the validation documents of --data-path, once
    split = build_gpt_datasets([a], "80,20,0", SEQ, (8, 4, 0), seed=3, valid_epoch=True)[1]
    assert len(split) == epoch_samples(IndexedDataset(a), (24, 30), SEQ)


def _cfg(*argv):
    return parse(["--global-batch-size", str(GBS), "--eval-iters", "2", *argv])


def test_each_set_is_named_and_a_whole_pass_reads_its_full_global_batches():
    data = [("b", list(range(13))), ("c", list(range(4)))]
    sets = validation_sets(data, _cfg("--multiple-validation-sets", "--validation-set-names", "web", "code",
                                      "--valid-data-path", "x", "--train-data-path", "y"))
    assert [(s.name, s.batches) for s in sets] == [("web", 2), ("code", 2)]
    sets = validation_sets(data, _cfg("--multiple-validation-sets", "--full-validation", "--valid-data-path", "x",
                                      "--train-data-path", "y"))
    assert [(s.name, s.batches) for s in sets] == [("0", 3), ("1", 1)]  # 13 samples: 3 batches of 4, 1 left out
    assert [(s.name, s.batches) for s in validation_sets(range(9), _cfg("--full-validation"))] == [(None, 2)]
    assert validation_sets(range(9), _cfg("--eval-interval", "0", "--full-validation")) == []
    assert validation_sets(None, _cfg()) == []
    with pytest.raises(UsageError, match="--validation-set-names gives 1 names for 2 validation sets"):
        validation_sets(data, _cfg("--multiple-validation-sets", "--validation-set-names", "web", "--valid-data-path",
                                   "x", "--train-data-path", "y"))
    with pytest.raises(UsageError, match="validation set 1 holds 3 samples, less than one global batch of 4"):
        validation_sets([("b", list(range(8))), ("c", list(range(3)))],
                        _cfg("--multiple-validation-sets", "--full-validation", "--valid-data-path", "x",
                             "--train-data-path", "y"))


@pytest.mark.parametrize("argv, entry, says", [
    (["--multiple-validation-sets", "--validation-set-names", "a", "--train-data-path", "x", "--valid-data-path", "y",
      "z", "--eval-interval", "0"], "gpt", "--validation-set-names gives 1 names for 2 validation sets (y, z)"),
    (["--multiple-validation-sets", "--validation-set-names", "a", "a", "--train-data-path", "x", "--valid-data-path",
      "y", "z"], "gpt", "--validation-set-names a a: each name once, not empty and without '/'"),
    (["--multiple-validation-sets", "--validation-set-names", "a/b", "--train-data-path", "x", "--valid-data-path",
      "y"], "gpt", "--validation-set-names a/b: each name once"),
    (["--multiple-validation-sets", "--data-path", "x"], "gpt", "--multiple-validation-sets validates each prefix of "
                                                                "the validation data named per split"),
    (["--full-validation", "--mock-data"], "gpt", "--full-validation reads indexed validation data; --mock-data"),
    (["--full-validation", "--data-path", "x"], "bert", "--full-validation is for GPT datasets"),
    (["--validation-set-names", "a", "--data-path", "x"], "gpt", "--validation-set-names names the sets of "
                                                                  "--multiple-validation-sets"),
])
def test_what_the_flags_cannot_apply_to_is_refused_in_one_line(argv, entry, says):
    import pretrain_bert
    import pretrain_gpt
    from megalite.training.task import check_task_flags

    task = pretrain_gpt.task() if entry == "gpt" else pretrain_bert.task()
    with pytest.raises(UsageError) as e:
        check_task_flags(parse(argv), task)
    assert str(e.value).startswith(says) and "\n" not in str(e.value), str(e.value)


def _valid_records(rank, world, argv):
    gpt_run(argv)
    with open(argv[argv.index("--metrics-file") + 1]) as f:
        return [r for r in map(json.loads, f) if r.get("split") == "valid"]


@pytest.mark.slow
def test_each_sets_loss_is_that_of_a_run_validating_on_it_alone(tmp_path, tokenizer):
    a, b, c = (_write(tmp_path / n, 40, base) for n, base in (("a", 100), ("b", 150), ("c", 200)))
    run = ["--tokenizer", str(tokenizer.path), "--seq-length", str(SEQ), "--global-batch-size", str(GBS),
           "--micro-batch-size", "2", "--train-iters", "2", "--log-interval", "1", "--eval-interval", "2",
           "--eval-iters", "1", "--train-data-path", a, "--pp", "2"]
    argvs = {"sets": run + ["--valid-data-path", b, c, "--multiple-validation-sets", "--validation-set-names", "web",
                            "code"],
             "b": run + ["--valid-data-path", b],
             "c": run + ["--valid-data-path", c],
             "whole sets": run + ["--valid-data-path", b, c, "--multiple-validation-sets", "--full-validation"],
             "whole b": run + ["--valid-data-path", b, "--full-validation"],
             "whole c": run + ["--valid-data-path", c, "--full-validation"]}
    argvs = {k: v + ["--metrics-file", str(tmp_path / f"{i}.jsonl")] for i, (k, v) in enumerate(argvs.items())}
    got = dict(zip(argvs, run_ranks(several, 2, args=(_valid_records, list(argvs.values())))[0]))
    assert [(r["valid_set"], r["iteration"]) for r in got["sets"]] == [("web", 2), ("code", 2)]
    assert got["sets"][0]["valid_loss"] == got["b"][0]["valid_loss"]
    assert got["sets"][1]["valid_loss"] == got["c"][0]["valid_loss"]
    assert got["sets"][0]["valid_loss"] != got["sets"][1]["valid_loss"]
    assert [r["valid_set"] for r in got["whole sets"]] == ["0", "1"]
    assert got["whole sets"][0]["valid_loss"] == got["whole b"][0]["valid_loss"] != got["b"][0]["valid_loss"]
    assert got["whole sets"][1]["valid_loss"] == got["whole c"][0]["valid_loss"]
    assert "valid_set" not in got["b"][0] and "valid_set" not in got["whole b"][0]


def test_the_entry_point_builds_the_sets_with_their_wrappers(tmp_path, tokenizer):
    import pretrain_gpt

    a, b, c = (_write(tmp_path / n, 30, base) for n, base in (("a", 100), ("b", 150), ("c", 200)))
    common = ["--tokenizer", str(tokenizer.path), "--seq-length", str(SEQ), "--global-batch-size", "2", "--train-iters", "2",
              "--train-data-path", a, "--valid-data-path", b, c, "--multiple-validation-sets"]
    model = SimpleNamespace(vocab_size=600, mtp_num_layers=1)
    _, valid = pretrain_gpt.build_data(model, parse(common + ["--reset-position-ids"]))
    assert [p for p, _ in valid] == [b, c]
    from megalite.training.validation_sets import validation_sets as sets_of

    whole = sets_of(valid, parse(common + ["--reset-position-ids", "--full-validation"]))  # len() through the wrappers
    assert [s.batches for s in whole] == [len(d.dataset.dataset) // 2 for _, d in valid]
    batch = valid[1][1].batch(range(2))
    assert "mtp_labels" in batch or any("mtp" in k for k in batch), list(batch)  # MTP's targets on each set
    assert "position_ids" in batch, list(batch)  # and the documents' flags
    assert batch["tokens"].min() >= 200
