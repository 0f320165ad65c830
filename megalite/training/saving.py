"""After each iteration, one decision: save a checkpoint now? stop now? (signals, time limits, a
failed background save, the last iteration), agreed by every rank without a device sync."""
from __future__ import annotations

from functools import partial

import torch

from megalite import checkpoint
from megalite.exits import ExitWatch
from megalite.optim.local_sgd import replica_state
from megalite.runtime import UsageError, say, set_phase


class CheckpointAndExit:
    def __init__(self, cfg, config, model_kind: str, layout: dict, local_sgd=None, run: str | None = None,
                 loss: str = "per_token", lineage: dict | None = None):
        self.cfg, self.config, self.model_kind, self.layout = cfg, config, model_kind, layout
        self.loss = loss  # the loss's form (datasets.loss_form), recorded so a resume can compare it
        self.run = run  # recorded in each checkpoint: which start of the job saved it
        self.lineage = lineage or {}  # carried by every checkpoint: after upcycling, the schedule's start
        self.local_sgd = local_sgd  # its replicas differ: every rank also saves its own state
        c = cfg.checkpoint
        if c.save and c.no_save_optim and local_sgd is not None:
            raise UsageError("--no-save-optim with --local-sgd-interval: a local-SGD checkpoint is its replicas' "
                             "weights and optimizer states; drop --no-save-optim")
        self.saver = checkpoint.Checkpointer(c.save, c.save_async, with_optim=not c.no_save_optim,
                                             with_rng=not c.no_save_rng) if c.save else None
        self.exits = ExitWatch(cfg, checkpoint_error=self.saver.poll if self.saver is not None else lambda: None,
                               watch_checkpoints=self.saver is not None and cfg.checkpoint.save_async)

    def prepare(self, chunks, optimizer) -> None:
        """With --save-async, allocate the saves' host buffer now, in the background, so that no save
        has to (every rank, right after the model and optimizer are built)."""
        if self.saver is not None and self.cfg.checkpoint.save_async:
            replica = partial(_replica_after_a_round, self.local_sgd) if self.local_sgd is not None else None
            self.saver.prepare(chunks, optimizer, replica)

    def after_iteration(self, iteration: int, consumed: int, chunks, optimizer, log) -> str | None:
        """Iteration `iteration` (1-based) is done: save if it is due (interval, last iteration, or a
        stop), and return why to stop now (None: go on). `log` prints on the logging rank."""
        cfg = self.cfg
        stop_reason = self.exits.reason(iteration)
        due = stop_reason or iteration == cfg.training.train_iters or (
            cfg.checkpoint.save_interval and iteration % cfg.checkpoint.save_interval == 0)
        if self.saver is not None and due:
            self._save(iteration, consumed, chunks, optimizer)
        if stop_reason:
            log(f"megalite: stopping after iteration {iteration} ({stop_reason})"
                + (", checkpoint saved" if self.saver is not None else ""))
        return stop_reason

    def _save(self, iteration: int, consumed: int, chunks, optimizer) -> None:
        set_phase(f"saving the checkpoint of iteration {iteration}")
        meta = checkpoint.build_metadata(self.config, self.model_kind, iteration, consumed, self.layout)
        meta["run_config"] = self.cfg.to_dict()  # the whole configuration travels with the weights
        meta["loss"] = self.loss
        if self.run is not None:
            meta["run"] = self.run
        meta.update(self.lineage)
        replica = None
        if self.local_sgd is not None:
            s = self.cfg.local_sgd
            meta["local_sgd"] = {"interval": s.local_sgd_interval, "fragments": s.local_sgd_fragments,
                                 "async": s.local_sgd_async, "inner_steps": self.local_sgd.steps}
            replica = replica_state(self.local_sgd, optimizer)
        self.saver.save(chunks, optimizer, iteration, meta, replica)
        say(f"megalite: checkpoint iteration {iteration} writing in the background to {self.cfg.checkpoint.save} "
            f"(committed when every rank has written)" if self.cfg.checkpoint.save_async else
            f"megalite: saved checkpoint iteration {iteration} to {self.cfg.checkpoint.save}")

    def save_now(self, iteration: int, consumed: int, chunks, optimizer) -> None:
        """A checkpoint outside the intervals (the upcycled model, before it trains), if --save is given."""
        if self.saver is not None:
            self._save(iteration, consumed, chunks, optimizer)

    def abandon(self) -> None:
        """Every rank stops here together (an error they all see): commit a pending async save, and
        leave the exit flags' group with nothing in flight (the next run in this process takes the
        same group again: megalite.parallel.state.built_group)."""
        self.exits.close()
        if self.saver is not None:
            self.saver.finalize()

    def close(self) -> None:
        self.exits.close()
        if self.saver is not None:
            set_phase("finishing the last checkpoint")
            self.saver.close()  # waits for a background commit, then gives the directory up


def _replica_after_a_round(local_sgd, optimizer) -> dict:
    """`replica_state` as a save holds it once outer rounds run: with --local-sgd-async, every
    fragment's average waiting to be applied (fp32; a stand-in of its size)."""
    state = replica_state(local_sgd, optimizer)
    if local_sgd.asynchronous:
        pending = [torch.empty(f.hi - f.lo, device="meta") for f in local_sgd.fragments]
        state["local_sgd"] = {**state["local_sgd"], "pending": pending}
    return state
