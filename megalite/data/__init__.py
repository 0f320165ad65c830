"""Datasets and tokenizers: indexed .bin/.idx files, GPT and BERT samples, the embedded corpus."""
from __future__ import annotations

import dataclasses

from megalite.config.sections import DataConfig

from megalite.data.gpt_dataset import BlendedDataset, GPTDataset, build_gpt_datasets
from megalite.data.indexed import DatasetError, IndexedDataset, IndexedDatasetWriter
from megalite.data.synthetic import SyntheticTokens
from megalite.data.tokenizers import Tokenizer, TokenizerError, build_tokenizer, train_sentencepiece


def resolve_data(data: DataConfig, vocab_size: int | None,
                 kind: str) -> tuple[DataConfig, int | None, Tokenizer | None]:
    """(the data section with --data-path and --tokenizer filled in, the vocabulary size, the
    tokenizer): the embedded corpus when no data is given; the vocabulary at least the tokenizer's.
    Problems become one-line usage errors."""
    from megalite.data.corpus import embedded_corpus
    from megalite.errors import UsageError
    from megalite.runtime import say

    if data.mock_data:
        return data, vocab_size, None
    if data.tokenizer_type is None and not data.tokenizer and data.vocab_file:
        # Megatron-LM's entry points' defaults: GPT-2's BPE for GPT, lower-cased WordPiece for BERT
        kind_default = "GPT2BPETokenizer" if kind == "gpt" else "BertWordPieceLowerCase"
        data = dataclasses.replace(data, tokenizer_type=kind_default)
    megatron_kind = data.tokenizer_type not in (None, "NullTokenizer")
    try:
        if data.sft_data_path:
            if not data.tokenizer and not megatron_kind:
                raise UsageError("--sft-data-path needs --tokenizer: the tokenizer of the model being fine-tuned "
                                 "(a Hugging Face directory renders \"messages\" with its chat template)")
        elif not named_data(data):
            if data.tokenizer or megatron_kind:
                raise UsageError("--tokenizer needs --data-path (data preprocessed with that tokenizer)")
            corpus = embedded_corpus(log=say)
            data = dataclasses.replace(data, data_path=[corpus.gpt_prefix if kind == "gpt" else corpus.bert_prefix],
                                       tokenizer=corpus.tokenizer)
        elif not data.tokenizer and not megatron_kind:
            raise UsageError(f"{named_data(data)} needs --tokenizer (or Megatron-LM's --tokenizer-type and its files): "
                             f"the tokenizer the data was preprocessed with")
        tokenizer = data_tokenizer(data)
    except (FileNotFoundError, ImportError, DatasetError, OSError) as e:
        raise UsageError(str(e)) from None
    if vocab_size is not None and vocab_size < tokenizer.vocab_size:
        raise UsageError(f"--vocab-size {vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}")
    return data, vocab_size or tokenizer.vocab_size, tokenizer


def named_data(data: DataConfig) -> str | None:
    """The flag that names the run's indexed data, if one does."""
    for flag, value in (("--data-path", data.data_path), ("--data-args-path", data.data_args_path),
                        ("--train-data-path", data.train_data_path),
                        ("--per-split-data-args-path", data.per_split_data_args_path)):
        if value is not None and value != []:
            return flag
    return None


def data_tokenizer(data: DataConfig) -> Tokenizer:
    """The tokenizer of a resolved data section: --tokenizer, or Megatron-LM's --tokenizer-type."""
    if data.tokenizer:
        return build_tokenizer(data.tokenizer)
    return build_tokenizer((data.tokenizer_type, data.vocab_file, data.merge_file, data.tokenizer_model))


__all__ = ["BlendedDataset", "DatasetError", "GPTDataset", "IndexedDataset", "IndexedDatasetWriter",
           "SyntheticTokens", "Tokenizer", "TokenizerError", "build_gpt_datasets", "build_tokenizer", "data_tokenizer",
           "named_data",
           "resolve_data", "train_sentencepiece"]
