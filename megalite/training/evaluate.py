"""Validation: the mean loss (and a task's loss terms) over fixed global batches, forward only."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megalite import parallel
from megalite.parallel import traffic
from megalite.pipeline.schedules import Op, forward_only_kind, run_schedule
from megalite.training.datasets import micro_batch_means_apply
from megalite.training.batches import global_normalizer, loss_terms, micro_batch_means, micro_batches
from megalite.training.build import loss_stage_rank
from megalite.training.step import TrainStep
from megalite.training.task import Task


def evaluate(cfg, task: Task, step: TrainStep, program: list[Op], data, device,
             batches: int | None = None) -> dict[str, float]:
    """Mean loss (and the task's loss terms) over the first `batches` (default `--eval-iters`) global
    batches of `data` (the same ones each time), forward only through the pipeline (`program`) over
    `step`'s chunks; the same values on every rank. Its communication is not counted in the training
    steps' traffic."""
    with traffic.excluded():
        return _evaluate(cfg, task, step, program, data, device,
                         cfg.training.eval_iters if batches is None else batches)


def _evaluate(cfg, task: Task, step: TrainStep, program: list[Op], data, device, iters: int) -> dict[str, float]:
    chunks = step.chunks
    dp = parallel.get_data_parallel_world_size()  # samples dealt over DP, sums over DP x CP
    dp_group = parallel.get_data_parallel_group(with_context_parallel=True)
    for c in chunks:
        c.eval()
    sums = torch.zeros(1 + len(task.loss_terms), device=device)  # loss, then the terms
    tokens = torch.zeros((), device=device)
    with torch.no_grad():
        for j in range(iters):
            batches = micro_batches(data, j, cfg, dp, parallel.get_data_parallel_rank(), device)
            n = global_normalizer(batches, cfg.training.global_batch_size, dp_group)
            if micro_batch_means_apply(cfg, task.loss_counts_vary):  # as training's loss
                micro_batch_means(batches, n, dp, parallel.get_context_parallel_group())
            stats = run_schedule(program, chunks, batches, task.forward_step, n, step.tensor_shape, step.dtype,
                                 v_shape=step.v_shape,
                                 plan=step.exchange_plan(forward_only_kind(step.schedule), len(batches)))
            sums[0] += stats.loss_sum
            if task.loss_terms:
                sums[1:] += loss_terms(task, batches, device)
            tokens += n  # already global (`global_normalizer`): only the sums are per DP rank
    if dist.get_world_size(dp_group) > 1:
        dist.all_reduce(sums, group=dp_group)
    if cfg.parallel.pp > 1:
        dist.broadcast(sums, src=parallel.get_pipeline_model_parallel_ranks()[loss_stage_rank(cfg)],
                       group=parallel.get_pipeline_model_parallel_group())
    for c in chunks:
        c.train()
    means = (sums / tokens).tolist()
    return {"loss": means[0], **dict(zip(task.loss_terms, means[1:]))}


def _check_generation_flag(flag: str, cfg, task: Task) -> None:
    """What a flag that runs the model as generation does (--eval-prompts, --eval-tasks) needs."""
    from megalite.errors import UsageError

    if task.model_kind != "gpt":
        raise UsageError(f"{flag} runs a GPT; a {task.model_kind} model is not one: drop it")
    if cfg.parallel.cp > 1:
        raise UsageError(f"{flag}: the model runs without context parallelism there: drop --cp or the flag")
    if cfg.data.mock_data:
        raise UsageError(f"{flag} needs the run's tokenizer, and --mock-data has none: give --data-path and "
                         f"--tokenizer")


class EvalSamples:
    """--eval-prompts: the prompts and the tokenizer, read once before training (a missing file or
    tokenizer is one line then, not at the first validation)."""

    def __init__(self, cfg, task: Task):
        from megalite.data import data_tokenizer
        from megalite.errors import UsageError
        from megalite.generation.samples import read_prompts

        _check_generation_flag("--eval-prompts", cfg, task)
        try:
            self.prompts, self.tokenizer = read_prompts(cfg.training.eval_prompts), data_tokenizer(cfg.data)
        except (OSError, ValueError) as e:
            raise UsageError(f"--eval-prompts: {e}") from None

    def log(self, step: TrainStep, iteration: int, logger) -> None:
        """Every rank: complete the prompts; the logging rank prints them and adds them to TensorBoard."""
        from megalite.generation.samples import log_samples

        with traffic.excluded():
            log_samples(step.chunks, self.prompts, self.tokenizer, iteration, logger.say, logger.tb,
                        v_shape=step.v_shape)


class EvalTasks:
    """--eval-tasks: lm-eval scores of the model being trained at each validation, every replica
    scoring every request (ZeRO-3's gathers run on all of them alike). The tokenizer, lm-eval and
    the task names are checked once before training."""

    def __init__(self, cfg, task: Task):
        from megalite.data import data_tokenizer
        from megalite.errors import UsageError

        t = cfg.training
        _check_generation_flag("--eval-tasks", cfg, task)
        try:
            from megalite.generation import lm_eval_adapter
        except ImportError as e:
            raise UsageError(f"--eval-tasks: {e}") from None
        self.adapter, self.seed = lm_eval_adapter, t.seed
        self.tasks = [name.strip() for name in t.eval_tasks.split(",") if name.strip()]
        self.path, self.limit = t.eval_tasks_path, t.eval_tasks_limit
        try:
            self.tokenizer = data_tokenizer(cfg.data)
            lm_eval_adapter.known_tasks(self.tasks, self.path)
        except (OSError, ValueError) as e:
            raise UsageError(f"--eval-tasks: {e}") from None

    def log(self, step: TrainStep, iteration: int, logger) -> None:
        """Every rank: score the tasks; the logging rank prints the metrics and logs them."""
        lm = self.adapter.MegaliteLM(step.chunks, self.tokenizer, seed=self.seed, v_shape=step.v_shape)
        with traffic.excluded(), _random_states_kept():  # lm-eval seeds the global generators
            results = self.adapter.evaluate_tasks(lm, self.tasks, self.path, self.limit, seed=self.seed)
        logger.tasks(iteration, self.adapter.scores(results))


@contextlib.contextmanager
def _random_states_kept():
    """Python's, NumPy's and torch's global generators as they were: training goes on with the
    draws it would have had without the evaluation."""
    import random

    import numpy as np

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
