"""BERT's loss as Megatron-LM's pretrain_bert.py normalizes it: each micro-batch's mean MLM loss over
its own masked tokens plus its mean sentence-order loss, then the mean over micro-batches and
data-parallel ranks. Random masking gives micro-batches different masked-token counts, so this is
not the global batch's per-token mean, which --calculate-per-token-loss asks for instead."""
from __future__ import annotations

import pytest
import torch

from helpers import rel_err
from megalite.testing import run_ranks
from training_ranks import parse

BASE = ["--model", "bert-tiny", "--vocab-size", "300", "--seq-length", "32", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0",
        "--attention-dropout", "0"]


def train_bert(rank, world, argv):
    """The records of a BERT run; on one rank also the first step's loss and MLM term computed by
    hand from the initial weights in both normalizations (--lr tiny: the weights do not move)."""
    import pretrain_bert
    from megalite.training import pretrain

    cfg = parse(argv)
    run = pretrain(cfg, pretrain_bert.task())
    if world > 1:
        return run.records, None
    model = run.model_chunks[0].eval()
    train, _ = pretrain_bert.build_data(model.config, cfg)
    mlm_means, sop_means, mlm_sum, sop_sum, masked = [], [], 0.0, 0.0, 0.0
    with torch.no_grad():
        for start in range(0, cfg.training.global_batch_size, cfg.training.micro_batch_size):
            b = train.batch(range(start, start + cfg.training.micro_batch_size))
            mlm, sop = model(b["tokens"], token_type_ids=b["token_types"], padding_mask=b["padding_mask"],
                             lm_labels=b["labels"], sop_labels=b["sop_labels"])
            summed = (mlm * b["loss_mask"]).sum()
            mlm_means.append(summed / b["loss_mask"].sum())
            sop_means.append(sop.mean())
            mlm_sum, sop_sum, masked = mlm_sum + summed, sop_sum + sop.sum(), masked + b["loss_mask"].sum()
    megatron_mlm = torch.stack(mlm_means).mean().item()
    per_token_mlm = (mlm_sum / masked).item()
    sop_mean = (sop_sum / cfg.training.global_batch_size).item()
    assert abs(torch.stack(sop_means).mean().item() - sop_mean) <= 1e-6 * sop_mean  # every micro-batch: 2 samples
    return run.records, {"megatron": (megatron_mlm + sop_mean, megatron_mlm),
                         "per_token": (per_token_mlm + sop_mean, per_token_mlm)}


def _first(records) -> tuple[float, float]:
    return records[0]["loss"], records[0]["mlm_loss"]


@pytest.mark.parametrize("flags,form", [([], "megatron"), (["--calculate-per-token-loss"], "per_token")])
def test_bert_loss_is_megatron_lms_mean_of_micro_batch_means_or_per_token_when_asked(flags, form):
    argv = BASE + ["--lr", "1e-30", "--min-lr", "0", "--train-iters", "1"] + flags
    [(records, by_hand)] = run_ranks(train_bert, 1, args=(argv,))
    other = "per_token" if form == "megatron" else "megatron"
    assert abs(by_hand["megatron"][1] - by_hand["per_token"][1]) > 1e-4, by_hand  # the masks' counts differ
    for got, want in zip(_first(records), by_hand[form]):
        assert abs(got - want) <= 1e-6 * want, (got, by_hand)
    assert abs(_first(records)[0] - by_hand[other][0]) > 1e-5, (records[0], by_hand)


def test_bert_loss_is_the_same_over_two_data_parallel_ranks():
    """The mean over micro-batches is also over the data-parallel ranks: dp 2 trains the numbers of one."""
    argv = BASE + ["--train-iters", "3"]
    [(want, _)] = run_ranks(train_bert, 1, args=(argv,))
    for got, _ in run_ranks(train_bert, 2, args=(argv,)):
        for key in ("loss", "mlm_loss", "sop_loss"):
            assert rel_err(torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in want])) <= 1e-5, key


def test_a_checkpoint_records_its_loss_and_an_older_bert_checkpoint_is_told_of_the_new_one(tmp_path, monkeypatch,
                                                                                        capsys):
    """Checkpoints record the loss's form; one saved before they did (a BERT checkpoint then trained on the
    per-token mean, under the same flags) is resumed with one line saying what changed and how to keep it."""
    import json

    from megalite.checkpoint.sealed import SEAL, sealed
    from megalite.training.checkpoint_shape import adopt_checkpoint_shape

    run_ranks(train_bert, 1, args=(BASE + ["--train-iters", "1", "--save", str(tmp_path / "ck")],))
    meta_path = next((tmp_path / "ck").glob("iter_*")) / "metadata.json"
    meta = json.loads(meta_path.read_text())
    assert meta["loss"] == "micro_batch_means"
    monkeypatch.delenv("MEGALITE_QUIET", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def notes(*flags):
        capsys.readouterr()
        adopt_checkpoint_shape(parse(["--load", str(tmp_path / "ck"), *BASE, *flags]))
        return [line for line in capsys.readouterr().out.splitlines() if "BERT loss" in line]

    assert notes() == []  # it recorded its form: nothing to say
    meta.pop(SEAL)
    meta.pop("loss")  # as a checkpoint saved before the loss was recorded
    meta_path.write_text(json.dumps(sealed(meta)))
    [line] = notes()
    assert "per-token mean (the checkpoint's" in line and "add --calculate-per-token-loss" in line
    assert notes("--calculate-per-token-loss") == []
