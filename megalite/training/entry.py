"""What `pretrain_gpt.py` and `pretrain_bert.py` run: the command line parsed into a RunConfig, then
either the configuration printed (--print-config) or the run trained."""
from __future__ import annotations

import contextlib
import os
import sys

from megalite.config import RunConfig, build_parser, expanded, model_config, to_toml, validate
from megalite.errors import UsageError
from megalite.runtime import env_world, run_main, say
from megalite.training.checkpoint_shape import adopt_checkpoint_shape
from megalite.training import upcycling
from megalite.training.loop import pretrain
from megalite.training.resume import chosen_step
from megalite.training.task import Task, check_task_flags


def print_config(cfg: RunConfig, task: Task) -> None:
    """The resolved configuration as a file --config reads, after the checks a run makes for the world
    size torchrun gives (WORLD_SIZE, else 1); no process group is started and no data is read. Notes go
    to stderr, so stdout is the file alone."""
    world = os.environ.get("WORLD_SIZE", str(env_world()[1]))
    if not world.isdigit() or int(world) < 1:
        raise UsageError(f"WORLD_SIZE={world}: --print-config checks the configuration for that many ranks; give "
                         f"a whole number >= 1")
    world = int(world)
    check_task_flags(cfg, task)
    with contextlib.redirect_stdout(sys.stderr):
        cfg = upcycling.requeued(chosen_step(cfg))  # the checkpoint the run would load (--ckpt-step, a requeue)
        cfg = adopt_checkpoint_shape(cfg)  # what the run would train: --load without shape flags
        dp = validate(cfg, world, model_config(cfg), machine=False)
    if env_world()[0] == 0:
        header = (f"megalite {task.model_kind} run, checked for {world} ranks (data-parallel size {dp}); what the "
                  f"machine must run (kernels, apex, tensorboard) is checked when it starts.\n"
                  f"Train with it: pretrain_{task.model_kind}.py --config FILE (flags override the file).")
        print(to_toml(expanded(cfg), header), end="", flush=True)


def main(argv, task: Task, description: str, default_model: str) -> int:
    cfg, given = build_parser(description, default_model).parse(argv)
    printing = getattr(given, "print_config", False)
    if cfg.ignored_flags:
        with contextlib.redirect_stdout(sys.stderr if printing else sys.stdout):
            say(f"megalite: note: Megatron-LM flags accepted without effect here (docs/configuration.md says why): "
                f"{', '.join(cfg.ignored_flags)}")
    return run_main(print_config if printing else pretrain, cfg, task)
