"""`pretrain`: the loop, and only the loop. Each piece it calls has one job: `build` (layout,
chunks, optimizer), `resume` (where to start), `TrainStep` (one optimizer step), `Progress` (skips,
log lines, timeline), `CheckpointAndExit` (save and stop decisions), `evaluate`."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite import determinism, faults, ops, parallel
from megalite.optim import LocalSGD, MegaliteOptimizer, ParamAndGradBuffer
from megalite.config import model_config, model_dtype, validate
from megalite.config.batch_schedule import batch_schedule, check_schedule_layout
from megalite.pipeline.partition import V_SCHEDULES
from megalite.pipeline.schedules import build_program, forward_only_kind
from megalite.runtime import TrainingStopped, UsageError, env_world, say, set_phase
from megalite.training.datasets import loss_form, micro_batch_means_apply
from megalite.training.batches import global_normalizer, loss_terms, micro_batch_means, micro_batches, sample_indices
from megalite.training.checkpoint_shape import adopt_checkpoint_shape
from megalite.training.build import (build_local_sgd, lr_schedules, build_model_chunks, build_optimizer, setup,
                                     weight_decay_schedule)
from megalite.training.evaluate import EvalSamples, EvalTasks, evaluate
from megalite.training.progress import Progress
from megalite.training.restarts import ProgressRecord, restart_line
from megalite.training.resume import chosen_step, load_checkpoint, resume, resume_local_sgd, say_resumed
from megalite.training.saving import CheckpointAndExit
from megalite.training.sample_log import SampleLog, agreed_run_id
from megalite.training.step import TrainStep
from megalite.training.task import Task, check_task_flags, with_config_terms
from megalite.training.validation_sets import validation_sets
from megalite.training import upcycling


@dataclass
class TrainingRun:
    """What `pretrain` returns. At ZeRO stage 3 the chunks' parameters stay sharded (empty tensors
    here): read them inside `with run.optimizer.whole_parameters():`, which gathers them."""
    records: list[dict]  # the logged records (on every rank)
    model_chunks: list[torch.nn.Module]
    optimizer: MegaliteOptimizer
    buffers: list[ParamAndGradBuffer]
    local_sgd: LocalSGD | None = None  # --local-sgd-interval: the outer loop's state


def _announce(cfg, config, world_size: int, dp: int, m: int, device) -> None:
    p, s = cfg.parallel, cfg.local_sgd
    say(f"megalite: {config.num_layers} layers, hidden {config.hidden_size}, {world_size} ranks as "
        f"tp={p.tp}" + (f" cp={p.cp}" if p.cp > 1 else "") + f" pp={p.pp} dp={dp}" +
        (f" vpp={p.vpp}" if p.vpp else "") +
        (f" ({p.pipeline_schedule} schedule)" if p.pipeline_schedule not in ("1f1b", "interleaved") else "") +
        (f" (ZeRO stage {cfg.data_parallel.zero_stage})" if cfg.data_parallel.zero_stage else "") +
        (f" (local SGD: outer step every {s.local_sgd_interval}" +
         (f", {s.local_sgd_fragments} fragments" if s.local_sgd_fragments > 1 else "") +
         (", async" if s.local_sgd_async else "") + ")" if s.local_sgd_interval else "") +
        f", global batch {cfg.training.global_batch_size} x {cfg.model.seq_length} tokens, {m} micro-batches per step")
    outputs = [(what, path) for what, path in (
        ("checkpoints", cfg.checkpoint.save if not cfg.training.skip_train else None),
        ("metrics", cfg.logging.metrics_file),
        ("configuration", cfg.logging.metrics_file and cfg.logging.metrics_file + ".config.toml"),
        ("TensorBoard", cfg.logging.tensorboard_dir), ("timeline", cfg.logging.timeline),
        ("the samples consumed", cfg.logging.sample_log)) if path]
    if outputs:
        say("megalite: writing " + ", ".join(f"{what} to {path}" for what, path in outputs))
    if device.type == "cuda" and config.norm_backend != "torch":
        # Build (or load) the fused kernels now, not inside the first step, and say which path runs.
        say(f"megalite: {ops.kernels_available()}")


def _batch_schedule(cfg, dp: int, consumed: int):
    """Each step's global batch by the samples consumed; a step schedule's batches still ahead checked
    against the layout here, as Megatron-LM checks each as it starts (a ramp's are checked with the layout)."""
    schedule = batch_schedule(cfg.training, cfg.model.seq_length)
    if schedule.steps is not None:
        p = cfg.parallel
        if cfg.local_sgd.local_sgd_interval:
            raise UsageError("--step-batch-size-schedule with --local-sgd-interval is not supported: drop one")
        try:
            check_schedule_layout(schedule, consumed, cfg.training.micro_batch_size, dp, p.pp,
                                  interleaved=bool(p.vpp and p.vpp > 1 and p.pipeline_schedule not in V_SCHEDULES))
        except ValueError as e:
            raise UsageError(str(e)) from None
    return schedule


def _due(every: int, iteration: int, last: int) -> bool:
    return bool(every) and (iteration % every == 0 or iteration == last)


def pretrain(cfg, task: Task) -> TrainingRun:
    """Train as `cfg` say (--deterministic-mode's switches last the run only)."""
    with determinism.scoped():
        return _pretrain(cfg, task)


def _pretrain(cfg, task: Task) -> TrainingRun:
    _, world_size, _ = env_world()
    check_task_flags(cfg, task)
    cfg = chosen_step(cfg)  # --ckpt-step N: --load's iteration N
    cfg = upcycling.requeued(cfg)  # --moe-use-upcycling in a requeued job: its own checkpoints
    cfg = adopt_checkpoint_shape(cfg)  # --load without shape flags: the checkpoint's model
    # The layout before the data: a refusal should not first build the embedded corpus (seconds to a
    # minute, once a machine). What the data sets (the vocabulary size) only refines the model here.
    validate(cfg, world_size, model_config(cfg), machine=False)
    if task.prepare is not None:
        cfg = task.prepare(cfg)
    config, dp, device = setup(cfg, world_size)
    task = with_config_terms(task, config)
    chunks = build_model_chunks(task, config, cfg, device)
    set_phase("loading the checkpoint")
    reader, cfg = load_checkpoint(cfg, task, config, chunks)
    buffers, optimizer = build_optimizer(cfg, chunks)
    layout = {"tp": cfg.parallel.tp, "cp": cfg.parallel.cp, "pp": cfg.parallel.pp, "dp": dp, "vpp": cfg.parallel.vpp,
              "world": world_size}
    if cfg.parallel.pipeline_schedule in V_SCHEDULES:  # which rank holds which chunk: rank files differ
        layout["placement"] = "v"
    start = resume(cfg, reader, chunks, optimizer, layout, config)
    local_sgd = build_local_sgd(cfg, optimizer)  # after resume: it starts from the loaded masters
    resume_local_sgd(cfg, reader, local_sgd, optimizer, layout)
    say_resumed(start)
    run = agreed_run_id() if cfg.checkpoint.save or cfg.logging.sample_log else None
    checkpoints = CheckpointAndExit(cfg, config, task.model_kind, layout, local_sgd, run,
                                    loss_form(cfg, task.loss_counts_vary), start.lineage())
    samples_log = SampleLog(cfg.logging.sample_log, run)
    samples_log.resumed(start.iteration, start.run)
    checkpoints.prepare(chunks, optimizer)  # --save-async: the host buffer, while training starts
    if start.upcycled:  # the upcycled model, saved before it trains (iteration 0: a resume of it is this run)
        checkpoints.save_now(start.iteration, start.consumed_samples, chunks, optimizer)
    schedule, embedding_schedule = lr_schedules(cfg)
    decay_schedule = weight_decay_schedule(cfg)  # None: --weight-decay throughout
    data, valid_data = task.build_data(config, cfg)
    test_data = task.build_test_data(config, cfg) if task.build_test_data is not None else None
    valid_sets = validation_sets(valid_data, cfg)  # [] when the run does not validate

    step = TrainStep.for_run(cfg, config.hidden_size, chunks, task.forward_step, buffers, optimizer, local_sgd)
    m = step.micro_batches
    eval_program = build_program(cfg.parallel.pp, parallel.get_pipeline_model_parallel_rank(), m, cfg.parallel.vpp,
                                 kind=forward_only_kind(cfg.parallel.pipeline_schedule))
    progress = Progress(cfg, task, config, model_dtype(cfg), device, m, chunks)  # the GEMMs' dtype (MFU's peak)
    samples = EvalSamples(cfg, task) if cfg.training.eval_prompts else None  # --eval-prompts
    scored_tasks = EvalTasks(cfg, task) if cfg.training.eval_tasks else None  # --eval-tasks
    _announce(cfg, config, world_size, dp, m, device)
    # Samples are dealt over DP; token counts and losses are summed over DP x CP (each CP rank holds
    # part of every sequence).
    dp_rank, dp_group = parallel.get_data_parallel_rank(), parallel.get_data_parallel_group(with_context_parallel=True)
    # Local SGD: each replica (its CP ranks) trains on the mean loss of its own share of the batch.
    replica_group = parallel.get_context_parallel_group() if cfg.parallel.cp > 1 else None

    def evaluations(iteration: int, scalars: bool = True) -> None:
        """What each validation runs: the validation sets, --eval-prompts' samples, --eval-tasks' scores."""
        optimizer.finish_param_gather()  # --overlap-param-gather: what follows reads every parameter
        if valid_sets:
            set_phase(f"iteration {iteration}: validation")
            for v in valid_sets:
                progress.logger.evaluation(iteration, evaluate(cfg, task, step, eval_program, v.data, device,
                                                               v.batches), task.perplexity_of, v.name, scalars=scalars)
        if samples is not None:
            set_phase(f"iteration {iteration}: samples of --eval-prompts")
            samples.log(step, iteration, progress.logger)
        if scored_tasks is not None:
            set_phase(f"iteration {iteration}: the lm-eval tasks of --eval-tasks")
            scored_tasks.log(step, iteration, progress.logger)

    line = restart_line(cfg, start.iteration)
    if line:
        say(line)
    record = ProgressRecord(cfg, start.iteration)
    dist.barrier()
    progress.start(start.consumed_samples)
    for c in chunks:
        c.train()
    consumed, stop_reason, reached = start.consumed_samples, None, start.iteration
    batches_by = _batch_schedule(cfg, dp, consumed)
    last = start.iteration if cfg.training.skip_train else cfg.training.train_iters  # --skip-train: evaluate only
    for iteration in range(start.iteration + 1, last + 1):  # 1-based: the iteration being run
        faults.set_iteration(iteration, start.iteration)
        record_spans = progress.records_spans(iteration - 1 - start.iteration)
        set_phase(f"iteration {iteration}: the forward/backward schedule")
        global_batch = batches_by.at(consumed)
        if batches_by.varies:
            step.use_micro_batches(global_batch // (cfg.training.micro_batch_size * dp))
        batches = micro_batches(data, iteration - 1, cfg, dp, dp_rank, device, consumed, global_batch)
        samples_log.consumed(iteration, dp_rank, sample_indices(consumed, global_batch, dp, dp_rank))
        if local_sgd is None:
            num_tokens = logged_tokens = global_normalizer(batches, global_batch, dp_group)
        else:  # the log line's loss: the mean over replicas of each replica's mean
            num_tokens = global_normalizer(batches, cfg.training.global_batch_size // dp, replica_group)
            logged_tokens = num_tokens * dp
        if micro_batch_means_apply(cfg, task.loss_counts_vary):  # masks differ: Megatron-LM's mean
            replicas = 1 if local_sgd is not None else dp  # local SGD: each replica's own mean
            micro_batch_means(batches, num_tokens, replicas, parallel.get_context_parallel_group())
        # The schedule runs on steps; with a growing batch on samples seen, in final batches (Megatron-LM's).
        # (counted from where the schedule started: after upcycling, the dense run's samples)
        at = (iteration - 1 - start.schedule_start[0] if not batches_by.varies
              else (consumed - start.schedule_start[1]) / cfg.training.global_batch_size)
        loss_scale, lr = optimizer.loss_scaler.scale, schedule(at)
        embedding_lr = embedding_schedule(at) if embedding_schedule is not None else None
        if decay_schedule is not None:
            optimizer.set_weight_decay(decay_schedule(at))
        result = step(batches, num_tokens, lr, record_spans, f"iteration {iteration}", embedding_lr)
        consumed += global_batch
        samples_log.completed(iteration)
        try:
            progress.after_step(iteration, result, optimizer, loss_scale, lr, consumed,
                                loss_terms(task, batches, device), logged_tokens, record_spans)
        except TrainingStopped:
            optimizer.finish_param_gather()  # no gather left in flight when the ranks stop
            checkpoints.abandon()  # every rank stops at this iteration together
            raise
        t = cfg.training
        if _due(t.eval_interval, iteration, t.train_iters):
            evaluations(iteration)
        stop_reason = checkpoints.after_iteration(iteration, consumed, chunks, optimizer, progress.logger.say)
        reached = iteration
        record.after_iteration(iteration)
        faults.point("term")
        faults.point("step")
        if stop_reason:
            break
    if not stop_reason:  # Megatron-LM's evaluations once training ends (--skip-train: all there is)
        if cfg.training.skip_train:
            evaluations(reached, scalars=False)  # (no TensorBoard or W&B point, as Megatron-LM's)
        if test_data is not None:
            optimizer.finish_param_gather()
            set_phase(f"iteration {reached}: the test split")
            progress.logger.evaluation(reached, evaluate(cfg, task, step, eval_program, test_data, device,
                                                         cfg.training.eval_iters), task.perplexity_of, split="test",
                                       scalars=not cfg.training.skip_train)
    if local_sgd is not None:
        local_sgd.settle()  # async: no all-reduce left in flight when the process group goes
    checkpoints.close()
    samples_log.close()
    progress.close()
    optimizer.finish_param_gather()  # the returned parameters are whole (below ZeRO-3)
    for buf in buffers:  # ZeRO-3: read the returned parameters inside run.optimizer.whole_parameters()
        buf.park()
    if not progress.records and not stop_reason and start.iteration < last:
        raise UsageError("no iteration was run: --train-iters must be >= 1")
    return TrainingRun(progress.records, chunks, optimizer, buffers, local_sgd)
