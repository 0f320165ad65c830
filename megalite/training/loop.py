"""`pretrain`: the loop, and only the loop. Each piece it calls has one job: `build` (layout,
chunks, optimizer), `resume` (where to start), `TrainStep` (one optimizer step), `Progress` (skips,
log lines, timeline), `CheckpointAndExit` (save and stop decisions), `evaluate`."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite import ops, parallel
from megalite.optim import LocalSGD, LRSchedule, MegaliteOptimizer, ParamAndGradBuffer
from megalite.pipeline.schedules import build_program
from megalite.runtime import TrainingStopped, UsageError, env_world, say, set_phase
from megalite.training.batches import global_normalizer, loss_terms, micro_batches
from megalite.training.build import build_local_sgd, build_model_chunks, build_optimizer, setup
from megalite.training.evaluate import evaluate
from megalite.training.progress import Progress
from megalite.training.resume import load_checkpoint, resume, resume_local_sgd
from megalite.training.saving import CheckpointAndExit
from megalite.training.step import TrainStep
from megalite.training.task import Task


@dataclass
class TrainingRun:
    """What `pretrain` returns. At ZeRO stage 3 the chunks' parameters stay sharded (empty tensors
    here): read them inside `with run.optimizer.whole_parameters():`, which gathers them."""
    records: list[dict]  # the logged records (on every rank)
    model_chunks: list[torch.nn.Module]
    optimizer: MegaliteOptimizer
    buffers: list[ParamAndGradBuffer]
    local_sgd: LocalSGD | None = None  # --local-sgd-interval: the outer loop's state


def _announce(args, config, world_size: int, dp: int, m: int, device) -> None:
    say(f"megalite: {config.num_layers} layers, hidden {config.hidden_size}, {world_size} ranks as "
        f"tp={args.tp}" + (f" cp={args.cp}" if getattr(args, "cp", 1) > 1 else "") + f" pp={args.pp} dp={dp}" +
        (f" vpp={args.vpp}" if args.vpp else "") +
        (f" (ZeRO stage {args.zero_stage})" if getattr(args, "zero_stage", 0) else "") +
        (f" (local SGD: outer step every {args.local_sgd_interval}" +
         (f", {args.local_sgd_fragments} fragments" if args.local_sgd_fragments > 1 else "") +
         (", async" if args.local_sgd_async else "") + ")" if getattr(args, "local_sgd_interval", 0) else "") +
        f", global batch {args.global_batch_size} x {args.seq_length} tokens, {m} micro-batches per step")
    if device.type == "cuda" and config.norm_backend != "torch":
        # Build (or load) the fused kernels now, not inside the first step, and say which path runs.
        say(f"megalite: {ops.kernels_available()}")


def _due(every: int, iteration: int, last: int) -> bool:
    return bool(every) and (iteration % every == 0 or iteration == last)


def pretrain(args, task: Task) -> TrainingRun:
    """Train as `args` say."""
    _, world_size, _ = env_world()
    if task.prepare is not None:
        task.prepare(args)
    config, dp, device = setup(args, world_size)
    chunks = build_model_chunks(task, config, args, device)
    set_phase("loading the checkpoint")
    reader = load_checkpoint(args, task, config, chunks)
    buffers, optimizer = build_optimizer(args, chunks)
    layout = {"tp": args.tp, "cp": getattr(args, "cp", 1), "pp": args.pp, "dp": dp, "vpp": args.vpp,
              "world": world_size}
    start = resume(args, reader, chunks, optimizer, layout)
    local_sgd = build_local_sgd(args, optimizer)  # after resume: it starts from the loaded masters
    resume_local_sgd(args, reader, local_sgd, optimizer, layout)
    checkpoints = CheckpointAndExit(args, config, task.model_kind, layout, local_sgd)
    schedule = LRSchedule(args.lr, args.min_lr, args.lr_warmup_iters, args.lr_decay_iters or args.train_iters,
                          args.lr_decay_style)
    data, valid_data = task.build_data(config, args)

    step = TrainStep.for_run(args, config.hidden_size, chunks, task.forward_step, buffers, optimizer, local_sgd)
    m = step.micro_batches
    eval_program = build_program(args.pp, parallel.get_pipeline_model_parallel_rank(), m, args.vpp,
                                 kind="forward-only")
    progress = Progress(args, task, config, step.dtype, device, m)
    _announce(args, config, world_size, dp, m, device)
    # Samples are dealt over DP; token counts and losses are summed over DP x CP (each CP rank holds
    # part of every sequence).
    dp_rank, dp_group = parallel.get_data_parallel_rank(), parallel.get_data_parallel_group(with_context_parallel=True)
    # Local SGD: each replica (its CP ranks) trains on the mean loss of its own share of the batch.
    replica_group = parallel.get_context_parallel_group() if getattr(args, "cp", 1) > 1 else None

    dist.barrier()
    progress.start()
    for c in chunks:
        c.train()
    consumed, stop_reason = start.consumed_samples, None
    for iteration in range(start.iteration + 1, args.train_iters + 1):  # 1-based: the iteration being run
        record_spans = progress.records_spans(iteration - 1 - start.iteration)
        set_phase(f"iteration {iteration}: the forward/backward schedule (pipeline send/recv)")
        batches = micro_batches(data, iteration - 1, args, dp, dp_rank, device, consumed)
        if local_sgd is None:
            num_tokens = logged_tokens = global_normalizer(batches, args.global_batch_size, dp_group)
        else:  # the log line's loss: the mean over replicas of each replica's mean
            num_tokens = global_normalizer(batches, args.global_batch_size // dp, replica_group)
            logged_tokens = num_tokens * dp
        loss_scale, lr = optimizer.loss_scaler.scale, schedule(iteration - 1)
        result = step(batches, num_tokens, lr, record_spans, f"iteration {iteration}")
        consumed += args.global_batch_size
        try:
            progress.after_step(iteration, result, optimizer, loss_scale, lr, consumed,
                                loss_terms(task, batches, device), logged_tokens, record_spans)
        except TrainingStopped:
            checkpoints.abandon()  # every rank stops at this iteration together
            raise
        if valid_data is not None and args.eval_iters and _due(args.eval_interval, iteration, args.train_iters):
            set_phase(f"iteration {iteration}: validation")
            progress.logger.evaluation(iteration, evaluate(args, task, step, eval_program, valid_data, device),
                                       task.perplexity_of)
        stop_reason = checkpoints.after_iteration(iteration, consumed, chunks, optimizer, progress.logger.say)
        if stop_reason:
            break
    if local_sgd is not None:
        local_sgd.settle()  # async: no all-reduce left in flight when the process group goes
    checkpoints.close()
    progress.close()
    for buf in buffers:  # ZeRO-3: read the returned parameters inside run.optimizer.whole_parameters()
        buf.park()
    if not progress.records and not stop_reason and start.iteration < args.train_iters:
        raise UsageError("no iteration was run: --train-iters must be >= 1")
    return TrainingRun(progress.records, chunks, optimizer, buffers, local_sgd)
