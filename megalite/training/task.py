"""What an entry point plugs into the loop: a `Task` (model, data, forward step, loss terms)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from megalite.config import RunConfig
from megalite.models.config import TransformerConfig


class BuildModel(Protocol):
    def __call__(self, config: TransformerConfig, cfg: RunConfig, device: torch.device, pre_process: bool = True,
                 post_process: bool = True, layer_numbers: Sequence[int] | None = None) -> torch.nn.Module:
        """One model chunk: the layers `layer_numbers`, with the embedding (pre_process) and the
        output layer (post_process) where this chunk is the first or last virtual stage."""


class Dataset(Protocol):
    def batch(self, sample_indices: range) -> dict[str, torch.Tensor]:
        """The samples at these global indices, as a batch on the host."""


@dataclass(frozen=True)
class Task:
    """What an entry point plugs into the loop."""
    build_model: BuildModel
    # build_data(config, cfg) -> (train, valid or None)
    build_data: Callable[[TransformerConfig, RunConfig], tuple[Dataset, Dataset | None]]
    # forward_step(chunk, batch): summed loss on the last stage, hidden states elsewhere
    forward_step: Callable[[torch.nn.Module, dict], torch.Tensor]
    # prepare(cfg) -> cfg: before anything else, the data and tokenizer resolved (the vocabulary size too)
    prepare: Callable[[RunConfig], RunConfig] | None = None
    model_kind: str = "gpt"  # recorded in checkpoints
    # Named parts of the loss that forward_step leaves in batch["loss_terms"] on the last stage, as
    # sums normalized like the loss (divided by the global token count they are means): logged
    # beside the loss. BERT: ("mlm_loss", "sop_loss").
    loss_terms: tuple[str, ...] = ()
    # The term whose exp is the perplexity logged at validation (None: the whole loss).
    perplexity_of: str | None = None


def gpt_forward_step(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    out = model(batch["tokens"], labels=batch["labels"])
    return (out * batch["loss_mask"]).sum() if model.post_process else out
