"""The sections of a run's configuration for what it writes: checkpoints (where, and what a resumed
run takes from them) and reports (log lines, metrics, TensorBoard, W&B, the timeline). Fields as in
megalite.config.sections."""
from __future__ import annotations

from dataclasses import dataclass

from megalite.config.fields import POSITIVE, POSITIVE_INT, check_numbers, opt


@dataclass
class CheckpointConfig:
    """Where checkpoints go and what a resumed run takes from them."""
    save: str | None = opt(None, "save checkpoints here", metavar="DIR")
    load: str | None = opt(None, "resume from the newest checkpoint here (at any layout)", metavar="DIR")
    save_interval: int | None = opt(None, "save every N iterations (and at the end; 0: only at the end)",
                                    check=(lambda v: v >= 0, "an integer >= 0"))
    save_async: bool = opt(False, "write checkpoints in the background", flags=("--save-async", "--async-save"))
    no_load_optim: bool = opt(False, "load weights only (fresh optimizer)")
    no_save_optim: bool = opt(False, "checkpoints without the optimizer state (smaller; a resume starts it fresh)")
    no_save_rng: bool = opt(False, "checkpoints without the RNG streams (a resume draws dropout from the seed)")
    no_load_rng: bool = opt(False, "do not restore the RNG streams (dropout draws start from the seed)")
    finetune: bool = opt(False, "with --load: take the weights only and start a new run (iteration 0, data from "
                                "the start, fresh optimizer and RNG streams)")
    ckpt_step: int | None = opt(None, "with --load DIR: the checkpoint of iteration N there, not the newest",
                                check=(lambda v: v >= 0, "an integer >= 0"), metavar="N")
    exit_on_missing_checkpoint: bool = opt(False, "with --load: stop when it holds no checkpoint, even where --load "
                                                  "is --save's directory (the restart idiom: else from scratch)")
    use_checkpoint_args: bool = opt(False, "with --load: take the model's shape from the checkpoint (also the "
                                           "default when no shape flag is given)")
    override_opt_param_scheduler: bool = opt(
        False, "with --load: train on with this command line's learning-rate schedule (and weight decay) where "
               "it differs from the checkpoint's, each change said in a line (else such a change is refused)",
        flags=("--override-opt_param-scheduler",))
    use_checkpoint_opt_param_scheduler: bool = opt(
        False, "with --load: keep the checkpoint's learning-rate schedule (and weight decay) over the schedule "
               "flags given (each one set aside said in a line)", flags=("--use-checkpoint-opt_param-scheduler",))

    def check(self) -> None:
        check_numbers(self)
        if self.finetune and not self.load:
            raise ValueError("--finetune needs --load DIR (the checkpoint whose weights to start from)")
        for flag, given in (("--ckpt-step", self.ckpt_step is not None),
                            ("--exit-on-missing-checkpoint", self.exit_on_missing_checkpoint)):
            if given and not self.load:
                raise ValueError(f"{flag} needs --load DIR (the directory of the checkpoints)")
        if self.use_checkpoint_args and not self.load:
            raise ValueError("--use-checkpoint-args needs --load DIR (the checkpoint whose shape to take)")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError("--override-opt_param-scheduler (this command line's learning-rate schedule) and "
                             "--use-checkpoint-opt_param-scheduler (the checkpoint's) disagree: keep one")
        for flag, on in (("--override-opt_param-scheduler", self.override_opt_param_scheduler),
                         ("--use-checkpoint-opt_param-scheduler", self.use_checkpoint_opt_param_scheduler)):
            if on and not self.load:
                raise ValueError(f"{flag} needs --load DIR (the checkpoint whose learning-rate schedule it settles)")


@dataclass
class LoggingConfig:
    """What a run reports, and where."""
    log_interval: int = opt(10, "a log line (and a metrics record) every N iterations", check=POSITIVE_INT)
    metrics_file: str | None = opt(None, "JSON lines, one record per logged iteration", metavar="PATH")
    sample_log: str | None = opt(None, "log every sample index consumed, per iteration and DP rank, and each "
                                       "resume, as JSON lines in this directory (audits, scripts/soak.py)",
                                 metavar="DIR")
    tensorboard_dir: str | None = opt(None, "write TensorBoard scalars here (needs megalite[tb])", metavar="DIR")
    log_params_norm: bool = opt(False, "log the global L2 norm of the (fp32 master) weights at each log line "
                                       "(params_norm; Megatron-LM's flag)")
    wandb_project: str | None = opt(None, "log TensorBoard's scalars and the configuration to this Weights & Biases "
                                          "project (needs `pip install wandb`; WANDB_MODE=offline: no network)",
                                    metavar="NAME")
    wandb_exp_name: str | None = opt(None, "the W&B run's name (default: one W&B picks)", metavar="NAME")
    wandb_save_dir: str | None = opt(None, "the W&B run's local files (default: wandb under --save, else under the "
                                           "working directory)", metavar="DIR")
    wandb_entity: str | None = opt(None, "the W&B team or user the run belongs to (default: W&B's default entity)",
                                   metavar="NAME")
    timeline: str | None = opt(None, "write a Chrome-trace timeline of all ranks (one row each)", metavar="PATH")
    timeline_iters: int = opt(3, "iterations recorded in the timeline", check=POSITIVE_INT)
    no_progress_bar: bool = opt(False, "no progress bar even on a terminal")
    peak_tflops: float | None = opt(None, "per-GPU peak for MFU (default: the datasheet dense peak of known GPUs "
                                          "for the dtype in use)", check=POSITIVE)

    def check(self) -> None:
        check_numbers(self)
