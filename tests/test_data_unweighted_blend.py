"""Prefixes without weights (`--data-path A B`), as Megatron-LM reads them: each prefix read once
(one epoch of its documents in the split), blended in proportion to its samples; a training run that
needs more is refused in one line, validation wraps around; weights and prefixes mixed are refused."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from megalite.data import BlendedDataset, DatasetError
from megalite.data.gpt_dataset import GPTDataset, build_gpt_datasets, epoch_samples, parse_data_path, split_ranges
from megalite.data.indexed import IndexedDataset
from test_data_per_split import _write
from training_ranks import parse

SEQ = 8


def test_prefixes_alone_are_read_as_megatron_lm_reads_them():
    assert parse_data_path(["A"]) == [(1.0, "A")]
    assert parse_data_path(["0.7", "A", "0.3", "B"]) == [(0.7, "A"), (0.3, "B")]
    assert parse_data_path(["A", "B"]) == [(None, "A"), (None, "B")]
    assert parse_data_path(["A", "B", "C"]) == [(None, "A"), (None, "B"), (None, "C")]
    for words in (["0.5", "A", "B"], ["A", "0.5", "B", "C"], ["0.5", "A", "B", "0.5"]):
        with pytest.raises(ValueError, match=f"--data-path: {' '.join(words)} mixes weights and prefixes"):
            parse_data_path(words)


def test_each_prefix_is_read_once_in_proportion_to_its_samples(tmp_path):
    a, b = _write(tmp_path / "a", 40, 100), _write(tmp_path / "b", 20, 200)
    split = "80,20,0"
    ranges = {p: split_ranges(IndexedDataset(p).num_documents, split)[0] for p in (a, b)}
    sizes = {p: epoch_samples(IndexedDataset(p), ranges[p], SEQ) for p in (a, b)}
    held = sum(sizes.values())
    assert sizes[a] > sizes[b] > 0
    train, valid, _ = build_gpt_datasets([a, b], split, SEQ, (held, 5, 0), seed=3)
    assert isinstance(train, BlendedDataset) and len(train) == held
    # Every sample of one epoch of each prefix, each exactly once.
    got = sorted(tuple(train.sample(k)) for k in range(held))
    want = sorted(tuple(GPTDataset(IndexedDataset(p), ranges[p], sizes[p], SEQ, 3).sample(k))
                  for p in (a, b) for k in range(sizes[p]))
    assert got == want
    # Every prefix of the stream keeps the sizes' proportion to within one sample.
    from_b = np.cumsum([train.sample(k).min() >= 200 for k in range(held)])
    share = sizes[b] / held
    assert all(abs(from_b[k] - share * (k + 1)) <= 1 for k in range(held))
    # One epoch holds: a sample of it covers tokens no other sample covers (one overlapping label).
    tokens_a = int(IndexedDataset(a).sequence_lengths[:int(IndexedDataset(a).document_indices[ranges[a][1]])].sum())
    assert sizes[a] == (tokens_a - 1) // SEQ
    # Validation reads its own documents: no more samples than they hold (later reads wrap around).
    valid_held = sum(epoch_samples(IndexedDataset(p), split_ranges(IndexedDataset(p).num_documents, split)[1], SEQ)
                     for p in (a, b))
    assert len(valid) == min(5, valid_held)
    _, few, _ = build_gpt_datasets([a, b], split, SEQ, (held, 10 * valid_held, 0), seed=3)
    assert len(few) == valid_held


def test_a_training_run_longer_than_one_pass_is_refused_in_one_line(tmp_path):
    a, b = _write(tmp_path / "a", 10, 100), _write(tmp_path / "b", 10, 200)
    held = sum(epoch_samples(IndexedDataset(p), (0, 10), SEQ) for p in (a, b))
    build_gpt_datasets([a, b], "1,0,0", SEQ, (held, 0, 0), seed=3)
    with pytest.raises(DatasetError) as e:
        build_gpt_datasets([a, b], "1,0,0", SEQ, (held + 1, 0, 0), seed=3)
    message = str(e.value)
    assert "\n" not in message and f"holds {held} samples of {SEQ + 1} tokens, the run reads {held + 1}" in message
    assert message.startswith("--data-path: prefixes without weights are each read once")
    with pytest.raises(DatasetError, match="--train-data-path: prefixes without weights"):
        build_gpt_datasets(None, "1", SEQ, (held + 1, 0, 0), seed=3, per_split=([a, b], None, None))


def test_a_prefix_too_short_for_a_sample_is_refused_naming_its_flag(tmp_path):
    from megalite.data import IndexedDatasetWriter

    a = _write(tmp_path / "a", 10, 100)
    with IndexedDatasetWriter(tmp_path / "t") as w:
        w.add_document([[100, 101, 102]])
        w.finalize()
    with pytest.raises(DatasetError) as e:
        build_gpt_datasets(None, "1", SEQ, (4, 0, 0), seed=3, per_split=([a, str(tmp_path / "t")], None, None))
    assert str(e.value) == (f"--train-data-path: {tmp_path / 't'} holds too few tokens for one sample of {SEQ + 1}: "
                            f"drop it from --train-data-path, or use a shorter --seq-length")


def test_a_batch_schedule_counts_the_samples_its_steps_read(tmp_path):
    """A ramp-up or step schedule's steps read fewer (or more) than train_iters full batches: the
    blend is built for, and refused by, what the run reads."""
    from megalite.config.batch_schedule import BatchSchedule, parse_step_schedule

    ramp, steps = BatchSchedule(8, (2, 2, 40)), BatchSchedule(2, None, parse_step_schedule("0:16 512:2", 16))

    def read(schedule, n):
        consumed = 0
        for _ in range(n):
            consumed += schedule.at(consumed)
        return consumed

    for n in range(40):
        assert ramp.samples_for_steps(n) == read(ramp, n) and steps.samples_for_steps(n) == read(steps, n)
    assert (ramp.samples_for_steps(12), steps.samples_for_steps(12)) == (36, 52)
    import pretrain_gpt
    from megalite.errors import UsageError

    a, b = _write(tmp_path / "a", 20, 100), _write(tmp_path / "b", 20, 200)
    held = sum(epoch_samples(IndexedDataset(p), (0, 20), SEQ) for p in (a, b))
    common = ["--tokenizer", "unused", "--seq-length", str(SEQ), "--eval-interval", "0", "--train-data-path", a, b]
    model = SimpleNamespace(vocab_size=600)
    schedule = BatchSchedule(8, (2, 2, held // 2))
    iters = max(n for n in range(held) if schedule.samples_for_steps(n) <= held)  # all the prefixes hold
    assert iters * 8 > held  # train_iters full batches would be more than they hold
    train, _ = pretrain_gpt.build_data(model, parse(common + ["--global-batch-size", "8", "--train-iters", str(iters),
                                                              "--rampup-batch-size", "2", "2", str(held // 2)]))
    assert len(train) == schedule.samples_for_steps(iters) <= held  # built for what the run reads, not refused
    with pytest.raises(UsageError, match=f"the run reads {schedule.samples_for_steps(iters + 1)}"):
        pretrain_gpt.build_data(model, parse(common + ["--global-batch-size", "8", "--train-iters", str(iters + 1),
                                                       "--rampup-batch-size", "2", "2", str(held // 2)]))


def test_the_entry_point_trains_on_prefixes_alone_per_split_too(tmp_path):
    import pretrain_gpt
    from megalite.errors import UsageError

    a, b, c = _write(tmp_path / "a", 40, 100), _write(tmp_path / "b", 30, 200), _write(tmp_path / "c", 30, 300)
    model = SimpleNamespace(vocab_size=600)
    common = ["--tokenizer", "unused", "--seq-length", str(SEQ), "--eval-iters", "1", "--global-batch-size", "2",
              "--train-iters", "4"]
    train, valid = pretrain_gpt.build_data(model, parse(common + ["--data-path", a, b, "--split", "90,10,0"]))
    firsts = {int(train.sample(k).min()) // 100 for k in range(8)}
    assert firsts == {1, 2}, firsts  # both prefixes in the first eight samples
    train, valid = pretrain_gpt.build_data(model, parse(common + ["--train-data-path", a, b, "--valid-data-path", c]))
    assert isinstance(train, BlendedDataset) and valid.sample(0).min() >= 300
    with pytest.raises(UsageError, match="--data-path: 0.5 .* mixes weights and prefixes"):
        pretrain_gpt.build_data(model, parse(common + ["--data-path", "0.5", a, b]))
