"""Flat host buffers backed by transparent huge pages.

A training step reads and writes the whole parameter and gradient buffers. On a CPU device, in
4 KiB pages, a 20 MB buffer spans 5,000 TLB entries, and how well those pages sit changes a step's
time by several per cent from one process to another. Linux can back a range with 2 MiB pages when
asked (`madvise(MADV_HUGEPAGE)`; most distributions set transparent huge pages to "madvise"), which
is what PyTorch's own `THP_MEM_ALLOC_ENABLE=1` does for every large allocation. megalite asks for
its flat buffers only: the request is made before the first write, so the pages are huge from the
first fault. Each buffer is a mapping of its own, unmapped when the tensor is freed: memory taken from
the allocator's heap would keep the advice after the buffer is gone and hand it to whatever is
allocated there next. Other devices, other systems and small buffers get a plain `torch.empty`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
_libc = None


def _madvise():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc.madvise


def huge_pages_apply(device: torch.device | str, nbytes: int) -> bool:
    """A CPU buffer of at least one huge page, on Linux with 4 KiB base pages (where a transparent
    huge page is 2 MiB; kernels with 64 KiB pages have other sizes and are left alone)."""
    return (torch.device(device).type == "cpu" and sys.platform.startswith("linux") and nbytes >= HUGE_PAGE
            and os.sysconf("SC_PAGE_SIZE") == 4096)


def empty_flat(numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An uninitialised 1-D tensor; on a Linux CPU and at 2 MiB or more, it starts on a 2 MiB
    boundary and its pages are advised huge before anything touches them."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if not huge_pages_apply(device, numel * itemsize):
        return torch.empty(numel, dtype=dtype, device=device)
    spare = HUGE_PAGE // itemsize
    # An anonymous mapping is zeroed and page-aligned; the tensor keeps it alive and its release unmaps it.
    raw = torch.frombuffer(mmap.mmap(-1, (numel + spare) * itemsize), dtype=dtype)
    skip = (-raw.data_ptr()) % HUGE_PAGE // itemsize
    flat = raw[skip:skip + numel]
    end = raw.data_ptr() + raw.numel() * itemsize  # advise nothing past the mapping
    length = (end - flat.data_ptr()) // 4096 * 4096
    # A refusal (THP "never", an old kernel) leaves ordinary pages: the buffer works either way.
    _madvise()(flat.data_ptr(), length, _MADV_HUGEPAGE)
    return flat


def zeros_flat(numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return empty_flat(numel, dtype, device).zero_()
