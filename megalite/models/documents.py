"""Attention confined to each of the documents packed into a sequence, and positions that restart
with each document (Megatron-LM's --reset-attention-mask and --reset-position-ids; the batch side
is megalite.data.documents).

`PackedDocuments` is what a GPT's layers receive in place of an attention mask. No s x s mask is
made: without context parallelism each document is attended on its own (`varlen_attention`: on a
GPU one variable-length flash kernel, `torch.nn.attention.varlen`, elsewhere one causal attention a
document), so the work is the sum of the documents' squares, not the sequence's; ring attention
masks each block by the documents its queries belong to (megalite.parallel.context_parallel).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from megalite.models.window import band_mask


@dataclass(frozen=True)
class PackedDocuments:
    """The documents of one micro-batch, as `megalite.data.documents.with_documents` describes them.

    starts (attention confined to documents, else None): [b, s here] int64 on the device, the global
    position of the first token of each of this rank's tokens' document (with context parallelism
    this rank holds two chunks of the sequence). bounds: int64 on the host, every row's document
    boundaries over the b x seq_length tokens, rows one after the other.
    position_ids (positions restarting with each document, else None): [b, s here] int64.
    """
    starts: torch.Tensor | None
    bounds: torch.Tensor | None
    position_ids: torch.Tensor | None
    _rotary: dict = field(default_factory=dict, compare=False, repr=False)  # cos/sin by rotary kind

    @classmethod
    def of_batch(cls, batch: dict) -> "PackedDocuments | None":
        """The documents of a batch, None where it has neither document starts nor positions."""
        starts, position_ids = batch.get("document_starts"), batch.get("position_ids")
        if starts is None and position_ids is None:
            return None
        return cls(starts, batch.get("document_bounds") if starts is not None else None, position_ids)

    @property
    def mask_attention(self) -> bool:
        return self.starts is not None

    @property
    def reset_positions(self) -> bool:
        return self.position_ids is not None

    def rotary_tables(self, rotary) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos/sin of each token's position within its document for `rotary` (a RotaryEmbedding),
        made once a micro-batch for all its layers; None where positions run on."""
        if not self.reset_positions:
            return None
        if rotary._key not in self._rotary:
            self._rotary[rotary._key] = rotary.cos_sin_at(self.position_ids)
        return self._rotary[rotary._key]


def _bounds_on(bounds: torch.Tensor, device) -> torch.Tensor:
    """Document bounds as int32 on `device` (through pinned memory: no host sync on a GPU)."""
    bounds = bounds.to(torch.int32)
    if device.type == "cpu":
        return bounds
    return bounds.pin_memory().to(device, non_blocking=True)


def attention_mask_of(documents: "PackedDocuments | None"):
    """What attention masks by: the documents where it is confined to them, else nothing."""
    return documents if documents is not None and documents.mask_attention else None


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: PackedDocuments,
                     attend: Callable, dropout_p: float, flash: bool = True, window=None) -> torch.Tensor:
    """Causal attention within each document: q [b, heads, s, d], k and v [b, heads or groups, s, d]
    hold the whole sequence; `attend(q, k, v, allowed, dropout_p, causal=True)` is the core backend.
    With `flash` (the backend is PyTorch's fused attention), on a GPU in fp16/bf16 without dropout:
    one variable-length flash call for every document. `window` (left, 0): a sliding window too
    (megalite.models.window), the kernel's own or a band mask a document."""
    if flash and flash_varlen_applies(q, v, dropout_p):
        return flash_varlen(q, k, v, documents.bounds, window)
    b, s = q.shape[0], q.shape[2]
    bounds = documents.bounds.tolist()  # on the host: no sync

    def within(*part):
        n = part[0].shape[2]
        return attend(*part, None if window is None else band_mask(n, n, window, True, q.device), dropout_p, True)
    if len(bounds) == b + 1:  # one document a row: the plain causal attention
        return within(q, k, v)
    rows: list[list[torch.Tensor]] = [[] for _ in range(b)]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        row = lo // s
        first, last = lo - row * s, hi - row * s
        rows[row].append(within(*(t[row:row + 1, :, first:last] for t in (q, k, v))))
    return torch.cat([torch.cat(parts, dim=2) for parts in rows], dim=0)


def flash_varlen_applies(q: torch.Tensor, v: torch.Tensor, dropout_p: float) -> bool:
    """The flash kernel's reach: CUDA on sm80 or later, half precision, no dropout, heads of at most
    256 dims in multiples of 8, values as wide as queries (not MLA's). Elsewhere PyTorch's fused
    attention picks another kernel."""
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and not dropout_p
            and q.shape[-1] == v.shape[-1] and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0
            and torch.cuda.get_device_capability(q.device)[0] >= 8 and _varlen_attn() is not None)


def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch before 2.10
        return None
    return varlen_attn


def flash_varlen(q, k, v, bounds: torch.Tensor, window=None) -> torch.Tensor:
    """The documents between `bounds` (host int64, over the b x s tokens) as one packed [b x s, heads, d]
    problem for the flash kernel: causal inside each (window (-1, 0), or the sliding `window` (left,
    0)), query heads of a group adjacent as the kernel's GQA expects."""
    b, heads, s, d = q.shape
    packed = [t.permute(0, 2, 1, 3).reshape(b * s, t.shape[1], d) for t in (q, k, v)]
    listed = bounds.tolist()  # on the host: no sync
    longest = max(hi - lo for lo, hi in zip(listed[:-1], listed[1:]))
    cu = _bounds_on(bounds, q.device)
    out = _varlen_attn()(*packed, cu, cu, longest, longest, window_size=(-1, 0) if window is None else window,
                         enable_gqa=k.shape[1] != heads)
    return out.reshape(b, s, heads, d).permute(0, 2, 1, 3)
