"""A run's data: the data section resolved against the model (tokenizer, vocabulary size), and
the train and validation datasets for the run's length."""
from __future__ import annotations

import dataclasses

from megalite.config import RunConfig
from megalite.data import resolve_data
from megalite.errors import UsageError


def prepare_data(cfg: RunConfig, kind: str) -> RunConfig:
    """`cfg` with --data-path and --tokenizer filled in (the embedded corpus when none is given) and
    the vocabulary size the tokenizer needs."""
    data, vocab_size, _ = resolve_data(cfg.data, cfg.model.vocab_size, kind)
    return dataclasses.replace(cfg, data=data, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))


def train_valid_datasets(cfg, vocab_size: int, synthetic, build) -> tuple:
    """(train, valid or None) for a run: with --mock-data two `synthetic(vocab_size, seq_length,
    seed)` streams, else `build(samples, lock_timeout)`'s datasets for (train, valid, test) sample
    counts, waiting on another rank's cache no longer than on a collective. Bad data becomes one
    usage error."""
    if cfg.data.mock_data:
        return (synthetic(vocab_size, cfg.model.seq_length, seed=cfg.training.seed),
                synthetic(vocab_size, cfg.model.seq_length, seed=cfg.training.seed + 1))
    valid_samples = cfg.training.eval_iters * cfg.training.global_batch_size if cfg.training.eval_interval else 0
    try:
        train, valid, _ = build((cfg.training.train_iters * cfg.training.global_batch_size, valid_samples, 0),
                                cfg.parallel.distributed_timeout_minutes * 60)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if train is None:
        raise UsageError(f"--split {cfg.data.split} leaves no training documents")
    return train, valid


