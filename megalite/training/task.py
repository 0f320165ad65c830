"""What an entry point plugs into the loop: a `Task` (model, data, forward step, loss terms)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from megalite.config import DataConfig, RunConfig
from megalite.errors import UsageError
from megalite.models.config import TransformerConfig
from megalite.data.documents import flags_given
from megalite.models.documents import PackedDocuments
from megalite.models.mtp import mtp_term_names, with_mtp_gradient


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
    # build_test_data(config, cfg) -> the test split or None: evaluated once training ends (Megatron-LM's)
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
    # Whether micro-batches count different numbers of loss tokens whatever the flags (BERT: random
    # masking), so Megatron-LM's mean of micro-batch means differs from the per-token mean.
    loss_counts_vary: bool = False
    build_test_data: Callable[[TransformerConfig, RunConfig], Dataset | None] | None = None


def check_task_flags(cfg: RunConfig, task: Task) -> None:
    """Flags that only some tasks train, refused in one line before anything starts."""
    from megalite.training.validation_sets import check_flags

    check_flags(cfg, task.model_kind)
    if task.model_kind != "gpt" and cfg.model.mtp_num_layers:
        raise UsageError(f"--mtp-num-layers: multi-token prediction is for GPT models (pretrain_gpt.py); a "
                         f"{task.model_kind} model does not predict the next tokens: drop it")
    documents = flags_given(cfg.data)
    if task.model_kind != "gpt" and documents:
        raise UsageError(f"{documents[0]} is for GPT's packed documents (pretrain_gpt.py); a {task.model_kind} "
                         f"sample is one or two sentences already: drop it")
    # Set off their defaults (a printed configuration writes every field, the defaults too).
    data = DataConfig()
    bert_only = [n for n, on in (("bert_no_binary_head", cfg.model.bert_no_binary_head),
                                 ("mask_prob", cfg.data.mask_prob != data.mask_prob),
                                 ("short_seq_prob", cfg.data.short_seq_prob != data.short_seq_prob)) if on]
    if task.model_kind != "bert" and bert_only:
        flag = "--" + bert_only[0].replace("_", "-")
        raise UsageError(f"{flag} is for BERT's masked samples (pretrain_bert.py); a {task.model_kind} model "
                         f"reads every token: drop it")


def with_config_terms(task: Task, config: TransformerConfig) -> Task:
    """The task with the loss terms `config` adds: each multi-token prediction depth's loss."""
    if not config.mtp_num_layers:
        return task
    return dataclasses.replace(task, loss_terms=task.loss_terms + mtp_term_names(config.mtp_num_layers))


def gpt_forward_step(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    depth = model.config.mtp_num_layers if model.post_process else 0
    documents = PackedDocuments.of_batch(batch)  # --reset-attention-mask / --reset-position-ids
    if not depth:
        out = model(batch["tokens"], attention_mask=documents, labels=batch["labels"])
        return (out * batch["loss_mask"]).sum() if model.post_process else out
    # Multi-token prediction: the main loss is what is returned (and logged as `loss`); the depths'
    # sums are logged as loss terms and trained, weighted, through the same backward.
    sums = model(batch["tokens"], attention_mask=documents, labels=batch["labels"], loss_mask=batch["loss_mask"],
                 mtp_labels=batch.get("mtp_labels"), mtp_loss_mask=batch.get("mtp_loss_mask"))
    batch["loss_terms"] = dict(zip(mtp_term_names(depth), sums[1:].detach()))
    return with_mtp_gradient(sums[0], sums[1:], model.config.mtp_loss_scaling_factor)
