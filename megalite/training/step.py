"""One optimizer step as one object: what it needs is bundled once per run (`TrainStep`), so the
loop, the benchmark and the tests call it with only what changes between steps."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from megalite import parallel
from megalite.config import stream_dtype
from megalite.config.sections import pass_costs
from megalite.models.fp8 import close_delayed_scaling
from megalite.models.moe import losses as moe_losses
from megalite.models.moe.router import expert_bias_routers, update_expert_biases
from megalite.optim import LocalSGD, MegaliteOptimizer, ParamAndGradBuffer, finalize_grads
from megalite.pipeline.replay import posts_receives_early
from megalite.pipeline.schedules import Op, ScheduleStats, build_program, exchange_plans, is_v_shaped, run_schedule
from megalite.runtime import set_phase
from megalite.training.build import tied_embedding_group


@dataclass
class StepResult:
    stats: ScheduleStats
    grad_norm: torch.Tensor
    found_inf: torch.Tensor  # 1.0: the step was skipped (inf/NaN gradients)
    optimizer_start: float  # perf_counter at the start of the optimizer span


@dataclass
class TrainStep:
    """The schedule's forwards and backwards (gradient reduction overlapped), `finalize_grads`,
    clipping and the update, for this rank's chunks. scripts/benchmark_gpt.py times it."""
    program: list[Op]
    chunks: list[torch.nn.Module]
    forward_step: Callable[[torch.nn.Module, dict], torch.Tensor]
    tensor_shape: tuple[int, int, int]  # what crosses a stage boundary: [seq / cp (/ tp under SP), micro-batch, hidden]
    dtype: torch.dtype
    buffers: list[ParamAndGradBuffer]
    optimizer: MegaliteOptimizer
    clip_grad: float
    embedding_group: object = None  # see build.tied_embedding_group
    overlap_grad_reduce: bool = True  # False: every bucket reduced after the last backward
    local_sgd: LocalSGD | None = None  # --local-sgd-interval: the outer loop, after each inner step
    schedule: str = "1f1b"  # --pipeline-schedule (build_program's kind)
    pass_costs: tuple = (1, 1, 1)  # --pipeline-pass-costs: a chunk's F, B, W, that a V program is ordered for
    params: list[torch.nn.Parameter] = field(init=False)
    programs: dict[int, list[Op]] = field(init=False)  # by micro-batches a step (a ramp-up changes them)
    routers: list = field(init=False)  # the routers balanced by an expert bias after each step
    delayed_fp8: bool = False  # FP8 delayed scaling: its amaxes reduced over `amax_group` each step
    overlap_pairs: bool = False  # --overlap-moe-expert-parallel-comm: forwards beside backwards, on two lanes
    delay_wgrad: bool = False  # --delay-wgrad-compute: weight gradients while exchanges are in flight
    amax_group: object = field(init=False)
    extra_warmup: int = 0  # --pipeline-extra-warmup: one more forward ahead on every stage but the last

    def __post_init__(self):
        self.params = [p for c in self.chunks for p in c.parameters() if p.requires_grad]
        self.routers = expert_bias_routers(self.chunks)
        self.programs = {self.micro_batches: self.program}
        self.amax_group = None
        if self.delayed_fp8:  # on every rank, stages without FP8 layers too: building a group is collective
            # Local SGD's replicas meet only in the outer step: their scales are their own.
            self.amax_group = (parallel.get_tensor_and_context_parallel_group() if self.local_sgd is not None
                               else parallel.get_amax_reduction_group())

    def use_micro_batches(self, m: int) -> None:
        """Run the next steps with `m` micro-batches (the batch ramp-up): the same schedule, built once
        for each count."""
        if m not in self.programs:
            vpp = len(self.chunks) if len(self.chunks) > 1 else None
            self.programs[m] = build_program(parallel.get_pipeline_model_parallel_world_size(),
                                             parallel.get_pipeline_model_parallel_rank(), m, vpp, self.schedule,
                                             self.pass_costs, paired=self.overlap_pairs, extra_warmup=self.extra_warmup)
        self.program = self.programs[m]

    @classmethod
    def for_run(cls, cfg, hidden_size: int, chunks, forward_step, buffers, optimizer,
                local_sgd: LocalSGD | None = None) -> "TrainStep":
        """The step `cfg` describe, on this rank of the current layout (with local SGD's outer loop)."""
        dp = parallel.get_data_parallel_world_size()
        m = cfg.training.global_batch_size // (cfg.training.micro_batch_size * dp)
        seq = cfg.model.seq_length // cfg.parallel.cp  # this rank's share of each sequence
        seq = seq // cfg.parallel.tp if cfg.parallel.sequence_parallel else seq
        schedule, costs = cfg.parallel.pipeline_schedule, pass_costs(cfg.parallel.pipeline_pass_costs)
        paired, extra = cfg.parallel.overlap_moe_expert_parallel_comm, cfg.parallel.pipeline_extra_warmup
        program = build_program(cfg.parallel.pp, parallel.get_pipeline_model_parallel_rank(), m, cfg.parallel.vpp,
                                schedule, costs, paired=paired, extra_warmup=extra)
        return cls(program, chunks, forward_step, (seq, cfg.training.micro_batch_size, hidden_size), stream_dtype(cfg),
                   buffers,
                   optimizer, cfg.optimizer.clip_grad, tied_embedding_group(cfg),
                   cfg.data_parallel.overlap_grad_reduce, local_sgd, schedule, costs,
                   delayed_fp8=cfg.precision.fp8_format is not None and cfg.precision.fp8_recipe == "delayed",
                   overlap_pairs=paired, extra_warmup=extra, delay_wgrad=cfg.parallel.delay_wgrad_compute)

    @property
    def v_shape(self) -> bool:
        """Whether the chunks sit in a V (zb-v): chunk 1 of pipeline rank r is virtual stage 2p-1-r."""
        return is_v_shaped(self.schedule)

    def exchange_plan(self, kind: str, m: int):
        """This rank's exchange plan for a `kind` program at m micro-batches where it is not the
        program's own (V programs, 1f1b and zb-h1 post receives early: `exchange_plans`), else None."""
        p, v = parallel.get_pipeline_model_parallel_world_size(), len(self.chunks)
        if not posts_receives_early(p, v, kind, self.overlap_pairs):
            return None
        return exchange_plans(p, m, v, kind, self.pass_costs,
                              self.extra_warmup)[parallel.get_pipeline_model_parallel_rank()]

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step on this rank (its program runs each through every chunk)."""
        return sum(op.kind == "F" for op in self.program) // len(self.chunks)

    def __call__(self, micro_batches: list[dict], num_tokens: torch.Tensor, lr: float, record_spans: bool = False,
                 label: str = "step", embedding_lr: float | None = None) -> StepResult:
        if record_spans:
            for buf in self.buffers:
                if hasattr(buf, "spans"):
                    buf.spans = []
        # The routers' loss terms: a micro-batch's share of the global batch (local SGD: of the
        # replica's, whose gradients are a mean of its own tokens), and the loss scale.
        replicas = 1 if self.local_sgd is not None else parallel.get_data_parallel_world_size()
        moe_losses.set_batch(self.micro_batches * self.tensor_shape[1] * replicas, self.tensor_shape[1],
                             self.optimizer.loss_scaler.scale)
        # --overlap-param-gather: the last update's gathers go now, behind this step's bookkeeping
        # collectives (the batch's token count), and the forward waits for each as it reads it.
        self.optimizer.start_param_gather()
        stats = run_schedule(self.program, self.chunks, micro_batches, self.forward_step, num_tokens,
                             self.tensor_shape, self.dtype, record_spans=record_spans, v_shape=self.v_shape,
                             plan=self.exchange_plan(self.schedule, self.micro_batches),
                             loss_scale=self.optimizer.loss_scaler.scale,
                             on_last_backward=self._enable_sync if self.overlap_grad_reduce else None,
                             overlap_pairs=self.overlap_pairs, delay_wgrad=self.delay_wgrad)
        t = time.perf_counter()
        set_phase(f"{label}: gradient reduction")
        finalize_grads(self.buffers, self.embedding_group)
        if self.local_sgd is not None and self.local_sgd.in_warmup:
            self.local_sgd.average_grads([b.grad_data for b in self.buffers])
        if record_spans:
            self.sync_device()  # a span of GPU work ends when the GPU is done, not when it was queued
            stats.spans.append(("grad reduce (wait)", "grad-reduce", t, time.perf_counter() - t))
            for buf in self.buffers:
                if getattr(buf, "spans", None) is not None:
                    stats.spans += buf.spans
                    buf.spans = None
        t = time.perf_counter()
        set_phase(f"{label}: the optimizer step")
        self.optimizer.spans = stats.spans if record_spans else None
        try:
            grad_norm, found_inf = self.optimizer.step(lr, self.clip_grad, embedding_lr)
        finally:
            self.optimizer.spans = None
        self.optimizer.zero_grad()
        update_expert_biases(self.routers, found_inf)
        if self.amax_group is not None:
            close_delayed_scaling(self.chunks, self.amax_group)
        if self.local_sgd is not None:
            set_phase(f"{label}: the local-SGD outer step")
            self.local_sgd.after_inner_step()
        return StepResult(stats, grad_norm, found_inf, t)

    def _enable_sync(self, chunk: int) -> None:
        for buf in self.buffers:  # a chunk's dense buffer, and its experts' where it has experts
            if buf.chunk_index == chunk:
                buf.enable_sync()

    def sync_device(self) -> None:
        if self.params and self.params[0].device.type == "cuda":
            torch.cuda.synchronize()


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
