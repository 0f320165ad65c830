"""Rank files in the safetensors layout, written and read without pickle.

A file is: 8 bytes (little-endian u64) header length N, N bytes of JSON (space-padded to a multiple
of 8), then the raw bytes of every tensor back to back. The header maps each tensor's key to
{"dtype", "shape", "data_offsets": [begin, end)} (offsets counted from the end of the header) and
holds string metadata under "__metadata__": "megalite" (the JSON structure of the rank's state)
and "crc32" (a JSON map of key -> 8 hex digits, the CRC-32 of the tensor's bytes) and "finite"
(key -> 1, or 0 if the tensor held NaN/inf when it was written). Tensors are
ordered by element size, largest first, so every tensor starts aligned to its element size and a
memory map serves zero-copy views. The `safetensors` package reads these files as they are.
Plain data in the structure (RNG streams, replicas) is nested JSON whose tensors are named by their keys
(`encode_plain` / `decode_plain`).
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_BY_NAME = {v: k for k, v in _DTYPES.items()}
_WRITE_BUFFER = 16 << 20  # coalesces the small tensors; large ones go straight from their memory
_MAX_HEADER = 256 << 20
_CHECK_THREADS = 2  # checksums beside the writing thread
_READ_CHUNK = 64 << 20


class RankFileError(Exception):
    """A rank file that cannot be read as written (the caller names the file)."""


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy (t is a contiguous CPU tensor)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/inf in t. A sum is NaN/inf whenever an element is (and, rarely, when it overflows,
    which the exact check then clears): one fast pass in the common case."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    return bool(torch.isfinite(t.sum(dtype=torch.float32))) or bool(torch.isfinite(t).all())


def encode_plain(obj, key: str, add):
    """Nested dicts/lists of tensors and plain values -> JSON, tensors replaced by {"tensor": key}."""
    if torch.is_tensor(obj):
        return {"tensor": add(key, obj)}
    if isinstance(obj, dict):
        return {"dict": {str(k): encode_plain(v, f"{key}/{k}", add) for k, v in obj.items()}}
    if isinstance(obj, (list, tuple)):
        return {"list": [encode_plain(v, f"{key}/{i}", add) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"value": obj}
    raise TypeError(f"{key}: a checkpoint holds tensors and plain data, not {type(obj).__name__}")


def decode_plain(obj, tensor):
    """The inverse of `encode_plain`; `tensor(key)` supplies each stored tensor."""
    kind, value = next(iter(obj.items()))
    if kind == "tensor":
        return tensor(value)
    if kind == "dict":
        return {k: decode_plain(v, tensor) for k, v in value.items()}
    if kind == "list":
        return [decode_plain(v, tensor) for v in value]
    return value


def _header(entries, meta: dict, crcs: dict[str, int], finite: dict[str, bool]) -> bytes:
    header: dict = {}
    offset = 0
    for key, t in entries:
        n = t.numel() * t.element_size()
        header[key] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt", "megalite": json.dumps(meta, separators=(",", ":")),
                              "crc32": json.dumps({k: f"{crcs.get(k, 0):08x}" for k, _ in entries}),
                              "finite": json.dumps({k: int(finite.get(k, True)) for k, _ in entries})}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def order_for_alignment(entries):
    """Largest elements first: every tensor then starts at a multiple of its element size."""
    return sorted(entries, key=lambda e: -e[1].element_size())


def _check_values(t: torch.Tensor) -> tuple[int, bool]:
    return zlib.crc32(_bytes_of(t)), all_finite(t)


def write_rank_file(path: Path, entries, meta: dict, after_bytes=None) -> int:
    """Write (key, contiguous CPU tensor) entries and `meta`; fsync; return the file's size.
    The header goes out with placeholder checksums and is rewritten (same length) at the end; the
    checksums and finiteness flags are computed by helper threads while the data is written (zlib
    and torch release the GIL). `after_bytes(n)` is called after each tensor (tests inject faults)."""
    entries = [(key, t.contiguous()) for key, t in order_for_alignment(entries)]
    for key, t in entries:
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {key} has dtype {t.dtype}, which a rank file cannot hold")
    placeholder = _header(entries, meta, {}, {})
    written = 0
    with ThreadPoolExecutor(max_workers=_CHECK_THREADS, thread_name_prefix="megalite-crc") as pool:
        checks = [pool.submit(_check_values, t) for _, t in entries]
        with open(path, "wb", buffering=_WRITE_BUFFER) as f:
            f.write(struct.pack("<Q", len(placeholder)))
            f.write(placeholder)
            for key, t in entries:
                data = _bytes_of(t)
                f.write(data)
                written += len(data)
                if after_bytes is not None:
                    after_bytes(written)
            f.flush()
            results = [c.result() for c in checks]
            crcs = {key: crc for (key, _), (crc, _) in zip(entries, results)}
            finite = {key: ok for (key, _), (_, ok) in zip(entries, results)}
            final = _header(entries, meta, crcs, finite)
            assert len(final) == len(placeholder)  # fixed-width checksums and flags keep every offset valid
            f.seek(8)
            f.write(final)
            f.flush()
            os.fsync(f.fileno())
    return 8 + len(placeholder) + written


class RankFile:
    """A memory-mapped rank file: its structure (`meta`) and its tensors as zero-copy views, each
    checked against its CRC-32 the first time it is read."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                (n,) = struct.unpack("<Q", f.read(8))
                if n > min(size - 8, _MAX_HEADER):
                    raise RankFileError(f"its header length {n} does not fit a {size}-byte file")
                header = json.loads(f.read(n))
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
            extra = header.pop("__metadata__")
            self.meta = json.loads(extra["megalite"])
            self._crcs = {k: int(v, 16) for k, v in json.loads(extra["crc32"]).items()}
            self._finite = {k: bool(v) for k, v in json.loads(extra.get("finite", "{}")).items()}
        except (RankFileError, struct.error, ValueError, KeyError, TypeError, AttributeError) as e:
            raise RankFileError(f"not a megalite rank file ({type(e).__name__}: {e})") from None
        self._start = 8 + n
        self._entries = header
        end = max((e["data_offsets"][1] for e in header.values()), default=0)
        if self._start + end != size:
            raise RankFileError(f"it has {size} bytes, its header describes {self._start + end}")
        self._verified: set[str] = set()

    def info(self, key: str) -> tuple[torch.dtype, list[int]] | None:
        e = self._entries.get(key)
        return None if e is None or e.get("dtype") not in _BY_NAME else (_BY_NAME[e["dtype"]], e.get("shape"))

    def is_verified(self, key: str) -> bool:
        return key in self._verified

    def is_finite(self, key: str) -> bool:
        """Whether the tensor held no NaN/inf when written (its checksum vouches it is unchanged)."""
        return self._finite.get(key, True)

    def keys(self):
        return self._entries.keys()

    def byte_range(self, key: str) -> tuple[int, int]:
        """Where tensor `key`'s bytes lie in the file (tools that inspect or damage files on purpose)."""
        lo, hi = self._entries[key]["data_offsets"]
        return self._start + lo, self._start + hi

    def tensor(self, key: str) -> torch.Tensor:
        try:
            e = self._entries[key]
            dtype, shape, (lo, hi) = _BY_NAME[e["dtype"]], e["shape"], e["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise RankFileError(f"its header has no valid entry for tensor {key} ({err})") from None
        count = hi - lo
        if key not in self._verified:
            self.verify(key)
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(self._map, dtype=torch.uint8, count=count, offset=self._start + lo)
        return flat.view(dtype).view(shape)

    def verify(self, key: str) -> None:
        """Check one tensor's bytes against its CRC-32 (zlib releases the GIL: threads run in parallel)."""
        try:
            lo, hi = self._entries[key]["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise RankFileError(f"its header has no valid entry for tensor {key} ({err})") from None
        if zlib.crc32(memoryview(self._map)[self._start + lo:self._start + hi]) != self._crcs.get(key):
            raise RankFileError(f"tensor {key} fails its CRC-32 check (the file was damaged after it was written)")
        self._verified.add(key)

    def read_into(self, key: str, dst: torch.Tensor) -> None:
        """Read tensor `key` straight into `dst` (contiguous, on the CPU, same dtype and size) with
        large reads: no page faults on a map, no intermediate copy. Check it with `verify_copy`."""
        lo, hi = self._entries[key]["data_offsets"]
        view = _bytes_of(dst)
        if len(view) != hi - lo:
            raise RankFileError(f"tensor {key} has {hi - lo} bytes, its destination {len(view)}")
        with open(self.path, "rb", buffering=0) as f:
            done = 0
            while done < len(view):
                n = os.preadv(f.fileno(), [view[done:done + _READ_CHUNK]], self._start + lo + done)
                if n <= 0:
                    raise RankFileError(f"tensor {key} ends early (the file is truncated)")
                done += n

    def verify_copy(self, key: str, dst: torch.Tensor) -> str | None:
        """None if `dst` (read by `read_into`) matches the stored CRC-32, else the problem."""
        if zlib.crc32(_bytes_of(dst)) != self._crcs.get(key):
            return f"tensor {key} fails its CRC-32 check (the file was damaged after it was written)"
        return None
