"""Indexed datasets: token sequences in a `.bin` file, their index in a `.idx` file.

The layout is Megatron-LM's ("MMIDIDX", version 1), so datasets preprocessed by Megatron load
unchanged and ours load in Megatron (docs/data.md documents it byte by byte):

    .idx:  b"MMIDIDX\\x00\\x00"   9-byte magic
           <Q version = 1
           <B dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
           <Q number of sequences N
           <Q number of document-index entries D (documents + 1)
           int32[N]  sequence lengths (tokens)
           int64[N]  sequence byte offsets into .bin
           int64[D]  document indices: sequences [doc[i], doc[i+1]) form document i
    .bin:  the sequences' tokens back to back, in the dtype above

A document is one or more sequences (sentences, for BERT). Both files are memory-mapped; sizes are
checked against the header so a truncated or corrupt pair is reported, never read silently.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")


class DatasetError(ValueError):
    """A dataset file is missing, truncated or corrupt."""


def token_dtype(vocab_size: int):
    """The smallest dtype that holds every token id of a vocabulary."""
    return np.uint16 if vocab_size < 65536 else np.int32


class IndexedDataset:
    """`len(ds)` sequences; `ds[i]` is sequence i as a numpy array (a view of the mapped file)."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        idx_path, bin_path = Path(self.prefix + ".idx"), Path(self.prefix + ".bin")
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise DatasetError(f"dataset file {path} does not exist: --data-path takes the prefix of a "
                                   f".bin/.idx pair written by `python -m megalite.data.preprocess`")
        idx_size = idx_path.stat().st_size
        if idx_size < _HEADER.size:
            raise DatasetError(f"{idx_path} is truncated ({idx_size} bytes, shorter than the header)")
        with open(idx_path, "rb") as f:
            magic, version, code, n, d = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC:
            raise DatasetError(f"{idx_path} is not an indexed-dataset index (bad magic {magic!r})")
        if version != VERSION:
            raise DatasetError(f"{idx_path} has index version {version}; only version {VERSION} is supported")
        if code not in DTYPE_CODES:
            raise DatasetError(f"{idx_path} has an unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER.size + 4 * n + 8 * n + 8 * d
        if idx_size < expected:
            raise DatasetError(f"{idx_path} is truncated: {idx_size} bytes, the header announces {expected} "
                               f"({n} sequences, {d} document entries); re-run preprocessing")
        index = np.memmap(idx_path, mode="r", dtype=np.uint8, offset=_HEADER.size, shape=(expected - _HEADER.size,))
        self.sequence_lengths = index[:4 * n].view(np.int32)
        self.sequence_pointers = index[4 * n:12 * n].view(np.int64)
        self.document_indices = index[12 * n:12 * n + 8 * d].view(np.int64)
        bin_size = bin_path.stat().st_size
        needed = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if n else 0
        if bin_size < needed:
            raise DatasetError(f"{bin_path} is truncated: {bin_size} bytes, the index needs {needed}; "
                               f"re-run preprocessing")
        if d and (self.document_indices[0] != 0 or self.document_indices[-1] != n
                  or np.any(np.diff(self.document_indices) < 0)):
            raise DatasetError(f"{idx_path} is corrupt: document indices do not cover the {n} sequences in order")
        if n and (np.any(self.sequence_lengths < 0) or np.any(self.sequence_pointers < 0)):
            raise DatasetError(f"{idx_path} is corrupt: negative sequence lengths or offsets")
        self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8) if bin_size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i."""
        n = int(self.sequence_lengths[i])
        length = n - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > n:
            raise IndexError(f"tokens {offset}:{offset + length} out of sequence {i} of length {n}")
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return self._bin[start:start + length * self.dtype.itemsize].view(self.dtype)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1


class IndexedDatasetWriter:
    """Writes a .bin/.idx pair: `add_document([seq, seq, ...])`, then `finalize()`.

    Files are written under temporary names and renamed at `finalize()`, so a crash never leaves a
    half-written dataset under the final name."""

    def __init__(self, prefix: str | os.PathLike, dtype=np.uint16):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = self.prefix + ".bin.tmp"
        self._bin = open(self._bin_tmp, "wb")
        self._lengths: list[int] = []
        self._documents = [0]

    def add_document(self, sequences) -> None:
        for seq in sequences:
            arr = np.asarray(seq, dtype=self.dtype)
            self._bin.write(arr.tobytes(order="C"))
            self._lengths.append(len(arr))
        self._documents.append(len(self._lengths))

    def finalize(self) -> None:
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths):
            pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64)) * self.dtype.itemsize
        idx_tmp = self.prefix + ".idx.tmp"
        with open(idx_tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(lengths), len(self._documents)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(np.asarray(self._documents, dtype=np.int64).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._bin_tmp, self.prefix + ".bin")
        os.replace(idx_tmp, self.prefix + ".idx")
