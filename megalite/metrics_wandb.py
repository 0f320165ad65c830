"""Weights & Biases (Megatron-LM's --wandb-project, --wandb-exp-name, --wandb-save-dir, --wandb-entity):
the scalars TensorBoard gets, at the same iterations and under the same tags, and the run's resolved
configuration. `metrics.TrainingLogger` writes both from one dict, so they cannot drift.

One rank logs: the one that writes TensorBoard and the metrics file, global rank 0 (the log window
brings the loss there from the last pipeline stage; Megatron-LM logs from the last rank instead).
wandb is imported only when --wandb-project is given. Its environment is its own: WANDB_MODE=offline
writes the run to disk without a network (`wandb sync` uploads it later), WANDB_API_KEY and the rest
as wandb documents them."""
from __future__ import annotations

import atexit
import importlib.util
import os
import sys
from dataclasses import dataclass

from megalite.errors import UsageError

INSTALL_LINE = "--wandb-project needs the wandb package: pip install wandb"
# Runs training has not closed: one whose training raised (a usage error, a crash) is finished as failed
# when the process exits, or when the next run starts in this process. wandb's own exit hook cannot
# tell: `sys.exit(main())` looks sys.exit up before wandb.init replaces it, so it would say "finished".
_OPEN: list["WandbRun"] = []


@dataclass(frozen=True)
class WandbOptions:
    project: str
    name: str | None  # None: W&B picks one
    entity: str | None  # None: the account's default
    directory: str | None  # wandb.init's `dir`: the run's files go to <directory>/wandb/; None: the working directory

    @classmethod
    def of(cls, logging, save: str | None) -> "WandbOptions | None":
        """The logging section's W&B settings; None without --wandb-project (an empty one too, as in
        Megatron-LM). The files go where Megatron-LM puts them: --wandb-save-dir, else <--save>/wandb."""
        if not logging.wandb_project:
            return None
        directory = logging.wandb_save_dir or (os.path.join(save, "wandb") if save else None)
        return cls(logging.wandb_project, logging.wandb_exp_name or None, logging.wandb_entity or None, directory)


def require_wandb() -> None:
    """A one-line usage error where wandb is not installed (checked without importing it)."""
    if importlib.util.find_spec("wandb") is None:
        raise UsageError(INSTALL_LINE)


class WandbRun:
    """One W&B run: scalars by iteration, the configuration once, finished once. A run that cannot start
    is a usage error; one that fails later (its service process killed with the job, a full disk) is
    said in one line and dropped: logging never stops training, nor turns a clean exit into a failure."""

    def __init__(self, options: WandbOptions):
        try:
            import wandb
        except ImportError:
            raise UsageError(INSTALL_LINE) from None
        self._wandb = wandb
        if options.directory:
            os.makedirs(options.directory, exist_ok=True)
        # A run of its own: never one the caller has open (wandb's default outside notebooks returns that);
        # one an earlier training in this process left open (it raised) is finished as failed first.
        settings = wandb.Settings(reinit="create_new", silent=bool(os.environ.get("MEGALITE_QUIET")))
        _finish_left_open()
        try:
            self.run = wandb.init(project=options.project, name=options.name, entity=options.entity,
                                  dir=options.directory, settings=settings)
        except Exception as e:  # noqa: BLE001 - wandb's own errors (no API key, no network) are many
            raise UsageError(f"--wandb-project {options.project}: W&B could not start the run ({_first_line(e)}); "
                             f"WANDB_MODE=offline logs without network (`wandb sync` uploads later)") from None
        _OPEN.append(self)
        atexit.unregister(_finish_left_open)  # (again) after wandb's own exit hook, so that it runs first
        atexit.register(_finish_left_open)

    def config(self, values: dict) -> None:
        self._call("the configuration", lambda run: run.config.update(values, allow_val_change=True))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._call(f"iteration {step}", lambda run: run.log(scalars, step=step))

    def finish(self, exit_code: int = 0) -> None:
        """Flush and close the run (its state: finished, or failed for a non-zero exit code)."""
        self._call("finishing the run", lambda run: run.finish(exit_code=exit_code))
        self.run = None
        if self in _OPEN:
            _OPEN.remove(self)

    def _call(self, what: str, fn) -> None:
        if self.run is None:
            return
        try:
            fn(self.run)
        except Exception as e:  # noqa: BLE001 - whatever W&B raises, training goes on
            self.run = None
            print(f"megalite: warning: W&B logging stopped at {what}: {_first_line(e)}", file=sys.stderr, flush=True)
            try:  # its service is gone: tear the connection down now, not in a noisy atexit hook
                self._wandb.teardown()
            except Exception:  # noqa: BLE001
                pass


def _finish_left_open() -> None:
    while _OPEN:
        _OPEN[-1].finish(exit_code=1)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
