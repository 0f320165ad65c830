"""Megatron-LM's evaluations once training ends: the test split on --eval-iters global batches (where
the data has one: --split's third part, --test-data-path, --mock-data), and `--skip-train`, which
loads a checkpoint and evaluates the validation and test splits at its iteration without a step."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import sentencepiece_fixture
from megalite.testing import run_ranks
from test_data_per_split import _write
from training_ranks import gpt_run, parse, refusal

import pretrain_bert

RUN = ["--global-batch-size", "4", "--micro-batch-size", "2", "--log-interval", "1", "--eval-interval", "2",
       "--eval-iters", "2"]
tokenizer = sentencepiece_fixture("\n".join(f"the value {i} is {i * 7} and not {i * 3}" for i in range(300)))


def _evaluations(path) -> list[tuple]:
    return [(r["iteration"], r["split"], r.get(f"{r['split']}_loss")) for r in map(json.loads, Path(path).read_text().splitlines())
            if r.get("split") in ("valid", "test")]


def _runs(rank, world, d, tok):
    out = {}
    gpt_run(RUN + ["--train-iters", "4", "--save", f"{d}/mock", "--metrics-file", f"{d}/mock.jsonl"])
    out["mock"] = _evaluations(f"{d}/mock.jsonl")
    before = {p.name: p.stat().st_mtime_ns for p in Path(f"{d}/mock").rglob("*")}
    gpt_run(RUN + ["--train-iters", "4", "--load", f"{d}/mock", "--skip-train", "--metrics-file", f"{d}/skip.jsonl",
                   "--tensorboard-dir", f"{d}/tb", "--save", f"{d}/mock"])
    out["skip"] = _evaluations(f"{d}/skip.jsonl")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    written = EventAccumulator(f"{d}/tb")
    written.Reload()
    out["skip wrote"] = written.Tags()["scalars"]
    out["save unchanged"] = before == {p.name: p.stat().st_mtime_ns for p in Path(f"{d}/mock").rglob("*")}
    data = ["--data-path", _write(f"{d}/corpus", 60, 100), "--tokenizer", tok, "--seq-length", "16"]
    for split in ("80,10,10", "90,10,0"):
        gpt_run(RUN + data + ["--split", split, "--train-iters", "2", "--metrics-file", f"{d}/{split}.jsonl"])
        out[split] = _evaluations(f"{d}/{split}.jsonl")
    # a sliver of a test split (one document shorter than a sample): training goes on without it
    sliver = ["--data-path", _write(f"{d}/short", 60, 100), "--tokenizer", tok, "--seq-length", "64", "--split",
              "49,10,1"]
    gpt_run(RUN + sliver + ["--train-iters", "2", "--metrics-file", f"{d}/sliver.jsonl"])
    out["sliver"] = _evaluations(f"{d}/sliver.jsonl")
    gpt_run(RUN + ["--train-iters", "2", "--eval-interval", "0", "--metrics-file", f"{d}/none.jsonl"])
    out["no validation"] = _evaluations(f"{d}/none.jsonl")
    bert = pretrain_bert.task()
    from megalite.training import pretrain
    pretrain(parse(RUN + ["--model", "bert-tiny", "--train-iters", "2", "--metrics-file", f"{d}/bert.jsonl"]), bert)
    out["bert"] = [json.loads(line) for line in Path(f"{d}/bert.jsonl").read_text().splitlines()
                   if json.loads(line).get("split") == "test"]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("test_split")
    return run_ranks(_runs, 1, args=(str(d), str(tokenizer.path)), timeout=600)[0]


def test_training_ends_with_the_test_split_where_the_data_has_one(runs):
    (it2, s2, _), (it4, s4, valid4), (it_t, s_t, test4) = runs["mock"]
    assert (it2, s2, it4, s4, it_t, s_t) == (2, "valid", 4, "valid", 4, "test")
    assert test4 != valid4  # another stream than validation's
    assert [s for _, s, _ in runs["80,10,10"]] == ["valid", "test"]
    assert [s for _, s, _ in runs["90,10,0"]] == ["valid"]  # no test documents: no test evaluation
    assert runs["no validation"] == []  # --eval-interval 0: the run evaluates nothing
    assert [s for _, s, _ in runs["sliver"]] == ["valid"]  # too short a test split: noted, not refused
    (bert,) = runs["bert"]
    assert {"test_loss", "test_mlm_loss", "test_sop_loss", "test_ppl"} <= set(bert)


def test_skip_train_evaluates_the_checkpoint_as_its_run_did(runs):
    assert runs["skip"] == runs["mock"][1:]  # the same validation and test losses at iteration 4, no step
    assert runs["skip wrote"] == []  # no TensorBoard point, as Megatron-LM's --skip-train
    assert runs["save unchanged"]  # nothing written to --save


def test_skip_train_needs_evaluations():
    for argv in (["--skip-train", "--eval-iters", "0"], ["--skip-train", "--eval-interval", "0"]):
        assert "--skip-train evaluates the validation and test splits: give --eval-iters above 0" in refusal(argv, 1)
