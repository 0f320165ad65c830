"""A save's host copy of this rank's tensors: one contiguous buffer (pinned, with CUDA), allocated
ahead of the first save and reused, so a background save never reads memory training changes."""
from __future__ import annotations

import contextlib
import mmap
import threading

import torch

_ALIGN = 64
_PAGE = mmap.PAGESIZE


class Snapshot:
    """One contiguous (pinned, with CUDA) host buffer, reused across saves: one copy per tensor.

    `prepare` allocates it ahead of the first save, in a background thread, so that the allocation
    (pinned memory is slow to allocate) and the first touch of its pages (on CPU these page faults
    cost more than the copy itself) overlap training; `take` waits only for what is not done yet."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self._preparing: threading.Thread | None = None

    def prepare(self, entries, pin: bool) -> None:
        """Start allocating the buffer that `take(entries)` uses, unless the one held is big enough.
        Only the entries' sizes are read: meta tensors will do."""
        self.wait()
        total = _layout(entries)[1]
        if self.buffer is not None and self.buffer.numel() >= total:
            return
        self.buffer = None  # let the old one go first
        device = torch.cuda.current_device() if pin else None  # the thread's own device would be GPU 0
        self._preparing = threading.Thread(target=self._allocate_quietly, args=(total, pin, device), daemon=True,
                                           name="megalite-checkpoint-buffer")
        self._preparing.start()

    def wait(self) -> None:
        """Return once a preparation under way is done."""
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None

    def _allocate_quietly(self, total: int, pin: bool, device) -> None:
        try:
            buffer = _allocate(total, pin, device)
            if not pin:  # pageable memory is resident once written; pinned memory is so from the start
                buffer[::_PAGE].zero_()
            self.buffer = buffer
        except Exception:  # noqa: BLE001 - out of memory, say: `take` allocates again and raises in the loop
            self.buffer = None

    def take(self, entries, unit_keys=(), units_gathered_in_turn=()):
        """Copies of `entries` in the host buffer. A tensor whose storage is a ZeRO-3 unit's (its
        key in `unit_keys`) is copied while `units_gathered_in_turn` holds that unit gathered."""
        self.wait()
        offsets, total = _layout(entries)
        if self.buffer is None or self.buffer.numel() < total:
            self.buffer = None  # let the old one go first
            pin = _pinned(entries)
            self.buffer = _allocate(total, pin, torch.cuda.current_device() if pin else None)
        out = []
        for (key, t), off in zip(entries, offsets):
            n = t.numel() * t.element_size()
            out.append((key, self.buffer[off:off + n].view(t.dtype).view(t.shape)))
        in_units: dict[int, list[int]] = {k: [] for k in unit_keys}
        for i, (_, t) in enumerate(entries):
            storage = t.untyped_storage()._cdata
            if storage in in_units:
                in_units[storage].append(i)  # its unit is free now: copied when gathered, below
            else:
                out[i][1].copy_(t, non_blocking=True)
        for storage in units_gathered_in_turn:  # collective: every DP rank walks every unit
            for i in in_units.get(storage, ()):
                out[i][1].copy_(entries[i][1], non_blocking=True)
        if any(t.is_cuda for _, t in entries):
            torch.cuda.synchronize()
        return out


def _layout(entries) -> tuple[list[int], int]:
    """Each entry's byte offset in the snapshot buffer, and the buffer's size."""
    offsets, total = [], 0
    for _, t in entries:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return offsets, total


def _pinned(entries) -> bool:
    return torch.cuda.is_available() and any(t.is_cuda for _, t in entries)


def _allocate(total: int, pin: bool, device) -> torch.Tensor:
    with torch.cuda.device(device) if pin else contextlib.nullcontext():  # pinned for this rank's GPU
        return torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
