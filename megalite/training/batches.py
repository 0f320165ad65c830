"""Global batches cut into this data-parallel rank's micro-batches, and the sums over them."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megalite import parallel
from megalite.data.documents import HOST_KEYS
from megalite.parallel import traffic
from megalite.parallel.context_parallel import split_for_context_parallel
from megalite.training.task import Task


def to_device(batch: dict, device: torch.device) -> dict:
    """A host batch on `device`: through pinned memory when it is a GPU, so the copy is truly
    asynchronous (from pageable memory `non_blocking` copies synchronously). What attention reads
    on the host (`HOST_KEYS`: packed documents' bounds) stays there."""
    if device.type == "cpu":
        return batch
    return {k: v if k in HOST_KEYS else v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}


def sample_indices(consumed: int, global_batch: int, dp: int, dp_rank: int) -> range:
    """The positions in the sample stream that DP rank `dp_rank` reads for the global batch that
    starts at sample `consumed`."""
    per_rank = global_batch // dp
    first = consumed + dp_rank * per_rank
    return range(first, first + per_rank)


def micro_batches(data, step: int, cfg, dp: int, dp_rank: int, device, consumed: int | None = None,
                  global_batch: int | None = None) -> list[dict]:
    """This DP rank's contiguous slice of global batch `step` (the one starting at sample
    `consumed`, default step * global batch; `global_batch` samples, default the configured size, smaller
    during a ramp-up), cut into micro-batches; with context parallelism, this CP rank's share of every
    sequence."""
    global_batch = global_batch or cfg.training.global_batch_size
    samples = sample_indices(step * global_batch if consumed is None else consumed, global_batch, dp, dp_rank)
    cp = cfg.parallel.cp
    out = []
    for start in range(samples.start, samples.stop, cfg.training.micro_batch_size):
        batch = data.batch(range(start, start + cfg.training.micro_batch_size))
        if cp > 1:
            batch = context_parallel_share(batch, cfg.model.seq_length, parallel.get_context_parallel_rank(), cp)
        out.append(to_device(batch, device))
    return out


def context_parallel_share(batch: dict, seq_length: int, cp_rank: int, cp: int) -> dict:
    """CP rank `cp_rank`'s tokens of every [b, seq_length, ...] tensor of a batch: chunks cp_rank and
    2 cp - 1 - cp_rank of the sequence (causal load balancing); other entries whole."""
    return {k: split_for_context_parallel(v, 1, cp_rank, cp)
            if torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == seq_length else v for k, v in batch.items()}


def global_normalizer(batches: list[dict], global_batch_size: int, dp_group) -> torch.Tensor:
    """Loss-mask count of the whole global batch (summed over `dp_group`: DP, or DP x CP where
    each context-parallel rank holds part of every sequence). Each micro-batch also carries it,
    with the global batch size, for losses with more than one term (BERT: MLM + SOP)."""
    num_tokens = sum(b["loss_mask"].sum() for b in batches).float()
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        traffic.counted_all_reduce("metrics", num_tokens, dp_group)
    for b in batches:
        b["num_tokens"], b["global_batch_size"] = num_tokens, global_batch_size
    return num_tokens


def micro_batch_means(batches: list[dict], num_tokens: torch.Tensor, replicas: int, cp_group) -> None:
    """Megatron-LM's loss without --calculate-per-token-loss: each micro-batch's mean over its own
    tokens (summed over the context-parallel group: a sequence's tokens are spread over it), then the
    mean of those over the micro-batches and the `replicas` data-parallel ranks. Each loss mask is
    scaled so that the loop's sum(loss x mask) / num_tokens is that; where every micro-batch counts
    the same tokens the scale is 1. (A micro-batch without a counted token adds 0, not NaN.)"""
    counts = torch.stack([b["loss_mask"].sum() for b in batches]).float()
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        traffic.counted_all_reduce("metrics", counts, cp_group)
    for b, count in zip(batches, counts):
        b["loss_mask"] = b["loss_mask"] * (num_tokens / (count.clamp(min=1) * len(batches) * replicas))


def loss_terms(task: Task, batches: list[dict], device) -> torch.Tensor | None:
    """The task's named loss terms summed over this rank's micro-batches (zeros off the last stage);
    None for a task without terms (GPT), so its steps do no work for them."""
    if not task.loss_terms:
        return None
    out = torch.zeros(len(task.loss_terms), device=device)
    for b in batches:
        terms = b.get("loss_terms")
        if terms:
            out += torch.stack([terms[name].float() for name in task.loss_terms])
    return out
