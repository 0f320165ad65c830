"""Generation's state, kept out of the model's modules: the keys and values every attention layer
has seen (`KVCache`), the positions of a step's new tokens and the mask they attend by.

The model reads it through `inference_context` (GPTModel.forward -> run_layers -> TransformerLayer
-> attention); without one nothing of this runs, so training is unchanged. An attention layer asks
the cache for this step's rope tables (`rotary_tables`), hands it its new keys and values and gets
back all of them so far (`extend`), and attends by `attention_mask()`.

Rows are left-padded: row i's prompt starts at slot `pad[i]`, so every row's next token goes into
the same slot and one step serves the whole batch. Positions count from a row's first real token
(the padding slots are never attended to by a real token); a padding slot attends to itself only, so
its values stay finite and nothing reads them.
"""
from __future__ import annotations

from typing import Sequence

import torch


class KVCache:
    """Per attention layer (keyed by the module), preallocated buffers of `capacity` slots along the
    sequence; `length` slots are filled, the same for every row.

    A step: `begin(tokens, real)`, one forward of every model chunk this rank holds, `advance()`.
    `tokens` new positions run through the model; only the first `real` are kept (the rest pad the
    step to a multiple of the TP size under sequence parallelism: they come after the real ones, so
    causality hides them, and they are never stored).
    `all_logits`: the model returns logits for every real new token, else for the last one only.
    """

    def __init__(self, pad: Sequence[int], capacity: int, device, max_position: int | None = None,
                 all_logits: bool = False):
        self.pad = torch.as_tensor(list(pad), dtype=torch.long, device=device)
        self.batch, self.capacity, self.device = len(self.pad), capacity, device
        self.max_position, self.all_logits = max_position, all_logits
        self.length = 0
        self.tokens = self.real = 0
        self._layers: dict[torch.nn.Module, tuple[torch.Tensor, ...]] = {}
        self._step: dict = {}  # this step's positions, mask and rope tables, made once for all layers

    def begin(self, tokens: int, real: int | None = None) -> None:
        real = tokens if real is None else real
        if not 0 < real <= tokens:
            raise ValueError(f"a generation step keeps 1..{tokens} of its {tokens} tokens, not {real}")
        if self.length + real > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} tokens: {self.length} cached + {real} new do not fit")
        self.tokens, self.real, self._step = tokens, real, {}

    def advance(self) -> None:
        """The step's real tokens are cached now."""
        self.length += self.real
        self.tokens = self.real = 0
        self._step = {}

    def _memo(self, key, make):
        if key not in self._step:
            self._step[key] = make()
        return self._step[key]

    def position_ids(self) -> torch.Tensor:
        """[b, tokens]: each new token's position in its row (0 at the row's first real token)."""
        def make():
            slots = torch.arange(self.length, self.length + self.tokens, device=self.device)
            positions = (slots.unsqueeze(0) - self.pad.unsqueeze(1)).clamp_min(0)
            # Padding tokens of a step (never stored) may run past the table: they reuse its last row.
            return positions if self.max_position is None else positions.clamp_max(self.max_position - 1)
        return self._memo("positions", make)

    def rotary_tables(self, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [tokens, b, 1, rotary_dims] of the new tokens' positions for `rotary` (a RotaryEmbedding)."""
        return self._memo(("rope", rotary._key), lambda: rotary.cos_sin_at(self.position_ids()))

    def attention_mask(self) -> torch.Tensor:
        """Bool [b, 1, tokens, length + tokens], True = attend: a new token sees the real slots of
        its row up to itself, and itself."""
        def make():
            query = torch.arange(self.length, self.length + self.tokens, device=self.device)[:, None]
            key = torch.arange(self.length + self.tokens, device=self.device)[None, :]
            real_key = key.unsqueeze(0) >= self.pad[:, None, None]  # [b, 1, keys]
            allowed = ((key <= query).unsqueeze(0) & real_key) | (key == query).unsqueeze(0)
            return allowed.unsqueeze(1)
        return self._memo("mask", make)

    def extend(self, module: torch.nn.Module, *new: torch.Tensor, dim: int) -> tuple[torch.Tensor, ...]:
        """Store the step's real tokens of each of `new` (this layer's keys and values, or MLA's
        latent and rope key; `dim` is their sequence axis) and return each over every slot so far
        plus this step's tokens (views of the cache where no padding token follows)."""
        stored = self._layers.get(module)
        if stored is None:
            stored = tuple(t.new_empty(t.shape[:dim] + (self.capacity,) + t.shape[dim + 1:]) for t in new)
            self._layers[module] = stored
        for buf, t in zip(stored, new):
            buf.narrow(dim, self.length, self.real).copy_(t.narrow(dim, 0, self.real))
        upto = self.length + self.real
        if self.real == self.tokens:
            return tuple(buf.narrow(dim, 0, upto) for buf in stored)
        return tuple(torch.cat([buf.narrow(dim, 0, upto), t.narrow(dim, self.real, self.tokens - self.real)], dim)
                     for buf, t in zip(stored, new))

    def logits_positions(self) -> slice:
        """Which of the step's positions the last stage turns into logits."""
        return slice(0, self.real) if self.all_logits else slice(self.real - 1, self.real)

    def nbytes(self) -> int:
        return sum(t.nbytes for bufs in self._layers.values() for t in bufs)
