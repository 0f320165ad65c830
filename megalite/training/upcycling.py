"""`--moe-use-upcycling` as Megatron-LM runs it: the experts start from `--load`'s dense checkpoint
(`megalite.checkpoint.upcycle`), the upcycled model is saved to `--save` before training, and the
run trains iterations 1.. --train-iters with a fresh optimizer and learning-rate schedule, from the
dense run's data position (sample 0 with --finetune). Megatron-LM labels that first checkpoint
iteration 1 but trains from iteration 0 (a resume of it there starts a step late);
megalite labels it iteration 0, so that a resume of it is this run. The samples where the schedule
started travel in every later checkpoint (a batch ramp counts from them), with the dense checkpoint's
directory. Upcycling runs once: a requeued job finds its own checkpoints in --save and resumes them."""
from __future__ import annotations

import os

from megalite import checkpoint
from megalite.checkpoint.layout import SHAPE_FIELDS
from megalite.checkpoint.reader import LLAMA_SHAPE_FIELDS
from megalite.checkpoint.upcycle import load_upcycled_weights, weight_scale
from megalite.config.batch_schedule import batch_schedule
from megalite.runtime import UsageError, say

UPCYCLED_ITERATION = 0  # the upcycled model, before any step (Megatron-LM trains from iteration 0 too)


def _same(a: str, b: str | None) -> bool:
    return b is not None and os.path.realpath(a) == os.path.realpath(b)


def requeued(cfg):
    """Before anything reads --load: a --save that already holds this upcycling's checkpoints (a requeued
    job: every checkpoint of the run names the dense checkpoint it came from) is resumed
    instead; any other checkpoint there is refused, so none is overwritten or taken for this run's."""
    c = cfg.checkpoint
    if not cfg.moe.moe_use_upcycling:
        return cfg
    if not c.load:
        raise UsageError("--moe-use-upcycling needs --load DIR: the dense checkpoint the experts start from")
    if not c.save or not checkpoint.checkpoint_exists(c.save):
        return cfg
    if _same(c.load, c.save):
        raise UsageError(f"--moe-use-upcycling: --save {c.save} is --load's directory, which holds the dense model's "
                         f"checkpoints: give the upcycled model a --save directory of its own")
    saved = checkpoint.open_checkpoint(c.save)
    if not _same(c.load, saved.metadata.get("upcycled_from")):
        raise UsageError(f"--moe-use-upcycling: --save {c.save} already holds a checkpoint that is not this "
                         f"upcycling of --load {c.load}: give an empty --save directory for the upcycled model")
    say(f"megalite: --save {c.save} already holds the upcycled run's checkpoints (iteration "
        f"{saved.metadata['iteration']}): resuming them instead of upcycling --load {c.load} again")
    return cfg.replace("checkpoint", load=c.save, finetune=False).replace("moe", moe_use_upcycling=False)


def load(reader, cfg, task, config, chunks) -> None:
    """The upcycled weights into this rank's chunks (before the optimizer copies them)."""
    if reader.model_kind != task.model_kind:
        raise UsageError(f"checkpoint {reader.path} holds a {reader.model_kind} model, not a {task.model_kind} model")
    dense = reader.config
    diffs = [f"{k} {getattr(dense, k)} (checkpoint) vs {getattr(config, k)} (now)"
             for k in SHAPE_FIELDS + LLAMA_SHAPE_FIELDS if k != "ffn_hidden_size" and getattr(dense, k) != getattr(config, k)]
    if diffs:
        raise UsageError(f"--moe-use-upcycling: the checkpoint {reader.path} holds a model of another shape: "
                         f"{'; '.join(diffs)}; give the dense model's flags (only the experts' differ)")
    load_upcycled_weights(reader, chunks, config, cfg.moe.moe_upcycling_granularity)


def start(cfg, reader, config) -> tuple[int, str]:
    """The samples consumed where the run starts (iteration 0): the dense run's data position (0 with
    --finetune), where the schedule starts too; and the line that says so."""
    consumed = 0 if cfg.checkpoint.finetune else int(reader.metadata.get("consumed_samples", 0))
    g = cfg.moe.moe_upcycling_granularity
    line = (f"megalite: upcycled {reader.path} (iteration {reader.metadata['iteration']}) into {config.num_moe_experts} "
            f"experts of width {config.moe_ffn_hidden_size} (granularity {g}, weights x {weight_scale(config, g):.4g}): "
            f"iterations 1..{cfg.training.train_iters} with a fresh optimizer and learning-rate schedule, data from "
            f"sample {consumed}" + (" (--finetune)" if cfg.checkpoint.finetune else " (the dense run's position)"))
    return consumed, line


def train_samples(cfg, samples: int) -> int:
    """The training data's size: where the run's steps end when its schedule started after upcycling
    (the flag on: from the dense run's data position; or a checkpoint of such a run, which carries the
    schedule's start), so that every resume of it builds the same data, big enough."""
    c = cfg.checkpoint
    if c.finetune or not c.load or not checkpoint.checkpoint_exists(c.load):
        return samples
    if not cfg.moe.moe_use_upcycling and not checkpoint.CheckpointReader.exists(c.load):
        return samples  # (Megatron-LM's checkpoints carry no schedule start: not read again for it)
    metadata = checkpoint.open_checkpoint(c.load).metadata
    if cfg.moe.moe_use_upcycling:
        iteration, consumed = UPCYCLED_ITERATION, int(metadata.get("consumed_samples", 0))
    elif "schedule_start" in metadata:
        iteration, consumed = metadata["schedule_start"]
    else:
        return samples
    schedule = batch_schedule(cfg.training, cfg.model.seq_length)  # batches by the samples consumed
    return max(samples, schedule.samples_for_steps(max(cfg.training.train_iters - iteration, 0), start=consumed))
