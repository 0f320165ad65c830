"""BERT samples: sentence pairs with masked tokens and a sentence-order label.

The dataset's documents are lists of sentences (`preprocess --split-sentences`). A cached index
(built once, like GPT's) groups consecutive sentences of a document into segments of up to
seq_length - 3 tokens (a shorter target with probability `short_seq_prob`), at least two sentences
each (one without the binary head), over as many epochs as needed, in a seeded shuffled order.
Sample k is then made deterministically from (seed, k):
- the segment is cut at a random sentence boundary into A and B; with probability 1/2 they are
  swapped (sentence-order label 1, else 0); the longer side is trimmed until the pair fits;
- tokens are [CLS] A [SEP] B [SEP] (token types 0 for [CLS] A [SEP], 1 for B [SEP]), padded;
  without the binary head (--bert-no-binary-head) the whole segment is A: [CLS] A [SEP], label 0;
- `mask_prob` (15%) of the non-special positions are chosen for prediction: 80% become [MASK],
  10% a random token, 10% stay; `labels` hold the originals, `loss_mask` marks them.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from megalite.data.cache import cached_arrays
from megalite.data.gpt_dataset import split_ranges
from megalite.data.indexed import DatasetError, IndexedDataset


class BERTDataset:
    def __init__(self, indexed: IndexedDataset, documents: tuple[int, int], num_samples: int, seq_length: int,
                 seed: int, vocab_size: int, specials: dict, name: str = "train", mask_prob: float = 0.15,
                 short_seq_prob: float = 0.1, lock_timeout: float | None = None, binary_head: bool = True):
        self.indexed, self.seq_length, self.num_samples, self.seed = indexed, seq_length, num_samples, seed
        self.vocab_size, self.mask_prob, self.binary_head = vocab_size, mask_prob, binary_head
        least = 2 if binary_head else 1  # sentences a segment needs: a pair, or one segment
        self.cls, self.sep, self.mask, self.pad = (specials[k] for k in ("cls", "sep", "mask", "pad"))
        max_tokens = seq_length - 3
        idx_path = Path(indexed.prefix + ".idx")
        key = {"kind": f"bert-{name}", "prefix": os.path.realpath(indexed.prefix), "size": idx_path.stat().st_size,
               "mtime": idx_path.stat().st_mtime_ns, "documents": list(documents), "num_samples": num_samples,
               "seq_length": seq_length, "seed": seed, "short_seq_prob": short_seq_prob}
        if not binary_head:  # (keys of caches built before stay as they were)
            key["least_sentences"] = least

        def build():
            lengths = indexed.sequence_lengths
            rng = np.random.RandomState(seed % 2**32)
            segments: list[tuple[int, int]] = []
            epoch = 0
            while len(segments) < num_samples:
                before = len(segments)
                for doc in range(*documents):
                    lo, hi = int(indexed.document_indices[doc]), int(indexed.document_indices[doc + 1])
                    target = max_tokens if rng.random_sample() >= short_seq_prob else rng.randint(2, max_tokens + 1)
                    start, tokens = lo, 0
                    for sent in range(lo, hi):
                        tokens += int(lengths[sent])
                        if tokens >= target or sent == hi - 1:
                            if sent + 1 - start >= least:  # a pair needs two sentences, one segment one
                                segments.append((start, sent + 1))
                            start, tokens = sent + 1, 0
                            target = max_tokens if rng.random_sample() >= short_seq_prob else rng.randint(
                                2, max_tokens + 1)
                if len(segments) == before:
                    raise DatasetError(f"the {name} split of {indexed.prefix} has no document with {least} sentences: "
                                       f"BERT needs data preprocessed with --split-sentences")
                epoch += 1
            segments_arr = np.asarray(segments[:num_samples], dtype=np.int64)
            return {"segments": segments_arr[np.random.RandomState((seed + 1) % 2**32).permutation(num_samples)]}

        self.segments = cached_arrays(Path(indexed.prefix + ".cache"), key, build, lock_timeout)["segments"]

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, k: int) -> dict[str, np.ndarray]:
        k %= self.num_samples
        rng = np.random.RandomState((self.seed * 1_000_003 + k) % 2**32)
        lo, hi = (int(x) for x in self.segments[k])
        cut = rng.randint(lo + 1, hi) if self.binary_head else hi
        a = np.concatenate([self.indexed[i] for i in range(lo, cut)]).astype(np.int64)
        b = np.concatenate([self.indexed[i] for i in range(cut, hi)] or [[]]).astype(np.int64)
        swapped = self.binary_head and rng.random_sample() < 0.5
        if swapped:
            a, b = b, a
        max_tokens = self.seq_length - 3
        while len(a) + len(b) > max_tokens:  # trim the longer side, from a random end
            longer = a if len(a) >= len(b) else b
            trimmed = longer[1:] if rng.random_sample() < 0.5 else longer[:-1]
            a, b = (trimmed, b) if longer is a else (a, trimmed)
        second = np.concatenate([b, [self.sep]]) if self.binary_head else np.zeros(0, np.int64)
        tokens = np.concatenate([[self.cls], a, [self.sep], second]).astype(np.int64)
        types = np.concatenate([np.zeros(len(a) + 2, np.int64), np.ones(len(second), np.int64)])
        n = len(tokens)
        labels, loss_mask = np.zeros(self.seq_length, np.int64), np.zeros(self.seq_length, np.float32)
        candidates = np.asarray([i for i in range(n) if tokens[i] not in (self.cls, self.sep)])
        num_masked = max(1, int(round(len(candidates) * self.mask_prob)))
        chosen = np.sort(rng.choice(candidates, size=min(num_masked, len(candidates)), replace=False))
        labels[chosen], loss_mask[chosen] = tokens[chosen], 1.0
        tokens = tokens.copy()
        for i in chosen:
            r = rng.random_sample()
            if r < 0.8:
                tokens[i] = self.mask
            elif r < 0.9:
                tokens[i] = rng.randint(0, self.vocab_size)
        pad = self.seq_length - n
        return {
            "tokens": np.concatenate([tokens, np.full(pad, self.pad, np.int64)]),
            "token_types": np.concatenate([types, np.zeros(pad, np.int64)]),
            "padding_mask": np.concatenate([np.ones(n, bool), np.zeros(pad, bool)]),
            "labels": labels, "loss_mask": loss_mask, "sop_labels": np.int64(swapped),
        }

    def batch(self, indices) -> dict[str, torch.Tensor]:
        samples = [self.sample(k) for k in indices]
        return {key: torch.from_numpy(np.stack([s[key] for s in samples])) for key in samples[0]}


def build_bert_datasets(prefix: str | None, split: str, seq_length: int, num_samples: tuple[int, int, int],
                        seed: int, tokenizer, vocab_size: int | None = None, lock_timeout: float | None = None,
                        mask_prob: float = 0.15, short_seq_prob: float = 0.1, binary_head: bool = True,
                        per_split: tuple | None = None) -> tuple:
    """(train, valid, test); None for a split with no documents or no samples asked. `prefix` is cut
    into the splits by `split`, or `per_split` names each split's prefix (every document of it; None
    for a split not named). The datasets' ids must lie below `vocab_size` (the model's; default the
    tokenizer's), else DatasetError. `lock_timeout`: seconds to wait for another rank building the
    cache. `mask_prob`, `short_seq_prob`, `binary_head`: Megatron-LM's --mask-prob, --short-seq-prob
    and (False) --bert-no-binary-head."""
    tokenizer.require("cls", "sep", "mask", "pad")
    if seq_length < 8:
        raise ValueError(f"--seq-length {seq_length} is too short for BERT sentence pairs (at least 8)")
    prefixes = (prefix,) * 3 if per_split is None else per_split
    opened = {p: IndexedDataset(p) for p in dict.fromkeys(prefixes) if p is not None}
    for indexed in opened.values():
        indexed.check_token_ids(vocab_size or tokenizer.vocab_size, lock_timeout)
    specials = {k: getattr(tokenizer, k) for k in ("cls", "sep", "mask", "pad")}
    out = []
    for which, name in enumerate(("train", "valid", "test")):
        if prefixes[which] is None:
            out.append(None)
            continue
        indexed = opened[prefixes[which]]
        lo, hi = (split_ranges(indexed.num_documents, split)[which] if per_split is None
                  else (0, indexed.num_documents))
        n = num_samples[which]
        out.append(BERTDataset(indexed, (lo, hi), n, seq_length, seed, tokenizer.vocab_size, specials, name,
                               mask_prob, short_seq_prob, lock_timeout, binary_head) if hi > lo and n > 0 else None)
    return tuple(out)
