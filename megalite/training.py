"""The training loop: layout set-up, micro-batches through the pipeline schedule, gradient
reduction, clipping, optimizer step, logging and the timeline."""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megalite import arguments, checkpoint, ops, parallel
from megalite.metrics import Timeline, TrainingLogger, default_peak_tflops, gpt_flops_per_iteration
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
from megalite.runtime import TrainingStopped, UsageError, env_world, init_distributed, say, set_phase


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


def gpt_forward_step(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    out = model(batch["tokens"], labels=batch["labels"])
    return (out * batch["loss_mask"]).sum() if model.post_process else out


def _micro_batches(data, step: int, args, dp: int, dp_rank: int, device, consumed: int | None = None) -> list[dict]:
    """This DP rank's contiguous slice of global batch `step` (the one starting at sample
    `consumed`, default step * global batch), cut into micro-batches."""
    per_rank = args.global_batch_size // dp
    first = (step * args.global_batch_size if consumed is None else consumed) + dp_rank * per_rank
    out = []
    for start in range(first, first + per_rank, args.micro_batch_size):
        batch = data.batch(range(start, start + args.micro_batch_size))
        out.append({k: v.to(device, non_blocking=True) for k, v in batch.items()})
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
    config = arguments.model_config(args)
    dp = arguments.validate(args, world_size, config)
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


def evaluate(args, chunks, data, forward_step, program, tensor_shape, dtype, dp, device) -> float:
    """Mean loss over `--eval-iters` global batches of `data` (the same ones each time), forward
    only through the pipeline; the same value on every rank."""
    for c in chunks:
        c.eval()
    loss, tokens = torch.zeros((), device=device), torch.zeros((), device=device)
    with torch.no_grad():
        for j in range(args.eval_iters):
            batches = _micro_batches(data, j, args, dp, parallel.get_data_parallel_rank(), device)
            n = _global_normalizer(batches, args, parallel.get_data_parallel_group())
            stats = run_schedule(program, chunks, batches, forward_step, n, tensor_shape, dtype)
            loss += stats.loss_sum
            tokens += n
    both = torch.stack([loss, tokens])
    if dp > 1:
        dist.all_reduce(both, group=parallel.get_data_parallel_group())
    if args.pp > 1:
        dist.broadcast(both, src=parallel.get_pipeline_model_parallel_ranks()[-1],
                       group=parallel.get_pipeline_model_parallel_group())
    for c in chunks:
        c.train()
    return (both[0] / both[1]).item()


class ExitWatch:
    """SIGTERM / SIGUSR1 (Slurm's preemption warnings), --exit-duration-in-mins and --exit-interval:
    every rank learns at the same iteration that it is time to save and stop."""

    def __init__(self, args, device):
        import signal

        self.args, self.device, self.start = args, device, time.monotonic()
        self.signal_name: str | None = None
        if not args.no_exit_signal_handler:
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame):
        import signal

        self.signal_name = signal.Signals(signum).name

    def reason(self, iteration: int) -> str | None:
        """Why to stop after `iteration` (1-based), agreed by every rank; None to go on."""
        a = self.args
        if a.exit_interval and iteration % a.exit_interval == 0:
            return f"--exit-interval {a.exit_interval}"
        late = a.exit_duration_in_mins is not None and time.monotonic() - self.start >= 60 * a.exit_duration_in_mins
        flags = torch.tensor([self.signal_name is not None, late], dtype=torch.float32, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0] > 0:
            return f"signal {self.signal_name or 'received by another rank'}"
        if flags[1] > 0:
            return f"--exit-duration-in-mins {a.exit_duration_in_mins}"
        return None


def _load_checkpoint(args, task, config, chunks):
    """Weights before the optimizer exists (its masters copy them); returns the reader or None."""
    if not args.load:
        return None
    if not checkpoint.CheckpointReader.exists(args.load):
        say(f"megalite: no checkpoint in {args.load} yet: starting from scratch")
        return None
    reader = checkpoint.CheckpointReader(args.load)
    checkpoint.check_compatible(reader, config, task.model_kind)
    checkpoint.load_model_weights(args.load, chunks, reader)
    return reader


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
        scaler = ConstantLossScaler(args.loss_scale) if args.loss_scale else DynamicLossScaler(
            args.initial_loss_scale, args.loss_scale_window, args.hysteresis, args.min_loss_scale)
    else:
        scaler = ConstantLossScaler()
    optimizer = MegaliteOptimizer(buffers, lr=args.lr, weight_decay=args.weight_decay,
                                  betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                                  distributed=args.use_distributed_optimizer, loss_scaler=scaler,
                                  use_apex=args.use_apex_adam)
    return buffers, optimizer


def train_step(program, chunks, micro_batches, forward_step, num_tokens, tensor_shape, dtype, buffers, params,
               optimizer, lr: float, clip_grad: float, record_spans: bool = False, label: str = "step"):
    """One optimizer step: the schedule's forwards and backwards (gradient reduction overlapped),
    the wait for the last reductions, clipping and the update. Returns (schedule stats, grad norm
    tensor, skipped, start time of the optimizer span); scripts/benchmark_gpt.py times this."""
    stats = run_schedule(program, chunks, micro_batches, forward_step, num_tokens, tensor_shape, dtype,
                         record_spans=record_spans, loss_scale=optimizer.loss_scaler.scale,
                         on_last_backward=lambda c: buffers[c].enable_sync())
    t = time.perf_counter()
    set_phase(f"{label}: gradient reduction")
    for buf in buffers:
        buf.finish_grad_sync()
    allreduce_sequence_parallel_grads(params)
    if record_spans:
        stats.spans.append(("grad reduce (wait)", "grad-reduce", t, time.perf_counter() - t))
    t = time.perf_counter()
    set_phase(f"{label}: the optimizer step")
    grad_norm, skipped = optimizer.step(lr, clip_grad)
    optimizer.zero_grad()
    return stats, grad_norm, skipped, t


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
    if reader is not None:
        start_iteration, consumed = reader.metadata["iteration"], reader.metadata["consumed_samples"]
        loaded_optim = not args.no_load_optim and checkpoint.load_optimizer_state(reader, chunks, optimizer)
        same_rng = checkpoint.restore_rng(reader, layout)
        say(f"megalite: resumed from {reader.path} (iteration {start_iteration}, {consumed} samples consumed; "
            f"optimizer state {'loaded' if loaded_optim else 'fresh'}; RNG streams "
            f"{'restored' if same_rng else 'from the seed (layout changed)'})")
    saver = checkpoint.Checkpointer(args.save, args.save_async) if args.save else None
    exits = ExitWatch(args, device)
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
    # Host timings of GPU work are meaningless without synchronizing; only the timeline does that.
    measure_bubble = device.type == "cpu" or bool(args.timeline)

    logger = TrainingLogger(rank == 0, args.metrics_file, args.tensorboard_dir, args.train_iters,
                            not args.no_progress_bar)
    eval_program = build_program(pp, pp_rank, m, args.vpp, kind="forward-only")
    timeline = Timeline(args.timeline, args.timeline_iters)
    flops = gpt_flops_per_iteration(args.global_batch_size, args.seq_length, config.num_layers,
                                    config.hidden_size, config.vocab_size)
    peak = args.peak_tflops or default_peak_tflops()
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
        say(f"megalite: saved checkpoint iteration {iteration} to {args.save}"
            + (" (writing in the background)" if args.save_async else ""))

    dist.barrier()
    timeline.start()
    skipped_in_a_row = 0
    records, window_start, window_iters = [], time.perf_counter(), 0
    window_loss = torch.zeros((), device=device)
    window_bubble, window_skipped = 0.0, 0
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
        stats, grad_norm, skipped, t = train_step(program, chunks, micro_batches, task.forward_step, num_tokens,
                                                  tensor_shape, dtype, buffers, params, optimizer, lr,
                                                  args.clip_grad, record_spans, f"iteration {iteration + 1}")
        spans += stats.spans
        consumed += args.global_batch_size
        logger.step()
        skipped_in_a_row = skipped_in_a_row + 1 if skipped else 0
        if skipped:
            window_skipped += 1
            logger.say(f"megalite: iteration {iteration + 1}: inf/NaN gradients, step skipped "
                       f"(loss scale {loss_scale:g} -> {optimizer.loss_scaler.scale:g})")
            if skipped_in_a_row >= args.max_skipped_iters:
                if saver is not None:  # every rank stops here together: commit a pending async save
                    saver.finalize()
                raise TrainingStopped(
                    f"stopping at iteration {iteration + 1}: {skipped_in_a_row} iterations in a row had inf/NaN "
                    f"gradients (loss scale {optimizer.loss_scaler.scale:g}); lower --lr, check the data, or "
                    f"use --bf16. The last checkpoint is intact.")
        if record_spans:
            if device.type == "cuda":
                torch.cuda.synchronize()
            spans.append(("optimizer", "optimizer", t, time.perf_counter() - t))
            timeline.add(rank, iteration, spans)

        window_loss += stats.loss_sum / num_tokens
        window_bubble += 1.0 - stats.busy_s / max(stats.wall_s, 1e-12)
        window_iters += 1
        if (iteration + 1) % args.log_interval == 0 or iteration + 1 == args.train_iters:
            stats_t = torch.stack([window_loss, torch.tensor(window_bubble, device=device)])
            if dp > 1:
                dist.all_reduce(stats_t[:1], group=dp_group)
            if pp > 1:  # the loss lives on the last stage; the bubble is averaged over stages
                bubble = stats_t[1:].clone()
                dist.all_reduce(bubble, group=pp_group)
                dist.broadcast(stats_t, src=last_stage, group=pp_group)
                stats_t[1] = bubble[0] / pp
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = (time.perf_counter() - window_start) / window_iters
            tflops = flops / elapsed / world_size / 1e12
            record = {
                "iteration": iteration + 1,
                "train_iters": args.train_iters,
                "consumed_samples": consumed,
                "loss": (stats_t[0] / window_iters).item(),
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
                "bubble_measured": (stats_t[1] / window_iters).item() if measure_bubble and pp > 1 else None,
            }
            records.append(record)
            logger.train(record)
            window_start, window_iters, window_bubble, window_skipped = time.perf_counter(), 0, 0.0, 0
            window_loss = torch.zeros((), device=device)
        if valid_data is not None and args.eval_interval and args.eval_iters and (
                (iteration + 1) % args.eval_interval == 0 or iteration + 1 == args.train_iters):
            set_phase(f"iteration {iteration + 1}: validation")
            logger.evaluation(iteration + 1, evaluate(args, chunks, valid_data, task.forward_step, eval_program,
                                                      tensor_shape, dtype, dp, device))
        stop_reason = exits.reason(iteration + 1)
        if saver is not None and (stop_reason or iteration + 1 == args.train_iters or (
                args.save_interval and (iteration + 1) % args.save_interval == 0)):
            save(iteration + 1)
        if stop_reason:
            logger.say(f"megalite: stopping after iteration {iteration + 1} ({stop_reason})"
                       + (", checkpoint saved" if saver is not None else ""))
            break
    if saver is not None:
        set_phase("finishing the last checkpoint")
        saver.finalize()
    logger.close()
    timeline.write({r: _rank_label(r, args.tp, dp) for r in range(world_size)})
    if not records and not stop_reason and start_iteration < args.train_iters:
        raise UsageError("no iteration was run: --train-iters must be >= 1")
    return TrainingRun(records, chunks, optimizer, buffers)
