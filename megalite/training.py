"""The training loop: layout set-up, micro-batches through the pipeline schedule, gradient
reduction, clipping, optimizer step, logging and the timeline."""
from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megalite import arguments, checkpoint, ops, parallel
from megalite.exits import ExitWatch
from megalite.metrics import LogWindow, Timeline, TrainingLogger, default_peak_tflops, gpt_flops_per_iteration
from megalite.models import compile_layers
from megalite.models.config import TransformerConfig
from megalite.optim import (
    ConstantLossScaler,
    DynamicLossScaler,
    LRSchedule,
    MegaliteOptimizer,
    ParamAndGradBuffer,
    allreduce_sequence_parallel_grads,
)
from megalite.pipeline.partition import layers_of, stage_layer_counts
from megalite.pipeline.schedules import build_program, run_schedule, theoretical_bubble
from megalite.runtime import (
    TrainingStopped,
    UsageError,
    env_world,
    init_distributed,
    say,
    select_device,
    set_phase,
)


@dataclass
class Task:
    """What an entry point plugs into the loop."""
    # build_model(config, args, device, pre_process, post_process, layer_numbers) -> one model chunk
    build_model: Callable[..., torch.nn.Module]
    # build_data(config, args) -> (train, valid or None), each with .batch(sample_indices) -> dict
    build_data: Callable[[TransformerConfig, object], tuple]
    # forward_step(chunk, batch): summed loss on the last stage, hidden states elsewhere
    forward_step: Callable[[torch.nn.Module, dict], torch.Tensor]
    # prepare(args): before anything else, resolve data and tokenizer (may set args.vocab_size)
    prepare: Callable[[object], None] | None = None
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


def set_tf32(enabled: bool) -> None:
    """TF32 tensor cores for fp32 matmuls and convolutions (Ampere and later): on by default, as the
    MFU of an fp32 run is reported against the TF32 peak. bf16/fp16 runs do not use it."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def to_device(batch: dict, device: torch.device) -> dict:
    """A host batch on `device`: through pinned memory when it is a GPU, so the copy is truly
    asynchronous (from pageable memory `non_blocking` copies synchronously)."""
    if device.type == "cpu":
        return batch
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}


def _micro_batches(data, step: int, args, dp: int, dp_rank: int, device, consumed: int | None = None) -> list[dict]:
    """This DP rank's contiguous slice of global batch `step` (the one starting at sample
    `consumed`, default step * global batch), cut into micro-batches."""
    per_rank = args.global_batch_size // dp
    first = (step * args.global_batch_size if consumed is None else consumed) + dp_rank * per_rank
    out = []
    for start in range(first, first + per_rank, args.micro_batch_size):
        out.append(to_device(data.batch(range(start, start + args.micro_batch_size)), device))
    return out


def _loss_terms(task: Task, micro_batches, device) -> torch.Tensor | None:
    """The task's named loss terms summed over this rank's micro-batches (zeros off the last stage);
    None for a task without terms (GPT), so its steps do no work for them."""
    if not task.loss_terms:
        return None
    out = torch.zeros(len(task.loss_terms), device=device)
    for b in micro_batches:
        terms = b.get("loss_terms")
        if terms:
            out += torch.stack([terms[name].float() for name in task.loss_terms])
    return out


def _global_normalizer(micro_batches, args, dp_group) -> torch.Tensor:
    """Loss-mask count of the whole global batch (summed over DP). Each micro-batch also carries
    it, with the global batch size, for losses with more than one term (BERT: MLM + SOP)."""
    num_tokens = sum(b["loss_mask"].sum() for b in micro_batches).float()
    if dp_group is not None and parallel.get_data_parallel_world_size() > 1:
        dist.all_reduce(num_tokens, group=dp_group)
    for b in micro_batches:
        b["num_tokens"], b["global_batch_size"] = num_tokens, args.global_batch_size
    return num_tokens


def _plan_warning(args, world_size: int) -> None:
    """--plan: the layout planner's prediction for this run, with a warning if it will not fit."""
    from megalite.tools.plan import check_args

    memory = args.plan_gpu_memory_gib * 2 ** 30 if args.plan_gpu_memory_gib else None
    if memory is None and not torch.cuda.is_available():
        raise UsageError("--plan on a machine without GPUs needs --plan-gpu-memory-gib (the GPUs' memory)")
    try:
        fits, pred = check_args(args, world_size, gpu_memory_bytes=memory)
    except ValueError as e:
        say(f"megalite: --plan cannot model this run: {e}")
        return
    gib = pred.memory["total"] / 2 ** 30
    if fits:
        say(f"megalite: plan: this layout needs about {gib:.1f} GiB per GPU, a step about "
            f"{pred.time['total'] * 1e3:.0f} ms (see python -m megalite.tools.plan --explain)")
    else:
        say(f"megalite: warning: the planner predicts this layout will not fit: {pred.reason}. "
            f"`python -m megalite.tools.plan` lists layouts that do")


def setup(args, world_size: int):
    """Validate the layout, start the process groups, seed the RNG streams."""
    select_device()  # first: validation may build the fused kernels on the current GPU
    config = arguments.model_config(args)
    dp = arguments.validate(args, world_size, config)
    set_tf32(not args.no_tf32)
    if args.plan:
        _plan_warning(args, world_size)
    device = init_distributed(args.distributed_timeout_minutes)
    parallel.initialize_model_parallel(args.tp, args.pp, args.vpp,
                                       timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    parallel.model_parallel_manual_seed(args.seed)
    return config, dp, device


def build_model_chunks(task: Task, config, args, device) -> list[torch.nn.Module]:
    """This rank's model chunks: one per virtual stage it runs (chunk c is virtual stage c*pp + r)."""
    p, r, v = args.pp, parallel.get_pipeline_model_parallel_rank(), args.vpp or 1
    counts = stage_layer_counts(config.num_layers, p, args.vpp, args.pipeline_layers)
    chunks = []
    for c in range(v):
        vs = c * p + r
        chunks.append(task.build_model(config, args, device, pre_process=vs == 0,
                                       post_process=vs == p * v - 1, layer_numbers=layers_of(counts, vs)))
        if getattr(args, "torch_compile", False):
            compile_layers(chunks[-1])
    return chunks


def evaluate(args, task: Task, chunks, data, program, tensor_shape, dtype, dp, device) -> dict[str, float]:
    """Mean loss (and the task's loss terms) over `--eval-iters` global batches of `data` (the same
    ones each time), forward only through the pipeline; the same values on every rank."""
    for c in chunks:
        c.eval()
    sums = torch.zeros(1 + len(task.loss_terms), device=device)  # loss, then the terms
    tokens = torch.zeros((), device=device)
    with torch.no_grad():
        for j in range(args.eval_iters):
            batches = _micro_batches(data, j, args, dp, parallel.get_data_parallel_rank(), device)
            n = _global_normalizer(batches, args, parallel.get_data_parallel_group())
            stats = run_schedule(program, chunks, batches, task.forward_step, n, tensor_shape, dtype)
            sums[0] += stats.loss_sum
            if task.loss_terms:
                sums[1:] += _loss_terms(task, batches, device)
            tokens += n  # already global (`_global_normalizer`): only the sums are per DP rank
    if dp > 1:
        dist.all_reduce(sums, group=parallel.get_data_parallel_group())
    if args.pp > 1:
        dist.broadcast(sums, src=parallel.get_pipeline_model_parallel_ranks()[-1],
                       group=parallel.get_pipeline_model_parallel_group())
    for c in chunks:
        c.train()
    means = (sums / tokens).tolist()
    return {"loss": means[0], **dict(zip(task.loss_terms, means[1:]))}


def _same_directory(a: str, b: str | None) -> bool:
    return b is not None and os.path.abspath(a) == os.path.abspath(b)


def _load_checkpoint(args, task, config, chunks):
    """Weights before the optimizer exists (its masters copy them); returns the reader or None.
    `--load` names a --save directory (its newest checkpoint) or one `iter_NNNNNNN` in it. Only
    the restart idiom (`--load` equal to `--save`) may find nothing there and start from scratch."""
    if not args.load:
        return None
    if args.finetune and args.save and not _same_directory(args.load, args.save) \
            and checkpoint.CheckpointReader.exists(args.save):
        # A requeued fine-tuning job: its own checkpoints are newer than the weights it started from.
        say(f"megalite: --save {args.save} already holds this fine-tuning run's checkpoints: resuming them "
            f"instead of starting again from --load {args.load}")
        args.load, args.finetune = args.save, False
    if not checkpoint.CheckpointReader.exists(args.load):
        path = Path(args.load)
        if path.is_file():
            raise UsageError(f"--load {args.load} is a file: give the directory that --save wrote "
                             f"(or one of its iter_NNNNNNN directories)")
        if _same_directory(args.load, args.save):
            say(f"megalite: no checkpoint in {args.load} yet: starting from scratch")
            return None
        if not path.exists():
            raise UsageError(f"--load {args.load} does not exist: check the path; to start from scratch drop "
                             f"--load, or give it the same directory as --save (the restart idiom)")
        raise UsageError(f"--load {args.load} holds no checkpoint (no 'latest' file, no metadata.json): give a "
                         f"directory written by --save or by `python -m megalite.tools.convert_hf import`")
    reader = checkpoint.CheckpointReader(args.load)
    checkpoint.check_compatible(reader, config, task.model_kind)
    checkpoint.load_model_weights(reader.path, chunks, reader)
    return reader


def _resume_point(args, reader) -> tuple[int, int]:
    """(first iteration, consumed samples) after loading: where the checkpoint stopped, or 0 with
    --finetune (a new run from loaded weights). A checkpoint past --train-iters is refused."""
    if reader is None or args.finetune:
        return 0, 0
    iteration, consumed = reader.metadata["iteration"], reader.metadata["consumed_samples"]
    if iteration > args.train_iters:
        raise UsageError(f"the checkpoint {reader.path} is at iteration {iteration}, past --train-iters "
                         f"{args.train_iters}: raise --train-iters to continue it, or add --finetune to train "
                         f"{args.train_iters} new iterations from its weights")
    return iteration, consumed


def _rank_label(rank: int, tp: int, dp: int) -> str:
    return f"rank {rank} (pp {rank // (dp * tp)}, dp {(rank // tp) % dp}, tp {rank % tp})"


@dataclass
class TrainingRun:
    records: list[dict]  # the logged records (on every rank)
    model_chunks: list[torch.nn.Module]
    optimizer: MegaliteOptimizer
    buffers: list[ParamAndGradBuffer]


def build_optimizer(args, chunks) -> tuple[list[ParamAndGradBuffer], MegaliteOptimizer]:
    """Lay each chunk's parameters out in gradient buckets and build the optimizer over them."""
    dtype = arguments.model_dtype(args)
    tied_across_stages = args.pp > 1
    buffers = [
        ParamAndGradBuffer(
            [p for p in chunk.parameters() if p.requires_grad], param_dtype=dtype, grad_dtype=torch.float32,
            bucket_numel=args.ddp_bucket_size, dp_group=parallel.get_data_parallel_group(),
            dp_size=parallel.get_data_parallel_world_size(), reduce_scatter=args.use_distributed_optimizer,
            comm_dtype=torch.bfloat16 if args.grad_reduce_dtype == "bf16" else None,
            deferred=lambda p: tied_across_stages and getattr(p, "tied_embedding", False),
            embedding_group=parallel.get_embedding_group() if tied_across_stages else None,
        )
        for chunk in chunks
    ]
    if args.fp16:
        scaler = ConstantLossScaler(args.loss_scale) if args.loss_scale is not None else DynamicLossScaler(
            args.initial_loss_scale, args.loss_scale_window, args.hysteresis, args.min_loss_scale)
    else:
        scaler = ConstantLossScaler()
    optimizer = MegaliteOptimizer(buffers, lr=args.lr, weight_decay=args.weight_decay,
                                  betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                                  distributed=args.use_distributed_optimizer, loss_scaler=scaler,
                                  use_apex=args.use_apex_adam)
    return buffers, optimizer


def _sync_gpu(chunks) -> None:
    if next(chunks[0].parameters()).device.type == "cuda":
        torch.cuda.synchronize()


def train_step(program, chunks, micro_batches, forward_step, num_tokens, tensor_shape, dtype, buffers, params,
               optimizer, lr: float, clip_grad: float, record_spans: bool = False, label: str = "step"):
    """One optimizer step: the schedule's forwards and backwards (gradient reduction overlapped),
    the wait for the last reductions, clipping and the update. Returns (schedule stats, grad norm
    tensor, found_inf tensor (1.0: the step was skipped), start time of the optimizer span);
    scripts/benchmark_gpt.py times this."""
    stats = run_schedule(program, chunks, micro_batches, forward_step, num_tokens, tensor_shape, dtype,
                         record_spans=record_spans, loss_scale=optimizer.loss_scaler.scale,
                         on_last_backward=lambda c: buffers[c].enable_sync())
    t = time.perf_counter()
    set_phase(f"{label}: gradient reduction")
    for buf in buffers:
        buf.finish_grad_sync()
    allreduce_sequence_parallel_grads(params)
    if record_spans:
        _sync_gpu(chunks)  # a span of GPU work ends when the GPU is done, not when it was queued
        stats.spans.append(("grad reduce (wait)", "grad-reduce", t, time.perf_counter() - t))
    t = time.perf_counter()
    set_phase(f"{label}: the optimizer step")
    grad_norm, found_inf = optimizer.step(lr, clip_grad)
    optimizer.zero_grad()
    return stats, grad_norm, found_inf, t


class SkippedSteps:
    """Steps skipped for inf/NaN gradients, counted on the device and read by the host only at log
    lines, so the steps between make no host sync. Where the host knows each skip anyway (fp16's
    dynamic loss scaler reads the flag), the counts are kept on the host instead."""

    def __init__(self, device):
        self.device_counts = torch.zeros(2, device=device)  # [skipped in the window, in a row]
        self.window = self.in_a_row = 0
        self.on_device = False

    def add(self, found_inf: torch.Tensor, known: bool | None) -> None:
        if known is None:
            self.on_device = True
            self.device_counts[0] += found_inf
            self.device_counts[1] = (self.device_counts[1] + found_inf) * found_inf
        else:
            self.window += int(known)
            self.in_a_row = self.in_a_row + 1 if known else 0

    def read(self, end_window: bool) -> tuple[int, int]:
        """(skipped in the log window so far, skipped in a row now); `end_window` starts a new window."""
        window, in_a_row = (int(v) for v in self.device_counts.tolist()) if self.on_device else (0, 0)
        window += self.window
        if end_window:
            self.device_counts[0], self.window = 0, 0
        return window, max(in_a_row, self.in_a_row)


def pretrain(args, task: Task) -> TrainingRun:
    """Train as `args` say."""
    _, world_size, _ = env_world()
    if task.prepare is not None:
        task.prepare(args)
    config, dp, device = setup(args, world_size)
    chunks = build_model_chunks(task, config, args, device)
    set_phase("loading the checkpoint")
    reader = _load_checkpoint(args, task, config, chunks)
    params = [p for c in chunks for p in c.parameters() if p.requires_grad]
    buffers, optimizer = build_optimizer(args, chunks)
    start_iteration, consumed = 0, 0
    layout = {"tp": args.tp, "pp": args.pp, "dp": world_size // (args.tp * args.pp), "vpp": args.vpp,
              "world": world_size}
    start_iteration, consumed = _resume_point(args, reader)
    if reader is not None and args.finetune:
        say(f"megalite: fine-tuning from the weights of {reader.path} (iteration {reader.metadata['iteration']}): "
            f"iteration, data position, optimizer state and RNG streams start anew")
    elif reader is not None:
        loaded_optim = not args.no_load_optim and checkpoint.load_optimizer_state(reader, chunks, optimizer)
        same_rng = checkpoint.restore_rng(reader, layout)
        say(f"megalite: resumed from {reader.path} (iteration {start_iteration}, {consumed} samples consumed; "
            f"optimizer state {'loaded' if loaded_optim else 'fresh'}; RNG streams "
            f"{'restored' if same_rng else 'from the seed (layout changed)'})")
        if start_iteration == args.train_iters:
            say(f"megalite: the checkpoint is already at --train-iters {args.train_iters}: nothing to train "
                f"(raise --train-iters to continue, or add --finetune to start a new run from these weights)")
    saver = checkpoint.Checkpointer(args.save, args.save_async) if args.save else None
    exits = ExitWatch(args, checkpoint_error=saver.poll if saver is not None else lambda: None,
                      watch_checkpoints=saver is not None and args.save_async)
    dtype = arguments.model_dtype(args)
    schedule = LRSchedule(args.lr, args.min_lr, args.lr_warmup_iters, args.lr_decay_iters or args.train_iters,
                          args.lr_decay_style)
    data, valid_data = task.build_data(config, args)

    rank = dist.get_rank()
    dp_rank, dp_group = parallel.get_data_parallel_rank(), parallel.get_data_parallel_group()
    pp, pp_rank, pp_group = args.pp, parallel.get_pipeline_model_parallel_rank(), parallel.get_pipeline_model_parallel_group()
    last_stage = parallel.get_pipeline_model_parallel_ranks()[-1]
    m = args.global_batch_size // (args.micro_batch_size * dp)
    program = build_program(pp, pp_rank, m, args.vpp)
    seq = args.seq_length // args.tp if args.sequence_parallel else args.seq_length
    tensor_shape = (seq, args.micro_batch_size, config.hidden_size)
    bubble_theory = theoretical_bubble(pp, m, args.vpp)

    logger = TrainingLogger(rank == 0, args.metrics_file, args.tensorboard_dir, args.train_iters,
                            not args.no_progress_bar)
    eval_program = build_program(pp, pp_rank, m, args.vpp, kind="forward-only")
    timeline = Timeline(args.timeline, args.timeline_iters)
    flops = gpt_flops_per_iteration(args.global_batch_size, args.seq_length, config.num_layers,
                                    config.hidden_size, config.vocab_size)
    peak = args.peak_tflops or default_peak_tflops(dtype, tf32=not args.no_tf32)
    say(f"megalite: {config.num_layers} layers, hidden {config.hidden_size}, {world_size} ranks as "
        f"tp={args.tp} pp={pp} dp={dp}" + (f" vpp={args.vpp}" if args.vpp else "") +
        f", global batch {args.global_batch_size} x {args.seq_length} tokens, {m} micro-batches per step")
    if device.type == "cuda" and config.norm_backend != "torch":
        # Build (or load) the fused kernels now, not inside the first step, and say which path runs.
        say(f"megalite: {ops.kernels_available()}")

    def save(iteration: int) -> None:
        set_phase(f"saving the checkpoint of iteration {iteration}")
        meta = checkpoint.build_metadata(config, task.model_kind, iteration, consumed, layout)
        saver.save(chunks, optimizer, iteration, meta)
        say(f"megalite: checkpoint iteration {iteration} writing in the background to {args.save} (committed "
            f"when every rank has written)" if args.save_async else
            f"megalite: saved checkpoint iteration {iteration} to {args.save}")

    dist.barrier()
    timeline.start()
    skips = SkippedSteps(device)
    records = []
    window = LogWindow(device, task.loss_terms, task.perplexity_of, dp_group if dp > 1 else None,
                       pp_group if pp > 1 else None, last_stage)
    for c in chunks:
        c.train()
    stop_reason = None
    for iteration in range(start_iteration, args.train_iters):
        record_spans = timeline.records(iteration - start_iteration)
        spans = []
        set_phase(f"iteration {iteration + 1}: the forward/backward schedule (pipeline send/recv)")
        micro_batches = _micro_batches(data, iteration, args, dp, dp_rank, device, consumed)
        num_tokens = _global_normalizer(micro_batches, args, dp_group)
        loss_scale = optimizer.loss_scaler.scale
        lr = schedule(iteration)
        stats, grad_norm, found_inf, t = train_step(program, chunks, micro_batches, task.forward_step, num_tokens,
                                                  tensor_shape, dtype, buffers, params, optimizer, lr,
                                                  args.clip_grad, record_spans, f"iteration {iteration + 1}")
        spans += stats.spans
        consumed += args.global_batch_size
        logger.step()
        skips.add(found_inf, optimizer.last_skipped)
        if optimizer.last_skipped:
            logger.say(f"megalite: iteration {iteration + 1}: inf/NaN gradients, step skipped "
                       f"(loss scale {loss_scale:g} -> {optimizer.loss_scaler.scale:g})")
        log_now = (iteration + 1) % args.log_interval == 0 or iteration + 1 == args.train_iters
        if log_now or optimizer.last_skipped is not None:  # the host reads the skips only now
            window_skipped, in_a_row = skips.read(end_window=log_now)
            if in_a_row >= args.max_skipped_iters:
                if saver is not None:  # every rank stops here together: commit a pending async save
                    saver.finalize()
                raise TrainingStopped(
                    f"stopping at iteration {iteration + 1}: {in_a_row} iterations in a row had inf/NaN "
                    f"gradients (loss scale {optimizer.loss_scaler.scale:g}); lower --lr, check the data, or "
                    f"use --bf16. The last checkpoint is intact.")
        if record_spans:
            if device.type == "cuda":
                torch.cuda.synchronize()
            spans.append(("optimizer", "optimizer", t, time.perf_counter() - t))
            timeline.add(rank, iteration, spans)

        # Host timings of GPU work mean something only while synchronized: on a GPU, only in the
        # iterations the timeline records (spans synchronize); elsewhere the bubble is "unmeasured".
        timed = device.type == "cpu" or record_spans
        window.add(stats.loss_sum, _loss_terms(task, micro_batches, device), num_tokens,
                   1.0 - stats.busy_s / max(stats.wall_s, 1e-12) if timed else None)
        if log_now:
            figures = window.close()
            elapsed, bubble_measured = figures.pop("seconds_per_iter"), figures.pop("bubble")
            tflops = flops / elapsed / world_size / 1e12
            record = {
                "iteration": iteration + 1,
                "train_iters": args.train_iters,
                "consumed_samples": consumed,
                **figures,
                "lr": lr,
                "grad_norm": grad_norm.item(),
                "loss_scale": optimizer.loss_scaler.scale,
                "skipped": window_skipped,
                "ms_per_iter": elapsed * 1e3,
                "tokens_per_sec": args.global_batch_size * args.seq_length / elapsed,
                "tflops_per_gpu": tflops,
                "mfu": tflops / peak if peak else None,
                "optimizer_state_mib": optimizer.state_bytes() / 2 ** 20,
                "bubble_theory": bubble_theory,
                "bubble_measured": bubble_measured,
            }
            records.append(record)
            logger.train(record)
        if valid_data is not None and args.eval_interval and args.eval_iters and (
                (iteration + 1) % args.eval_interval == 0 or iteration + 1 == args.train_iters):
            set_phase(f"iteration {iteration + 1}: validation")
            logger.evaluation(iteration + 1, evaluate(args, task, chunks, valid_data, eval_program, tensor_shape,
                                                      dtype, dp, device), task.perplexity_of)
        stop_reason = exits.reason(iteration + 1)
        if saver is not None and (stop_reason or iteration + 1 == args.train_iters or (
                args.save_interval and (iteration + 1) % args.save_interval == 0)):
            save(iteration + 1)
        if stop_reason:
            logger.say(f"megalite: stopping after iteration {iteration + 1} ({stop_reason})"
                       + (", checkpoint saved" if saver is not None else ""))
            break
    exits.close()
    if saver is not None:
        set_phase("finishing the last checkpoint")
        saver.close()  # waits for a background commit, then gives the directory up
    logger.close()
    timeline.write({r: _rank_label(r, args.tp, dp) for r in range(world_size)})
    if not records and not stop_reason and start_iteration < args.train_iters:
        raise UsageError("no iteration was run: --train-iters must be >= 1")
    return TrainingRun(records, chunks, optimizer, buffers)
