"""Documents packed into one sequence, told apart by their end-of-document (EOD) tokens.

A GPT sample is cut from concatenated documents, so one sequence may hold several. Megatron-LM's
three data flags say what the model sees of that (their rule: a document ends with its EOD token,
and the token after it starts the next one):
- `--reset-attention-mask`: a token attends only to earlier tokens of its own document;
- `--reset-position-ids`: positions restart at 0 at each document's first token;
- `--eod-mask-loss`: no loss where the input token is the EOD (the prediction across documents).
`with_documents` adds to a host batch what the model needs for the first two: for the attention,
`document_starts` [b, s] (int64, the position of each token's document's first token, split with
the sequence under context parallelism) and `document_bounds` (int64, kept on the host, flat: every
row's document boundaries over the b x s tokens of the batch, rows one after the other, as
variable-length attention kernels take them); for the positions, `position_ids` [b, s]. It applies
the third to `loss_mask`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Keys of a batch that stay on the host (attention reads them to cut the work, with no sync).
HOST_KEYS = frozenset({"document_bounds"})


@dataclass(frozen=True)
class DocumentFlags:
    """Megatron-LM's three flags, and the token that ends a document."""
    eod: int
    reset_attention_mask: bool = False
    reset_position_ids: bool = False
    eod_mask_loss: bool = False

    @property
    def any(self) -> bool:
        return self.reset_attention_mask or self.reset_position_ids or self.eod_mask_loss

    @property
    def needs_starts(self) -> bool:
        return self.reset_attention_mask or self.reset_position_ids


def flags_given(data) -> list[str]:
    """The document flags a data section (megalite.config's DataConfig) turns on, as the user types them."""
    return [flag for flag, on in (("--reset-attention-mask", data.reset_attention_mask),
                                  ("--reset-position-ids", data.reset_position_ids),
                                  ("--eod-mask-loss", data.eod_mask_loss)) if on]


def document_starts(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s] int64: for each token, the position of the first token of its document (a document
    starts at 0 and after each EOD)."""
    b, s = tokens.shape
    opens = torch.zeros(b, s, dtype=torch.bool)
    opens[:, 0] = True
    opens[:, 1:] = tokens[:, :-1] == eod
    positions = torch.arange(s).expand(b, s)
    return torch.where(opens, positions, torch.zeros_like(positions)).cummax(dim=1).values


def document_bounds(starts: torch.Tensor) -> torch.Tensor:
    """Flat int64 boundaries of the documents of every row of `starts` [b, s], rows concatenated:
    [0, end of the first document, ..., b x s] (`cu_seqlens` of variable-length attention)."""
    b, s = starts.shape
    opens = torch.ones(b, s, dtype=torch.bool)
    opens[:, 1:] = starts[:, 1:] != starts[:, :-1]
    flat = torch.nonzero(opens.reshape(-1)).flatten()
    bounds = torch.cat([flat, torch.tensor([b * s])]).to(torch.int64)
    bounds._megalite_host_side = True  # read by attention on the host, never moved (no sync: testing.py)
    return bounds


def with_documents(batch: dict, flags: DocumentFlags) -> dict:
    """A GPT host batch (`tokens`, `labels`, `loss_mask` [b, s]) with the flags applied: the loss
    masked at EOD inputs (`eod_mask_loss`), `document_starts` and `document_bounds` added where
    attention is reset, `position_ids` where positions are."""
    out = dict(batch)
    tokens = batch["tokens"]
    if flags.eod_mask_loss:
        out["loss_mask"] = batch["loss_mask"].masked_fill(tokens == flags.eod, 0.0)
    if flags.needs_starts:
        starts = document_starts(tokens, flags.eod)
        if flags.reset_attention_mask:
            out["document_starts"] = starts
            out["document_bounds"] = document_bounds(starts)
        if flags.reset_position_ids:
            out["position_ids"] = torch.arange(tokens.shape[1]).unsqueeze(0) - starts
    return out


class WithDocuments:
    """A GPT dataset whose batches carry the document flags' effects (`with_documents`); every
    other attribute is the dataset's."""

    def __init__(self, dataset, flags: DocumentFlags):
        self.dataset, self.flags = dataset, flags

    def batch(self, sample_indices) -> dict:
        return with_documents(self.dataset.batch(sample_indices), self.flags)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name):
        return getattr(self.dataset, name)
