"""What the loop reports after each step: skipped steps (and the stop after too many in a row),
the log window's figures at log lines, the timeline's spans, the bytes the step sent
(`comm_bytes`, megalite.parallel.traffic). Nothing here reads the device between log lines."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megalite import parallel
from megalite.config import expanded, to_toml
from megalite.models.moe import stats as moe_stats
from megalite.metrics import LogWindow, Timeline, TrainingLogger, default_peak_tflops, model_flops_per_iteration
from megalite.metrics_wandb import WandbOptions
from megalite.parallel import traffic
from megalite.pipeline.schedules import bubble_fraction
from megalite.runtime import TrainingStopped
from megalite.training.build import loss_stage_rank
from megalite.training.step import SkippedSteps, StepResult


def _rank_label(rank: int, tp: int, dp: int, cp: int = 1) -> str:
    cp_part = f", cp {(rank // tp) % cp}" if cp > 1 else ""
    return f"rank {rank} (pp {rank // (dp * cp * tp)}, dp {(rank // (cp * tp)) % dp}{cp_part}, tp {rank % tp})"


class Progress:
    def __init__(self, cfg, task, config, dtype: torch.dtype, device, micro_batches: int, models=()):
        self.cfg, self.device, self.model_config = cfg, device, config
        self.models = list(models)  # this rank's model chunks: their MoE layers hold the figures
        # numbered over the whole model, multi-token prediction's layers after the main ones
        self.all_layers = config.num_layers + config.mtp_num_layers
        self.moe_layers = [i for i in range(self.all_layers) if config.is_moe_layer(i)]
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        dp, pp = parallel.get_data_parallel_world_size(), cfg.parallel.pp
        self.dp = dp
        log = cfg.logging
        # Rank 0 logs (TensorBoard, W&B, the metrics file): the log window brings it the last stage's loss.
        self.logger = TrainingLogger(self.rank == 0, log.metrics_file, log.tensorboard_dir, cfg.training.train_iters,
                                     not log.no_progress_bar, WandbOptions.of(log, cfg.checkpoint.save))
        self.timeline = Timeline(cfg.logging.timeline, cfg.logging.timeline_iters)
        resolved = expanded(cfg)
        self.logger.configuration(to_toml(resolved, "the configuration of this run (--config reads it)"),
                                  cfg.logging.metrics_file, resolved.to_dict())
        sums_over = parallel.get_data_parallel_world_size(with_context_parallel=True)  # DP x CP
        self.window = LogWindow(device, task.loss_terms, task.perplexity_of,
                                parallel.get_data_parallel_group(with_context_parallel=True) if sums_over > 1 else None,
                                parallel.get_pipeline_model_parallel_group() if pp > 1 else None,
                                parallel.get_pipeline_model_parallel_ranks()[loss_stage_rank(cfg)])
        self.skips = SkippedSteps(device)
        self.flops = model_flops_per_iteration(config, cfg.training.global_batch_size, cfg.model.seq_length)
        self.peak = cfg.logging.peak_tflops or default_peak_tflops(dtype, tf32=not cfg.precision.no_tf32)
        # F, B and W of equal cost: 1F1B's (p-1)/(m+p-1), as the papers draw them
        self.bubble_theory = bubble_fraction(cfg.parallel.pipeline_schedule, pp, micro_batches, 1, 1, 1,
                                             cfg.parallel.vpp)
        self.records: list[dict] = []
        self.window_samples = self.window_steps = 0  # a ramp-up's steps are smaller: throughput from samples
        self.last_consumed = 0

    def start(self, consumed: int = 0) -> None:
        """Right after a barrier: every rank's timeline clock starts together; the traffic of the
        setup (initial broadcasts, a checkpoint load) is not the first step's. `consumed`: the samples
        the run starts after."""
        self.last_consumed = consumed
        self.timeline.start()
        traffic.take()

    def records_spans(self, step_index: int) -> bool:
        return self.timeline.records(step_index)

    def after_step(self, iteration: int, result: StepResult, optimizer, loss_scale: float, lr: float,
                   consumed: int, terms: torch.Tensor | None, num_tokens: torch.Tensor, record_spans: bool) -> None:
        """Account iteration `iteration` (1-based, done). Raises TrainingStopped after
        --max-skipped-iters skipped steps in a row (the same iteration on every rank); the logger is
        closed then (a W&B run marked failed with the exit code run_main gives it, 3)."""
        try:
            self._after_step(iteration, result, optimizer, loss_scale, lr, consumed, terms, num_tokens, record_spans)
        except TrainingStopped:
            self.logger.close(exit_code=3)
            raise

    def _after_step(self, iteration: int, result: StepResult, optimizer, loss_scale: float, lr: float,
                    consumed: int, terms: torch.Tensor | None, num_tokens: torch.Tensor, record_spans: bool) -> None:
        cfg = self.cfg
        self.logger.step()
        self.skips.add(result.found_inf, optimizer.last_skipped)
        self.window_samples += consumed - self.last_consumed
        self.window_steps += 1
        self.last_consumed = consumed
        if optimizer.last_skipped:
            self.logger.say(f"megalite: iteration {iteration}: inf/NaN gradients, step skipped "
                            f"(loss scale {loss_scale:g} -> {optimizer.loss_scaler.scale:g})")
        log_now = iteration % cfg.logging.log_interval == 0 or iteration == cfg.training.train_iters
        window_skipped = 0
        if log_now or optimizer.last_skipped is not None:  # the host reads the skips only now
            window_skipped, in_a_row = self.skips.read(end_window=log_now)
            if in_a_row >= cfg.training.max_skipped_iters:
                self._stop_on_nonfinite_router_logits(iteration)  # the likelier cause, named when it is
                raise TrainingStopped(
                    f"stopping at iteration {iteration}: {in_a_row} iterations in a row had inf/NaN "
                    f"gradients (loss scale {optimizer.loss_scaler.scale:g}); lower --lr, check the data, or "
                    f"use --bf16. The last checkpoint is intact.")
        stats = result.stats
        if record_spans:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            t = result.optimizer_start
            self.timeline.add(self.rank, iteration - 1,
                              [*stats.spans, ("optimizer", "optimizer", t, time.perf_counter() - t)])
        # Host timings of GPU work mean something only while synchronized: on a GPU, only in the
        # iterations the timeline records (spans synchronize); elsewhere the bubble is "unmeasured".
        timed = self.device.type == "cpu" or record_spans
        self.window.add(stats.loss_sum, terms, num_tokens,
                        1.0 - stats.busy_s / max(stats.wall_s, 1e-12) if timed else None)
        figures = self.window.close() if log_now else None
        # This step's bytes: since the last take, so with the previous iteration's exit-flag exchange
        # and this one's log-line reductions; validation and checkpoint gathers are not counted.
        comm_bytes = traffic.take()
        if record_spans:
            start = min((span[2] for span in stats.spans), default=result.optimizer_start)
            self.timeline.counter(self.rank, "comm bytes", start, comm_bytes)
        if log_now:
            self._log(iteration, result, optimizer, lr, consumed, window_skipped, figures, comm_bytes)

    def _log(self, iteration, result: StepResult, optimizer, lr, consumed, skipped, figures: dict,
             comm_bytes: dict[str, int]) -> None:
        cfg = self.cfg
        elapsed, bubble_measured = figures.pop("seconds_per_iter"), figures.pop("bubble")
        samples_per_iter = self.window_samples / self.window_steps
        steps = self.window_steps
        self.window_samples = self.window_steps = 0
        # FLOPs grow with the batch: a ramp-up's smaller steps count their own samples (else 1.0 exactly)
        flops = self.flops * (samples_per_iter / cfg.training.global_batch_size)
        tflops = flops / elapsed / self.world_size / 1e12
        record = {
            "iteration": iteration,
            "train_iters": cfg.training.train_iters,
            "consumed_samples": consumed,
            **figures,
            "lr": lr,
            "grad_norm": result.grad_norm.item(),
            # --log-params-norm: a collective, at log lines only (every rank logs at the same iterations)
            "params_norm": optimizer.params_norm().item() if cfg.logging.log_params_norm else None,
            "loss_scale": optimizer.loss_scaler.scale,
            "skipped": skipped,
            "ms_per_iter": elapsed * 1e3,
            "tokens_per_sec": samples_per_iter * cfg.model.seq_length / elapsed,
            "tflops_per_gpu": tflops,
            "mfu": tflops / self.peak if self.peak else None,
            "optimizer_state_mib": optimizer.state_bytes() / 2 ** 20,
            "bubble_theory": self.bubble_theory,
            "bubble_measured": bubble_measured,
            "comm_bytes": comm_bytes,  # this rank's (rank 0's in the metrics file), by kind
        }
        if getattr(optimizer, "qk_clip", None) is not None:  # the last step's, over every stage
            record["max_attention_logit"] = self._max_attention_logit(optimizer.qk_clip)
        if self.model_config.is_moe:
            record.update(self._moe_figures(steps))
            nonfinite = record.pop("moe_nonfinite_router_logits")
            if nonfinite:
                raise TrainingStopped(moe_stats.nonfinite_logits_line(iteration, nonfinite))
        self.records.append(record)
        self.logger.train(record)

    @staticmethod
    def _max_attention_logit(qk_clip) -> float:
        largest = qk_clip.largest.clone()
        pp = parallel.get_pipeline_model_parallel_group()
        if dist.is_initialized() and dist.get_world_size(pp) > 1:  # collective: every rank logs alike
            traffic.counted_all_reduce("metrics", largest, pp, op=dist.ReduceOp.MAX)
        return largest.item()

    def _moe_figures(self, steps: int) -> dict:
        """The MoE layers' figures since the last take (collective: every rank at the same iteration)."""
        c = self.model_config
        return moe_stats.take(self.models, self.all_layers, self.moe_layers, c.num_moe_experts, self.device, steps)

    def _stop_on_nonfinite_router_logits(self, iteration: int) -> None:
        if self.model_config.is_moe:
            nonfinite = self._moe_figures(1)["moe_nonfinite_router_logits"]
            if nonfinite:
                raise TrainingStopped(moe_stats.nonfinite_logits_line(iteration, nonfinite))

    def close(self) -> None:
        self.logger.close()
        cp = self.cfg.parallel.cp
        self.timeline.write({r: _rank_label(r, self.cfg.parallel.tp, self.dp, cp) for r in range(self.world_size)})
