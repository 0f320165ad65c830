"""The training loop and its pieces, one job a module: `task` (what an entry point plugs in),
`build` (layout, model chunks, buffers, optimizer), `batches` (micro-batches and their sums),
`step` (one optimizer step as one object), `resume`, `evaluate`, `progress` (log lines, skipped
steps, timeline), `saving` (checkpoint and exit decisions) and `loop` (`pretrain`)."""
from megalite.training.batches import global_normalizer, loss_terms, micro_batches, to_device
from megalite.training.build import build_model_chunks, build_optimizer, set_tf32, setup, tied_embedding_group
from megalite.training.datasets import prepare_data, train_valid_datasets
from megalite.training.evaluate import evaluate
from megalite.training.loop import TrainingRun, pretrain
from megalite.training.step import SkippedSteps, StepResult, TrainStep
from megalite.training.task import Task, gpt_forward_step

__all__ = [
    "SkippedSteps", "StepResult", "Task", "TrainStep", "TrainingRun", "build_model_chunks", "build_optimizer",
    "evaluate", "global_normalizer", "gpt_forward_step", "loss_terms", "micro_batches", "prepare_data", "pretrain",
    "set_tf32", "setup", "tied_embedding_group", "to_device", "train_valid_datasets",
]
