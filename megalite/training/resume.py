"""Where a run starts: the weights of `--load` (before the optimizer exists: its masters copy them),
then the iteration, data position, optimizer state and RNG streams of a resumed run."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from megalite import checkpoint
from megalite.checkpoint.layout import ITER_NAME
from megalite.checkpoint.rank_state import layout_changed
from megalite.optim.local_sgd import load_replica_state
from megalite.runtime import UsageError, say
from megalite.training import upcycling


@dataclass(frozen=True)
class StartPoint:
    iteration: int = 0
    consumed_samples: int = 0
    run: str | None = None  # the run that saved the checkpoint resumed from
    announcement: list[str] = field(default_factory=list)  # said by say_resumed, once all is loaded
    # (iteration, samples) where the learning-rate schedule started: (0, 0) but after upcycling
    schedule_start: tuple[int, int] = (0, 0)
    upcycled: bool = False  # --moe-use-upcycling: this run starts the experts from a dense checkpoint
    upcycled_from: str | None = None  # the dense checkpoint's directory, for this run and its resumes

    def lineage(self) -> dict:
        """What every checkpoint of the run carries on (after upcycling: the schedule's start, the source)."""
        if self.upcycled_from is None:
            return {}
        return {"schedule_start": list(self.schedule_start), "upcycled_from": self.upcycled_from}


def _same_directory(a: str, b: str | None) -> bool:
    return b is not None and os.path.abspath(a) == os.path.abspath(b)


def chosen_step(cfg):
    """--ckpt-step N: `--load DIR` read as DIR/iter_000000N (megalite's or Megatron-LM's), the choice
    checked before anything reads it."""
    c = cfg.checkpoint
    if c.ckpt_step is None:
        return cfg
    path = Path(c.load)
    if ITER_NAME.match(path.name):
        raise UsageError(f"--ckpt-step {c.ckpt_step} picks an iteration in --load's directory, and --load {c.load} "
                         f"is one already: give the directory above it, or drop --ckpt-step")
    chosen = path / f"iter_{c.ckpt_step:07d}"
    if not chosen.is_dir():
        held = sorted(int(p.name[5:]) for p in path.glob("iter_*") if ITER_NAME.match(p.name) and p.is_dir())
        raise UsageError(f"--ckpt-step {c.ckpt_step}: {c.load} holds no checkpoint of iteration {c.ckpt_step} "
                         + (f"(it holds iterations {', '.join(map(str, held))}): give one of them" if held else
                            "(it holds none): check --load"))
    return cfg.replace("checkpoint", load=str(chosen))


def load_checkpoint(cfg, task, config, chunks):
    """Weights before the optimizer exists (its masters copy them); returns (the reader or None, the
    configuration: a requeued fine-tuning job resumes its own checkpoints instead).
    `--load` names a --save directory (its newest checkpoint) or one `iter_NNNNNNN` in it. Only
    the restart idiom (`--load` equal to `--save`) may find nothing there and start from scratch."""
    if not cfg.checkpoint.load:
        return None, cfg
    c = cfg.checkpoint
    if (c.finetune and not cfg.moe.moe_use_upcycling and c.save and not _same_directory(c.load, c.save)
            and checkpoint.CheckpointReader.exists(c.save)):
        # A requeued fine-tuning job: its own checkpoints are newer than the weights it started from.
        say(f"megalite: --save {cfg.checkpoint.save} already holds this fine-tuning run's checkpoints: resuming them "
            f"instead of starting again from --load {cfg.checkpoint.load}")
        cfg = cfg.replace("checkpoint", load=cfg.checkpoint.save, finetune=False)
    if not checkpoint.checkpoint_exists(cfg.checkpoint.load):  # megalite's, or Megatron-LM's torch_dist
        path = Path(cfg.checkpoint.load)
        if path.is_file():
            raise UsageError(f"--load {cfg.checkpoint.load} is a file: give the directory that --save wrote "
                             f"(or one of its iter_NNNNNNN directories)")
        if cfg.checkpoint.exit_on_missing_checkpoint:
            raise UsageError(f"--exit-on-missing-checkpoint: --load {cfg.checkpoint.load} holds no checkpoint (no "
                             f"'latest' file, no metadata.json): check the path, or drop the flag to start from "
                             f"scratch where --load is --save's directory")
        if _same_directory(cfg.checkpoint.load, cfg.checkpoint.save):
            say(f"megalite: no checkpoint in {cfg.checkpoint.load} yet: starting from scratch")
            return None, cfg
        if not path.exists():
            raise UsageError(f"--load {cfg.checkpoint.load} does not exist: check the path; to start from scratch drop "
                             f"--load, or give it the same directory as --save (the restart idiom)")
        raise UsageError(f"--load {cfg.checkpoint.load} holds no checkpoint (no 'latest' file, no metadata.json): "
                         f"give a directory written by --save or by `python -m megalite.tools.convert_hf import`")
    reader = checkpoint.open_checkpoint(cfg.checkpoint.load)
    if cfg.moe.moe_use_upcycling:
        upcycling.load(reader, cfg, task, config, chunks)
        return reader, cfg
    checkpoint.check_compatible(reader, config, task.model_kind)
    checkpoint.load_model_weights(reader.path, chunks, reader)
    return reader, cfg


def resume_point(cfg, reader, config=None) -> StartPoint:
    """Where the checkpoint stopped, or the start with --finetune (a new run from loaded weights), or
    after upcycling (`config`: the model's). A checkpoint past --train-iters is refused."""
    if reader is not None and cfg.moe.moe_use_upcycling:
        consumed, line = upcycling.start(cfg, reader, config)
        return StartPoint(upcycling.UPCYCLED_ITERATION, consumed, None, [line], (upcycling.UPCYCLED_ITERATION, consumed),
                          upcycled=True, upcycled_from=os.path.realpath(cfg.checkpoint.load))
    if reader is None or cfg.checkpoint.finetune:
        return StartPoint()
    iteration, consumed = reader.metadata["iteration"], reader.metadata["consumed_samples"]
    if iteration > cfg.training.train_iters and not cfg.training.skip_train:
        raise UsageError(f"the checkpoint {reader.path} is at iteration {iteration}, past --train-iters "
                         f"{cfg.training.train_iters}: raise --train-iters to continue it, or add --finetune to train "
                         f"{cfg.training.train_iters} new iterations from its weights")
    return StartPoint(iteration, consumed, reader.metadata.get("run"),
                      schedule_start=tuple(reader.metadata.get("schedule_start", (0, 0))),
                      upcycled_from=reader.metadata.get("upcycled_from"))


def resume(cfg, reader, chunks, optimizer, layout: dict, config=None) -> StartPoint:
    """After the optimizer exists: the start point, with the optimizer state and RNG streams of a
    resumed run restored, and the line saying what was restored (for `say_resumed`, after the rest
    of the state, local SGD's, is loaded too)."""
    start = resume_point(cfg, reader, config)
    if reader is None or start.upcycled:
        return start
    if cfg.checkpoint.finetune:
        say(f"megalite: fine-tuning from the weights of {reader.path} (iteration {reader.metadata['iteration']}): "
            f"iteration, data position, optimizer state and RNG streams start anew")
        return start
    optim = "fresh"
    if isinstance(reader, checkpoint.MegatronCheckpoint):  # its weights, args and iteration only
        loaded_optim, rng = False, "from the seed"
        start.announcement.append(reader.load_note())
    else:
        loaded_optim = not cfg.checkpoint.no_load_optim and checkpoint.load_optimizer_state(reader, chunks, optimizer)
        if not loaded_optim and not cfg.checkpoint.no_load_optim:
            optim = "fresh (the checkpoint holds none)"
        same_rng = not cfg.checkpoint.no_load_rng and checkpoint.restore_rng(reader, layout)
        rng = ("restored" if same_rng else "from the seed (--no-load-rng)" if cfg.checkpoint.no_load_rng
               else "from the seed (layout changed)" if layout_changed(reader, layout)
               else "from the seed (the checkpoint holds none)")
    start.announcement.append(
        f"megalite: resumed from {reader.path} (iteration {start.iteration}, {start.consumed_samples} samples "
        f"consumed; optimizer state {'loaded' if loaded_optim else optim}; RNG streams {rng})")
    if start.iteration == cfg.training.train_iters and not cfg.training.skip_train:
        start.announcement.append(
            f"megalite: the checkpoint is already at --train-iters {cfg.training.train_iters}: nothing to train "
            f"(raise --train-iters to continue, or add --finetune to start a new run from these weights)")
    return start


def say_resumed(start: StartPoint) -> None:
    """Once every rank loaded all it resumes (its files' checks passed): "resumed" is never said
    before another rank's error (a damaged local SGD replica file is read last)."""
    if not start.announcement:
        return
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    for line in start.announcement:
        say(line)


_LAYOUT_KEYS = ("tp", "cp", "pp", "dp", "vpp", "placement", "world")


def resume_local_sgd(cfg, reader, local_sgd, optimizer, layout: dict) -> None:
    """Local SGD: every rank's own state (inner masters and optimizer, outer parameters and momentum,
    the step within the round, an async round's averaged pseudo-gradient) from its rank file. It
    resumes at the same layout only; a checkpoint without it (a plain run's) starts the outer loop
    from the loaded weights."""
    if reader is None or cfg.checkpoint.finetune or cfg.checkpoint.no_load_optim or cfg.moe.moe_use_upcycling:
        return
    saved_run = reader.metadata.get("local_sgd")
    if local_sgd is None:
        if saved_run is not None:
            say(f"megalite: note: {reader.path} is a local-SGD checkpoint and this run has no --local-sgd-interval: "
                f"it goes on from replica 0's weights and optimizer state, dropping the outer parameters and "
                f"momentum{', the pending averaged pseudo-gradient' if saved_run.get('async') else ''} and the "
                f"other replicas' own weights and optimizer states")
        return
    saved = reader.metadata.get("layout", {})
    if saved_run is None:
        say(f"megalite: {reader.path} holds no local-SGD state: the outer loop starts from its weights")
        return
    changed = [k for k in _LAYOUT_KEYS if saved.get(k, 1 if k == "cp" else None) != layout.get(k, 1 if k == "cp" else None)]
    if changed:
        raise UsageError(f"{reader.path} is a local-SGD checkpoint of layout "
                         f"{ {k: saved.get(k) for k in _LAYOUT_KEYS} }: its replicas' own states resume at that "
                         f"layout only (this run: { {k: layout.get(k) for k in _LAYOUT_KEYS} }); resume at the "
                         f"saved layout, or add --no-load-optim to restart the outer loop from replica 0's weights")
    state = reader.replica(dist.get_rank())
    try:
        load_replica_state(state, local_sgd, optimizer)
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{reader.path}: its local-SGD state does not fit this run ({e}); keep "
                         f"--local-sgd-fragments as saved, or add --no-load-optim") from None
    pending = [f.index for f in local_sgd.fragments if f.ready is not None]
    if pending and not local_sgd.asynchronous:  # a synchronous run never applies a late average
        for f in local_sgd.fragments:
            f.ready = None
        say(f"megalite: note: {reader.path} was saved with --local-sgd-async: its pending averaged pseudo-gradient "
            f"of fragment(s) {pending} is dropped (this run averages each round at once)")
    if saved_run.get("interval") != local_sgd.interval:
        say(f"megalite: note: {reader.path} ran outer rounds of {saved_run.get('interval')} inner steps, this run "
            f"{local_sgd.interval}: the outer state carries over and rounds end every {local_sgd.interval} inner "
            f"steps from here")
    say(f"megalite: local SGD resumed at inner step {local_sgd.steps} (outer state, replicas' own weights and "
        f"optimizer state restored)")
