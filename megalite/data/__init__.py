"""Datasets and tokenizers: indexed .bin/.idx files, GPT and BERT samples, the embedded corpus."""
from __future__ import annotations

from megalite.data.gpt_dataset import BlendedDataset, GPTDataset, build_gpt_datasets
from megalite.data.indexed import DatasetError, IndexedDataset, IndexedDatasetWriter
from megalite.data.synthetic import SyntheticTokens
from megalite.data.tokenizers import Tokenizer, TokenizerError, build_tokenizer, train_sentencepiece


def resolve_data(args, kind: str) -> None:
    """Fill in --data-path and --tokenizer (the embedded corpus when none is given) and set
    args.vocab_size from the tokenizer. Problems become one-line usage errors."""
    from megalite.data.corpus import embedded_corpus
    from megalite.runtime import UsageError, say

    if args.mock_data:
        return
    try:
        if not args.data_path:
            if args.tokenizer:
                raise UsageError("--tokenizer needs --data-path (data preprocessed with that tokenizer)")
            corpus = embedded_corpus(log=say)
            args.data_path = [corpus.gpt_prefix if kind == "gpt" else corpus.bert_prefix]
            args.tokenizer = corpus.tokenizer
        elif not args.tokenizer:
            raise UsageError("--data-path needs --tokenizer: the tokenizer the data was preprocessed with")
        tokenizer = build_tokenizer(args.tokenizer)
    except (FileNotFoundError, ImportError, DatasetError, OSError) as e:
        raise UsageError(str(e)) from None
    if args.vocab_size is not None and args.vocab_size < tokenizer.vocab_size:
        raise UsageError(f"--vocab-size {args.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}")
    args.vocab_size = args.vocab_size or tokenizer.vocab_size
    args.tokenizer_object = tokenizer


def train_valid_datasets(args, vocab_size: int, synthetic, build) -> tuple:
    """(train, valid or None) for a run: with --mock-data two `synthetic(vocab_size, seq_length,
    seed)` streams, else `build(samples, lock_timeout)`'s datasets for (train, valid, test) sample
    counts, waiting on another rank's cache no longer than on a collective. Bad data becomes one
    usage error."""
    from megalite.runtime import UsageError

    if args.mock_data:
        return (synthetic(vocab_size, args.seq_length, seed=args.seed),
                synthetic(vocab_size, args.seq_length, seed=args.seed + 1))
    valid_samples = args.eval_iters * args.global_batch_size if args.eval_interval else 0
    try:
        train, valid, _ = build((args.train_iters * args.global_batch_size, valid_samples, 0),
                                args.distributed_timeout_minutes * 60)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if train is None:
        raise UsageError(f"--split {args.split} leaves no training documents")
    return train, valid


__all__ = ["BlendedDataset", "DatasetError", "GPTDataset", "IndexedDataset", "IndexedDatasetWriter",
           "SyntheticTokens", "Tokenizer", "TokenizerError", "build_gpt_datasets", "build_tokenizer", "resolve_data",
           "train_sentencepiece", "train_valid_datasets"]
