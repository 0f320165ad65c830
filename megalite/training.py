"""The training loop: layout set-up, micro-batches through the schedule, gradient reduction,
clipping, optimizer step, and logging."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megalite import arguments, parallel
from megalite.metrics import MetricsWriter, default_peak_tflops, format_log_line, gpt_flops_per_iteration
from megalite.models.config import TransformerConfig
from megalite.optim import (
    LRSchedule,
    allreduce_embedding_grads,
    allreduce_sequence_parallel_grads,
    build_adamw,
    clip_grads,
    global_grad_norm,
)
from megalite.pipeline.schedules import forward_backward_no_pipelining
from megalite.runtime import UsageError, env_world, init_distributed, say


@dataclass
class Task:
    """What an entry point plugs into the loop."""
    build_model: Callable[[TransformerConfig, object, torch.device], torch.nn.Module]
    build_data: Callable[[TransformerConfig, object], object]  # has .batch(sample_indices) -> dict
    loss_fn: Callable[[torch.nn.Module, dict], torch.Tensor]  # summed loss of a micro-batch


def gpt_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    per_token = model(batch["tokens"], labels=batch["labels"])
    return (per_token * batch["loss_mask"]).sum()


def _allreduce_data_parallel_grads(params) -> None:
    """Sum gradients over data-parallel replicas (each rank's loss is already divided by the
    global token count), one coalesced all-reduce per dtype."""
    if parallel.get_data_parallel_world_size() == 1:
        return
    group = parallel.get_data_parallel_group()
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        torch._foreach_copy_(grads, [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in grads]), grads)])


def _micro_batches(data, iteration: int, args, dp: int, dp_rank: int, device) -> list[dict]:
    """This DP rank's contiguous slice of the global batch, cut into micro-batches."""
    per_rank = args.global_batch_size // dp
    first = iteration * args.global_batch_size + dp_rank * per_rank
    out = []
    for start in range(first, first + per_rank, args.micro_batch_size):
        batch = data.batch(range(start, start + args.micro_batch_size))
        out.append({k: v.to(device, non_blocking=True) for k, v in batch.items()})
    return out


def setup(args, world_size: int):
    """Validate the layout, start the process groups, seed the RNG streams."""
    config = arguments.model_config(args)
    dp = arguments.validate(args, world_size, config)
    device = init_distributed(args.distributed_timeout_minutes)
    parallel.initialize_model_parallel(args.tp, args.pp, args.vpp)
    parallel.model_parallel_manual_seed(args.seed)
    return config, dp, device


def pretrain(args, task: Task) -> list[dict]:
    """Train as `args` say; return the logged records (on every rank)."""
    _, world_size, _ = env_world()
    config, dp, device = setup(args, world_size)
    model = task.build_model(config, args, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_adamw([model], args.lr, args.weight_decay, (args.adam_beta1, args.adam_beta2), args.adam_eps)
    schedule = LRSchedule(args.lr, args.min_lr, args.lr_warmup_iters, args.lr_decay_iters or args.train_iters,
                          args.lr_decay_style)
    data = task.build_data(config, args)
    dp_rank, dp_group = parallel.get_data_parallel_rank(), parallel.get_data_parallel_group()
    is_logger = dist.get_rank() == 0
    metrics = MetricsWriter(args.metrics_file if is_logger else None)
    flops = gpt_flops_per_iteration(args.global_batch_size, args.seq_length, config.num_layers,
                                    config.hidden_size, config.vocab_size)
    peak = args.peak_tflops or default_peak_tflops()
    say(f"megalite: {config.num_layers} layers, hidden {config.hidden_size}, {world_size} ranks as "
        f"tp={args.tp} pp={args.pp} dp={dp}, global batch {args.global_batch_size} x {args.seq_length} tokens")

    records, window_start, window_loss, window_iters = [], time.perf_counter(), None, 0
    model.train()
    for iteration in range(args.train_iters):
        micro_batches = _micro_batches(data, iteration, args, dp, dp_rank, device)
        num_tokens = sum(b["loss_mask"].sum() for b in micro_batches).float()
        if dp > 1:
            dist.all_reduce(num_tokens, group=dp_group)
        loss_sum = forward_backward_no_pipelining(model, micro_batches, task.loss_fn, num_tokens)

        _allreduce_data_parallel_grads(params)
        allreduce_sequence_parallel_grads(params)
        allreduce_embedding_grads([model])
        grad_norm = global_grad_norm(params)
        clip_grads(params, args.clip_grad, grad_norm)
        lr = schedule.apply(optimizer, iteration)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        step_loss = loss_sum / num_tokens
        window_loss = step_loss if window_loss is None else window_loss + step_loss
        window_iters += 1
        if (iteration + 1) % args.log_interval == 0 or iteration + 1 == args.train_iters:
            if dp > 1:
                dist.all_reduce(window_loss, group=dp_group)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = (time.perf_counter() - window_start) / window_iters
            tflops = flops / elapsed / world_size / 1e12
            record = {
                "iteration": iteration + 1,
                "train_iters": args.train_iters,
                "consumed_samples": (iteration + 1) * args.global_batch_size,
                "loss": (window_loss / window_iters).item(),
                "lr": lr,
                "grad_norm": grad_norm.item(),
                "loss_scale": 1.0,
                "skipped": 0,
                "ms_per_iter": elapsed * 1e3,
                "tokens_per_sec": args.global_batch_size * args.seq_length / elapsed,
                "tflops_per_gpu": tflops,
                "mfu": tflops / peak if peak else None,
            }
            records.append(record)
            if is_logger:
                say(format_log_line(record))
                metrics.write(record)
            window_start, window_loss, window_iters = time.perf_counter(), None, 0
    metrics.close()
    if not records:
        raise UsageError("no iteration was run: --train-iters must be >= 1")
    return records
