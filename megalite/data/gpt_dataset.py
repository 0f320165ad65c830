"""GPT samples from indexed datasets: documents concatenated and cut into seq_length + 1 tokens.

For a split (a contiguous range of documents) and a seed, three index arrays are built once and
cached next to the data (`<prefix>.cache/`, memory-mapped .npy files: megalite.data.cache), so
every run, rank and data-parallel size sees the same samples in the same order:
- order:  the split's sequences in a seeded random order, repeated over as many epochs as needed;
- starts: for each sample, where it starts in that order (position, token offset); sample i
          covers tokens [i * s, (i + 1) * s + 1) of the concatenation (one token overlaps, so
          labels are the inputs shifted by one);
- shuffle: a seeded permutation of the samples.
Sample k of training is `shuffle[k]`, so resuming from N consumed samples continues exactly.
Blending several datasets (`--data-path 0.7 A 0.3 B`) assigns each global sample to a dataset so
that every prefix of the stream keeps the weights as closely as possible; prefixes without weights
(`--data-path A B`) are each read once, weighted by their samples, as Megatron-LM blends them.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch

from megalite.data.cache import cached_arrays
from megalite.config.sections import split_weights
from megalite.data.indexed import DatasetError, IndexedDataset


def split_ranges(num_documents: int, split: str) -> list[tuple[int, int]]:
    """'949,50,1' -> train/valid/test document ranges, in proportion."""
    weights = split_weights(split)
    bounds = np.round(np.cumsum([0.0] + weights) / sum(weights) * num_documents).astype(int)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(3)]


class GPTDataset:
    def __init__(self, indexed: IndexedDataset, documents: tuple[int, int], num_samples: int, seq_length: int,
                 seed: int, name: str = "train", lock_timeout: float | None = None):
        self.indexed, self.seq_length, self.num_samples = indexed, seq_length, num_samples
        doc_lo, doc_hi = documents
        seq_lo, seq_hi = int(indexed.document_indices[doc_lo]), int(indexed.document_indices[doc_hi])
        lengths = indexed.sequence_lengths[seq_lo:seq_hi].astype(np.int64)
        tokens_per_epoch = int(lengths.sum())
        if tokens_per_epoch <= seq_length:
            raise DatasetError(f"the {name} split of {indexed.prefix} has {tokens_per_epoch} tokens, too few for "
                               f"one sample of {seq_length + 1}: use more data, a shorter --seq-length or another --split")
        idx_path = Path(indexed.prefix + ".idx")
        key = {"kind": f"gpt-{name}", "prefix": os.path.realpath(indexed.prefix), "size": idx_path.stat().st_size,
               "mtime": idx_path.stat().st_mtime_ns, "sequences": [seq_lo, seq_hi], "num_samples": num_samples,
               "seq_length": seq_length, "seed": seed}

        def build():
            epochs = math.ceil((num_samples * seq_length + 1) / tokens_per_epoch)
            rng = np.random.RandomState(seed % 2**32)
            order = np.concatenate([rng.permutation(seq_hi - seq_lo) for _ in range(epochs)]) + seq_lo
            ends = np.cumsum(indexed.sequence_lengths[order].astype(np.int64))
            first_token = np.arange(num_samples + 1, dtype=np.int64) * seq_length
            pos = np.searchsorted(ends, first_token, side="right")
            offset = first_token - np.concatenate([[0], ends])[pos]
            shuffle = np.random.RandomState((seed + 1) % 2**32).permutation(num_samples)
            return {"order": order.astype(np.int64), "pos": pos.astype(np.int64), "offset": offset.astype(np.int64),
                    "shuffle": shuffle.astype(np.int64)}

        arrays = cached_arrays(Path(indexed.prefix + ".cache"), key, build, lock_timeout)
        self.order, self.pos, self.offset, self.shuffle = (arrays[k] for k in ("order", "pos", "offset", "shuffle"))

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, k: int) -> np.ndarray:
        """seq_length + 1 token ids of the k-th sample in training order."""
        i = int(self.shuffle[k % self.num_samples])
        pos, offset = int(self.pos[i]), int(self.offset[i])
        need, parts = self.seq_length + 1, []
        while need > 0:
            seq = int(self.order[pos])
            piece = self.indexed.get(seq, offset, min(need, int(self.indexed.sequence_lengths[seq]) - offset))
            parts.append(piece)
            need -= len(piece)
            pos, offset = pos + 1, 0
        return np.concatenate(parts).astype(np.int64)

    def batch(self, indices) -> dict[str, torch.Tensor]:
        tokens = torch.from_numpy(np.stack([self.sample(k) for k in indices]))
        return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                "loss_mask": torch.ones(len(tokens), self.seq_length)}


class BlendedDataset:
    """Sample k comes from dataset `choice[k]`, as its `within[k]`-th sample; the choice keeps every
    prefix of the stream as close to the weights as possible (greedy on the largest deficit)."""

    def __init__(self, datasets, weights, num_samples: int, cache_dir: Path, seed: int,
                 lock_timeout: float | None = None):
        w = np.asarray(weights, dtype=np.float64)
        self.datasets, self.weights, self.num_samples = datasets, w / w.sum(), num_samples
        key = {"kind": "blend", "weights": self.weights.tolist(), "num_samples": num_samples, "seed": seed,
               "datasets": [os.path.realpath(d.indexed.prefix) for d in datasets]}

        def build():
            counts = np.zeros(len(datasets), dtype=np.int64)
            choice = np.empty(num_samples, dtype=np.int64)
            within = np.empty(num_samples, dtype=np.int64)
            for k in range(num_samples):
                j = int(np.argmax(self.weights * (k + 1) - counts))
                choice[k], within[k] = j, counts[j]
                counts[j] += 1
            return {"choice": choice, "within": within}

        arrays = cached_arrays(cache_dir, key, build, lock_timeout)
        self.choice, self.within = arrays["choice"], arrays["within"]

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, k: int) -> np.ndarray:
        k %= self.num_samples
        return self.datasets[int(self.choice[k])].sample(int(self.within[k]))

    def batch(self, indices) -> dict[str, torch.Tensor]:
        tokens = torch.from_numpy(np.stack([self.sample(k) for k in indices]))
        return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                "loss_mask": torch.ones(len(tokens), tokens.shape[1] - 1)}


def _number(word: str) -> float | None:
    try:
        return float(word)
    except ValueError:
        return None


def parse_data_path(spec: list[str], flag: str = "--data-path") -> list[tuple[float | None, str]]:
    """['A'] or ['0.7', 'A', '0.3', 'B'] -> [(weight, prefix), ...]; prefixes alone, ['A', 'B'], ->
    [(None, 'A'), (None, 'B')]: Megatron-LM blends them by their sizes (`build_gpt_datasets`).
    `flag` names where the words came from."""
    if len(spec) == 1:
        return [(1.0, spec[0])]
    numbers = [_number(w) for w in spec]
    if len(spec) % 2 == 0 and all(n is not None for n in numbers[::2]):
        pairs = []
        for weight, p in zip(numbers[::2], spec[1::2]):
            if not weight > 0:
                raise ValueError(f"{flag}: weights must be positive, got {weight}")
            pairs.append((weight, p))
        return pairs
    if any(n is not None for n in numbers):  # Megatron-LM would look for a file named like a weight
        raise ValueError(f"{flag}: {' '.join(spec)} mixes weights and prefixes: give weight-prefix pairs "
                         f"(0.7 A 0.3 B), or prefixes alone (A B: blended by their sizes)")
    return [(None, p) for p in spec]


def epoch_samples(indexed: IndexedDataset, documents: tuple[int, int], seq_length: int) -> int:
    """Samples of seq_length + 1 tokens in one pass over `documents` (Megatron-LM's count: the last
    token only ever a label)."""
    lo, hi = int(indexed.document_indices[documents[0]]), int(indexed.document_indices[documents[1]])
    return max(0, (int(indexed.sequence_lengths[lo:hi].astype(np.int64).sum()) - 1) // seq_length)


def _check_one_sample_each(with_docs, seq_length: int, name: str, flag: str, cut_by_split: bool) -> None:
    """Each prefix read on its own (without weights, or as a validation set) must hold a sample."""
    for _, ds, r in with_docs:
        if not epoch_samples(ds, r, seq_length):
            where = f"the {name} split of {ds.prefix}" if cut_by_split else ds.prefix
            raise DatasetError(f"{flag}: {where} holds too few tokens for one sample of {seq_length + 1}: drop it "
                               f"from {flag}, or use a shorter --seq-length"
                               + (" or another --split" if cut_by_split else ""))


def _share(n: int, fraction: float) -> int:
    """Samples a dataset of a blend builds for its `fraction` of n: a margin, so the blend's choice
    never runs past its end."""
    return int(math.ceil(n * fraction * 1.005)) + 1


def build_gpt_datasets(data_path: list[str] | None, split: str, seq_length: int, num_samples: tuple[int, int, int],
                       seed: int, vocab_size: int | None = None, lock_timeout: float | None = None,
                       per_split: tuple | None = None, flags: tuple[str, str, str] | None = None,
                       valid_epoch: bool = False, valid_sets: bool = False):
    """(train, valid, test) datasets; a split with no documents or no samples asked gives None.
    `data_path` is cut into the splits by `split`; or `per_split` names each split's own data
    (Megatron-LM's --train/valid/test-data-path: every document of them; None for a split not named).
    With `vocab_size`, a dataset holding an id outside it is refused (DatasetError). `lock_timeout`:
    seconds to wait for another rank building a cache (megalite.data.cache.lock_timeout_s). `flags`:
    where each split's words came from, for the messages (megalite.data.blends.split_flags).
    `valid_epoch` (--full-validation): the validation split holds every sample of its data once, not
    num_samples[1]. `valid_sets` (--multiple-validation-sets): the validation split is a list of
    (prefix, dataset), one per prefix of its data (weights unused, as Megatron-LM's)."""
    flags = flags or (("--data-path",) * 3 if per_split is None else
                      ("--train-data-path", "--valid-data-path", "--test-data-path"))
    if per_split is None:
        pairs = parse_data_path(data_path, flags[0])
        blends = [pairs] * 3
    else:
        blends = [None if words is None else parse_data_path(words, flag) for words, flag in zip(per_split, flags)]
    opened: dict[str, IndexedDataset] = {}  # a prefix in several splits is opened (and checked) once
    for _, prefix in (pair for blend in blends if blend for pair in blend):
        if prefix not in opened:
            opened[prefix] = IndexedDataset(prefix)
            if vocab_size is not None:
                opened[prefix].check_token_ids(vocab_size, lock_timeout)
    out = []
    for which, name in enumerate(("train", "valid", "test")):
        n = num_samples[which]
        blend = blends[which] or []
        with_docs = [(w, opened[p], split_ranges(opened[p].num_documents, split)[which] if per_split is None
                      else (0, opened[p].num_documents)) for w, p in blend]
        with_docs = [(w, ds, r) for w, ds, r in with_docs if r[1] > r[0]]
        if which == 1 and n > 0 and valid_epoch:
            n = None  # every sample once: each dataset's own epoch
            if len(with_docs) > 1 and with_docs[0][0] is not None and not valid_sets:
                raise DatasetError(f"{flags[1]}: --full-validation reads every sample of the validation data once, "
                                   f"and weights would read some prefixes more than others: name the validation "
                                   f"data on its own without weights (--train-data-path with --valid-data-path A B), "
                                   f"or drop --full-validation")
        if n != 0 and (which == 1 and (valid_epoch or valid_sets) or with_docs and with_docs[0][0] is None):
            _check_one_sample_each(with_docs, seq_length, name, flags[which], per_split is None)
        if which == 1 and n != 0 and valid_sets and with_docs:  # each prefix as if it were the split's only one
            out.append([(ds.prefix, GPTDataset(ds, r, _share(n, 1.0) if n else max(epoch_samples(ds, r, seq_length), 1),
                                               seq_length, seed, name, lock_timeout)) for _, ds, r in with_docs])
            continue
        parts = []
        if with_docs and n is None and with_docs[0][0] is not None:  # one prefix, read once
            (_, ds, r), = with_docs
            parts = [(1.0, GPTDataset(ds, r, max(epoch_samples(ds, r, seq_length), 1), seq_length, seed, name,
                                      lock_timeout))]
        elif with_docs and n != 0 and with_docs[0][0] is None:
            # Prefixes without weights (Megatron-LM's blend of a list): each read once, one epoch of its
            # documents in the split, weighted by its samples; the split no larger than them all.
            sizes = [(epoch_samples(ds, r, seq_length), ds, r) for _, ds, r in with_docs]
            held = sum(size for size, _, _ in sizes)
            if which == 0 and n > held:  # (n is None: the validation split read whole)
                raise DatasetError(f"{flags[0]}: prefixes without weights are each read once (one epoch, as "
                                   f"Megatron-LM blends them): the training split holds {held} samples of "
                                   f"{seq_length + 1} tokens, the run reads {n}: give weights (0.5 A 0.5 B) to "
                                   f"read them repeatedly, or train fewer samples")
            n = held if n is None else min(n, held)  # validation wraps around
            parts = [(size, GPTDataset(ds, r, max(size, 1), seq_length, seed, name, lock_timeout))
                     for size, ds, r in sizes]
        elif n:
            total = sum(w for w, _, _ in with_docs)  # shares among the datasets this split has
            parts = [(w, GPTDataset(ds, (lo, hi), _share(n, w / total), seq_length, seed, name, lock_timeout))
                     for w, ds, (lo, hi) in with_docs]
        if not parts:
            out.append(None)
        elif len(parts) == 1:
            out.append(parts[0][1])
        else:
            out.append(BlendedDataset([d for _, d in parts], [w for w, _ in parts], n,
                                      Path(parts[0][1].indexed.prefix + ".cache"), seed, lock_timeout))
    return tuple(out)
