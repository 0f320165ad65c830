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

A document is one or more sequences (sentences, for BERT). Both files are memory-mapped; on opening,
sizes are checked against the header and every length, offset and document index against the
others and the .bin, so a truncated or corrupt pair is reported, never read silently.

Next to the pair, megalite's writer leaves `PREFIX.meta.json` (not part of Megatron's format):
{max_token_id, min_token_id, num_tokens, ...}, so that the largest id is known without reading the
.bin. Pairs without one (e.g. from Megatron-LM) are scanned once and the result cached.
"""
from __future__ import annotations

import json
import os
import socket
import struct
from pathlib import Path

import numpy as np

from megalite.data.cache import file_lock
from megalite.data.errors import DatasetError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")
META_FORMAT = "megalite-indexed-meta/1"
_CHUNK = 1 << 22  # entries (or tokens) per vectorised step: bounds the temporary memory of checks


def token_dtype(vocab_size: int):
    """The smallest dtype that holds every token id of a vocabulary."""
    return np.uint16 if vocab_size < 65536 else np.int32


def _first(bad: np.ndarray) -> int | None:
    hits = np.flatnonzero(bad)
    return int(hits[0]) if len(hits) else None


def _check_sequences(idx_path, bin_path, bin_size: int, lengths, pointers, dtype) -> None:
    """Lengths non-negative; offsets aligned, each where the previous sequence ends (as the format
    writes them), and every sequence inside the .bin. Names the first bad entry. Reductions find
    a problem; only then is its position looked for."""
    size = dtype.itemsize  # 1, 2, 4 or 8: alignment is a bit mask
    prev_end = None
    for lo in range(0, len(lengths), _CHUNK):
        length, start = lengths[lo:lo + _CHUNK], np.asarray(pointers[lo:lo + _CHUNK])
        if length.min() < 0:
            i = _first(length < 0)
            raise DatasetError(f"{idx_path} is corrupt: sequence {lo + i} has length {length[i]}; re-run preprocessing")
        if start.min() < 0 or (start & (size - 1)).any():
            i = _first((start < 0) | (start & (size - 1) != 0))
            raise DatasetError(f"{idx_path} is corrupt: sequence {lo + i} starts at byte {start[i]}, not a "
                               f"non-negative multiple of the {size}-byte {dtype}; re-run preprocessing")
        end = start + np.multiply(length, size, dtype=np.int64)
        # Sequence j must start where sequence j - 1 ends (the chunk's first: the previous chunk's last).
        follows = end[:-1] if prev_end is None else np.concatenate([[prev_end], end[:-1]])
        starts = start[1:] if prev_end is None else start
        if (starts != follows).any():
            i = _first(starts != follows)
            at = lo + i + (1 if prev_end is None else 0)
            raise DatasetError(f"{idx_path} is corrupt: sequence {at} starts at byte {starts[i]}, but sequence "
                               f"{at - 1} ends at byte {follows[i]}; re-run preprocessing")
        if end[-1] > bin_size:  # consecutive sequences: the last ends furthest
            i = _first(end > bin_size)
            raise DatasetError(f"{bin_path} is truncated: {bin_size} bytes, but sequence {lo + i} needs bytes "
                               f"{start[i]}..{end[i]}; re-run preprocessing")
        prev_end = int(end[-1])


def _check_documents(idx_path, documents, n: int) -> None:
    """doc[0] = 0, doc[-1] = N, non-decreasing: documents cover the sequences in order."""
    if len(documents) == 0:
        raise DatasetError(f"{idx_path} is corrupt: the document index is empty (it holds at least [0]); "
                           f"re-run preprocessing")
    if documents[0] != 0 or documents[-1] != n:
        raise DatasetError(f"{idx_path} is corrupt: document indices run from {documents[0]} to {documents[-1]}, "
                           f"not from 0 to the {n} sequences; re-run preprocessing")
    for lo in range(0, len(documents), _CHUNK):
        part = np.asarray(documents[lo:lo + _CHUNK + 1])  # one entry of overlap: order across chunks
        if part.min() >= 0 and part.max() <= n and (part[1:] >= part[:-1]).all():
            continue
        bad = (part < 0) | (part > n)
        bad[1:] |= part[1:] < part[:-1]
        i = _first(bad)
        raise DatasetError(f"{idx_path} is corrupt: document index entry {lo + i} is {part[i]}, outside 0..{n} or "
                           f"below the entry before it; re-run preprocessing")


def _stamp(prefix: str) -> dict:
    """What identifies one version of a pair: sizes and modification times."""
    idx, bin_ = os.stat(prefix + ".idx"), os.stat(prefix + ".bin")
    return {"idx_bytes": idx.st_size, "bin_bytes": bin_.st_size, "idx_mtime": idx.st_mtime_ns,
            "bin_mtime": bin_.st_mtime_ns}


def _read_json(path: Path) -> dict:
    """The JSON object in `path`, or {} when it is missing or unreadable (a cache to rebuild)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _write_json_atomic(path: Path, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(value, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class IndexedDataset:
    """`len(ds)` sequences; `ds[i]` is sequence i as a numpy array (a view of the mapped file)."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        idx_path, bin_path = Path(self.prefix + ".idx"), Path(self.prefix + ".bin")
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise DatasetError(f"dataset file {path} does not exist: a data path (--data-path, --train-data-path, ...) "
                                   f"names the prefix of a .bin/.idx pair written by `python -m megalite.data.preprocess`")
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
        _check_sequences(idx_path, bin_path, bin_size, self.sequence_lengths, self.sequence_pointers, self.dtype)
        _check_documents(idx_path, self.document_indices, n)
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

    def token_range(self, lock_timeout: float | None = None) -> tuple[int, int] | None:
        """(smallest, largest) token id, None when there are no tokens: from the sidecar
        PREFIX.meta.json when it matches the pair, else scanned once (by one rank, under the cache
        lock) and cached in PREFIX.cache/token-range.json."""
        stamp = _stamp(self.prefix)
        meta = _read_json(Path(self.prefix + ".meta.json"))
        if (meta.get("format") == META_FORMAT and meta.get("stamp") == {k: stamp[k] for k in ("idx_bytes", "bin_bytes")}
                and all(isinstance(meta.get(k), int) for k in ("min_token_id", "max_token_id"))):
            return meta["min_token_id"], meta["max_token_id"]
        cache = Path(self.prefix + ".cache") / "token-range.json"
        cached = _read_json(cache)
        if cached.get("stamp") != stamp:
            try:
                with file_lock(cache.parent / ".token-range.lock", lock_timeout):
                    cached = _read_json(cache)
                    if cached.get("stamp") != stamp:
                        cached = {"stamp": stamp, **self._scan_token_range()}
                        _write_json_atomic(cache, cached)
            except OSError:  # data on a read-only file system: scan, uncached
                cached = self._scan_token_range()
        return None if cached.get("max") is None else (cached["min"], cached["max"])

    def _scan_token_range(self) -> dict:
        """{"min": id, "max": id} over the whole .bin, vectorised chunk by chunk (both None without tokens)."""
        if not len(self) or not self.sequence_lengths.any():
            return {"min": None, "max": None}
        start = int(self.sequence_pointers[0])
        end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
        tokens = self._bin[start:end].view(self.dtype)
        lo, hi = None, None
        for i in range(0, len(tokens), _CHUNK):
            chunk = tokens[i:i + _CHUNK]
            lo = chunk.min() if lo is None else min(lo, chunk.min())
            hi = chunk.max() if hi is None else max(hi, chunk.max())
        return {"min": int(lo), "max": int(hi)}

    def check_token_ids(self, vocab_size: int, lock_timeout: float | None = None) -> None:
        """Refuse a dataset holding ids the model's embedding does not have (a wrong tokenizer):
        at tp=1 they would crash the lookup, at tp>1 train silently on zero embeddings."""
        found = self.token_range(lock_timeout)
        if found is None:
            return
        lo, hi = found
        if hi >= vocab_size:
            raise DatasetError(f"dataset {self.prefix} holds token id {hi}, outside the vocabulary of {vocab_size} ids "
                               f"(0..{vocab_size - 1}): give the --tokenizer it was preprocessed with, or a "
                               f"--vocab-size above {hi}")
        if lo < 0:
            raise DatasetError(f"dataset {self.prefix} holds token id {lo}, below 0: the .bin is corrupt or not "
                               f"token ids; re-run preprocessing")


class IndexedDatasetWriter:
    """Writes a .bin/.idx pair and its PREFIX.meta.json: `add_document([seq, seq, ...])`, then
    `finalize()`. As a context manager, an exception before `finalize()` calls `abort()`.

    Files are written under temporary names and renamed at `finalize()`, so a crash never leaves a
    half-written dataset under the final name; `abort()` (or a failing `finalize()`) removes them."""

    def __init__(self, prefix: str | os.PathLike, dtype=np.uint16):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp, self._idx_tmp = self.prefix + ".bin.tmp", self.prefix + ".idx.tmp"
        self._meta_tmp = self.prefix + ".meta.json.tmp"
        self._bin = open(self._bin_tmp, "wb")
        self._lengths: list[int] = []
        self._documents = [0]
        self._min_id: int | None = None
        self._max_id: int | None = None

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None:
            self.abort()

    def add_document(self, sequences) -> None:
        for seq in sequences:
            arr = np.asarray(seq, dtype=self.dtype)
            self._bin.write(arr.tobytes(order="C"))
            self._lengths.append(len(arr))
            if len(arr):
                lo, hi = int(arr.min()), int(arr.max())
                self._min_id = lo if self._min_id is None else min(self._min_id, lo)
                self._max_id = hi if self._max_id is None else max(self._max_id, hi)
        self._documents.append(len(self._lengths))

    def abort(self) -> None:
        """Close and remove the temporary files: nothing is left behind."""
        self._bin.close()
        for tmp in (self._bin_tmp, self._idx_tmp, self._meta_tmp):
            Path(tmp).unlink(missing_ok=True)

    def finalize(self) -> None:
        try:
            self._write_index_and_meta()
        except BaseException:
            self.abort()
            raise

    def _write_index_and_meta(self) -> None:
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths):
            pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64)) * self.dtype.itemsize
        with open(self._idx_tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(lengths), len(self._documents)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(np.asarray(self._documents, dtype=np.int64).tobytes())
            f.flush()
            os.fsync(f.fileno())
        # The sizes tie the sidecar to this pair: a pair rewritten by another tool is scanned instead.
        meta = {"format": META_FORMAT, "max_token_id": self._max_id, "min_token_id": self._min_id,
                "num_tokens": int(lengths.astype(np.int64).sum()), "num_sequences": len(lengths),
                "num_documents": len(self._documents) - 1, "dtype": str(self.dtype),
                "stamp": {"idx_bytes": os.stat(self._idx_tmp).st_size, "bin_bytes": os.stat(self._bin_tmp).st_size}}
        with open(self._meta_tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(meta, indent=1) + "\n")
        os.replace(self._bin_tmp, self.prefix + ".bin")
        os.replace(self._idx_tmp, self.prefix + ".idx")
        os.replace(self._meta_tmp, self.prefix + ".meta.json")
