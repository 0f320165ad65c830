"""The optimizer's section of a run's configuration: the optimizer (AdamW, SGD, Muon), its learning-rate
and weight-decay schedules, and QK-clip (megalite.config.sections holds the other sections)."""
from __future__ import annotations

from dataclasses import dataclass, fields

from megalite.config.fields import (NON_NEGATIVE, POSITIVE, POSITIVE_INT, PROBABILITY, FRACTION, check_numbers,
                                    flag_of, opt)

_LR_STYLES = ("cosine", "linear", "constant", "inverse-square-root", "WSD")


_MOMENT_DTYPES = ("fp32", "bf16", "fp16", "fp8")  # Megatron-LM's; fp16 and fp8 refused in check()


@dataclass
class OptimizerConfig:
    """The optimizer and its learning-rate schedule. Schedule lengths are in iterations, or in samples
    (Megatron-LM's sample-based schedules: divided by the global batch)."""
    optimizer: str = opt("adam", "the (inner) optimizer: AdamW, SGD with --sgd-momentum (same lr schedule; "
                                 "SGD adds weight decay to the gradient, as Megatron-LM's), or Muon for the hidden "
                                 "weight matrices with AdamW for the rest; dist_muon: Muon with each data-parallel "
                                 "rank updating whole layers (docs/optimizer.md)",
                         choices=("adam", "sgd", "muon", "dist_muon"))
    lr: float = opt(1e-3, "peak learning rate", check=POSITIVE)
    min_lr: float = opt(1e-4, "learning rate at the end of the decay", check=NON_NEGATIVE)
    lr_decay_style: str = opt("cosine", "shape of the decay after warm-up (WSD: constant, then "
                                        "--lr-wsd-decay-style over the last --lr-wsd-decay-iters)", choices=_LR_STYLES)
    lr_warmup_iters: int | None = opt(None, "warm-up iterations (default 10 unless a fraction or samples are "
                                            "given)", check=NON_NEGATIVE)
    lr_warmup_fraction: float | None = opt(None, "warm-up as a fraction of the decay length", check=FRACTION)
    lr_warmup_samples: int | None = opt(None, "warm-up in samples", check=NON_NEGATIVE)
    lr_warmup_init: float = opt(0.0, "the learning rate the warm-up rises from", check=NON_NEGATIVE)
    lr_decay_iters: int | None = opt(None, "iterations of decay, warm-up included (default: the run's length)",
                                     check=POSITIVE_INT)
    lr_decay_samples: int | None = opt(None, "decay length in samples", check=POSITIVE_INT)
    lr_wsd_decay_style: str = opt("exponential", "WSD: the shape of the final decay",
                                  choices=("exponential", "linear", "cosine", "minus_sqrt"))
    lr_wsd_decay_iters: int | None = opt(None, "WSD: iterations of the final decay", check=POSITIVE_INT)
    lr_wsd_decay_samples: int | None = opt(None, "WSD: the final decay in samples", check=POSITIVE_INT)
    decoupled_lr: float | None = opt(None, "a peak learning rate of its own for the word embedding and output "
                                           "layer (same schedule shape)", check=POSITIVE)
    decoupled_min_lr: float | None = opt(None, "with --decoupled-lr: its final learning rate (default --min-lr)",
                                         check=NON_NEGATIVE)
    weight_decay: float = opt(0.1, "decoupled weight decay (not on biases and norms)", check=NON_NEGATIVE)
    weight_decay_incr_style: str = opt("constant", "constant: --weight-decay throughout; linear, cosine: from "
                                                   "--start-weight-decay to --end-weight-decay over the run",
                                       choices=("constant", "linear", "cosine"))
    start_weight_decay: float | None = opt(None, "the weight decay a linear or cosine --weight-decay-incr-style "
                                                 "starts at", check=NON_NEGATIVE)
    end_weight_decay: float | None = opt(None, "the weight decay a linear or cosine --weight-decay-incr-style "
                                               "ends at", check=NON_NEGATIVE)
    adam_beta1: float = opt(0.9, "Adam's first-moment decay", check=PROBABILITY)
    adam_beta2: float = opt(0.95, "Adam's second-moment decay", check=PROBABILITY)
    adam_eps: float = opt(1e-8, "Adam's epsilon", check=POSITIVE)
    sgd_momentum: float = opt(0.9, "--optimizer sgd: the momentum factor (Megatron-LM's default; 0: plain SGD)",
                              check=PROBABILITY)
    muon_momentum: float = opt(0.9, "--optimizer muon: the momentum of Muon's matrices (Megatron-LM's default)",
                               check=PROBABILITY)
    muon_use_nesterov: bool = opt(False, "--optimizer muon: Nesterov momentum")
    muon_split_qkv: bool = opt(True, "--optimizer muon: orthogonalize a fused query/key/value weight as its q, k and "
                                     "v matrices (false: as one)", sets={"--muon-no-split-qkv": False})
    muon_scale_mode: str = opt("spectral", "--optimizer muon: the update's scale, sqrt(max(rows, cols)) (spectral), "
                                           "sqrt(rows / cols) (unit_rms_norm), sqrt(max(1, rows / cols)) "
                                           "(shape_scaling)", choices=("spectral", "unit_rms_norm", "shape_scaling"))
    muon_extra_scale_factor: float = opt(1.0, "--optimizer muon: a factor on the update's scale (0.2 matches "
                                              "AdamW's update size, Moonlight's)", check=POSITIVE)
    muon_num_ns_steps: int = opt(5, "--optimizer muon: Newton-Schulz steps (a multiple of 5, the quintic "
                                    "coefficient sets)", check=POSITIVE_INT)
    muon_fp32_matmul_prec: str = opt("medium", "--optimizer muon: the Newton-Schulz GEMMs' precision: medium (bf16), "
                                               "high (TF32 on a GPU), highest (fp32)", choices=("medium", "high", "highest"))
    muon_tp_mode: str = opt("blockwise", "--optimizer muon: a tensor-parallel matrix orthogonalized as each rank's "
                                         "shard (blockwise: the numbers depend on --tp), or whole: gathered "
                                         "(duplicated) or by all-reduced Gram matrices (distributed)",
                            choices=("blockwise", "duplicated", "distributed"))
    use_precision_aware_optimizer: bool = opt(False, "let --exp-avg-dtype / --exp-avg-sq-dtype store Adam's moments "
                                                     "in bf16 (Megatron-LM's flag; docs/optimizer.md)")
    exp_avg_dtype: str = opt("fp32", "Adam's first moment as stored (bf16: computed in fp32, stored rounded)",
                             choices=_MOMENT_DTYPES)
    exp_avg_sq_dtype: str = opt("fp32", "Adam's second moment as stored", choices=_MOMENT_DTYPES)
    main_params_dtype: str = opt("fp32", "the masters' dtype: fp32 (Megatron-LM's fp16 is refused)",
                                 choices=("fp32", "fp16"))
    main_grads_dtype: str = opt("fp32", "the main gradients' dtype: fp32 (Megatron-LM's bf16 is refused; "
                                        "--grad-reduce-dtype bf16 reduces them in bf16)", choices=("fp32", "bf16"))
    qk_clip: bool = opt(False, "QK-clip (MuonClip): after each update, shrink the query and key weights of a key "
                               "group whose largest attention logit passed --qk-clip-threshold (docs/optimizer.md)")
    qk_clip_alpha: float = opt(0.5, "--qk-clip: the query's share of the shrinking (queries x eta^alpha, keys x "
                                    "eta^(1 - alpha))", check=FRACTION)
    qk_clip_threshold: float = opt(100.0, "--qk-clip: the largest attention logit let stand", check=POSITIVE)
    log_max_attention_logit: bool = opt(False, "log the step's largest attention logit (on with --qk-clip)")
    clip_grad: float = opt(1.0, "global gradient-norm clip (0: off)", check=NON_NEGATIVE)
    use_apex_adam: bool = opt(False, "NVIDIA apex FusedAdam, if you built apex")

    def check(self) -> None:
        check_numbers(self)
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} is above --lr {self.lr}: the schedule decays from --lr to "
                             f"--min-lr")
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            raise ValueError("--decoupled-min-lr goes with --decoupled-lr (the embedding and output layer's peak)")
        floor = self.decoupled_min_lr if self.decoupled_min_lr is not None else self.min_lr
        if self.decoupled_lr is not None and floor > self.decoupled_lr:
            raise ValueError(f"--decoupled-min-lr {floor} (default --min-lr) is above --decoupled-lr "
                             f"{self.decoupled_lr}")
        warmups = [f for f in ("--lr-warmup-iters", "--lr-warmup-fraction", "--lr-warmup-samples")
                   if getattr(self, f[2:].replace("-", "_")) is not None]
        if len(warmups) > 1:
            raise ValueError(f"{' and '.join(warmups)} each give the warm-up: keep one")
        for iters, samples in (("lr_decay_iters", "lr_decay_samples"), ("lr_wsd_decay_iters", "lr_wsd_decay_samples")):
            if getattr(self, iters) is not None and getattr(self, samples) is not None:
                raise ValueError(f"--{iters.replace('_', '-')} and --{samples.replace('_', '-')} give the same "
                                 f"length: keep one")
        wsd = self.lr_wsd_decay_iters is not None or self.lr_wsd_decay_samples is not None
        if self.lr_decay_style == "WSD" and not wsd:
            raise ValueError("--lr-decay-style WSD needs the length of its final decay: add --lr-wsd-decay-iters N "
                             "(or --lr-wsd-decay-samples)")
        if wsd and self.lr_decay_style != "WSD":
            raise ValueError("--lr-wsd-decay-iters/--lr-wsd-decay-samples apply to --lr-decay-style WSD")
        self._check_muon()
        self._check_precision_aware()
        if not self.qk_clip:
            tuning = [f for f in fields(self) if f.name in ("qk_clip_alpha", "qk_clip_threshold")
                      and getattr(self, f.name) != f.default]
            if tuning:
                raise ValueError(f"{flag_of(tuning[0])} applies to --qk-clip: add it, or drop {flag_of(tuning[0])}")
        ends = (self.start_weight_decay, self.end_weight_decay)
        if self.weight_decay_incr_style == "constant" and ends != (None, None):  # as Megatron-LM's check
            raise ValueError("--start-weight-decay/--end-weight-decay go with --weight-decay-incr-style linear or "
                             "cosine; for a constant weight decay give --weight-decay")
        if self.weight_decay_incr_style != "constant" and None in ends:
            raise ValueError(f"--weight-decay-incr-style {self.weight_decay_incr_style} needs both "
                             f"--start-weight-decay and --end-weight-decay")


    def _check_precision_aware(self) -> None:
        low = [f"--{n.replace('_', '-')} {getattr(self, n)}" for n in
               ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype", "main_grads_dtype") if getattr(self, n) != "fp32"]
        if low and not self.use_precision_aware_optimizer:
            raise ValueError(f"{low[0]} needs --use-precision-aware-optimizer (Megatron-LM keeps every optimizer "
                             f"tensor in fp32 without it): add it, or drop {low[0].split()[0]}")
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            if getattr(self, name) in ("fp16", "fp8"):
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: megalite stores Adam's moments in "
                                 f"fp32 or bf16 (fp16 and fp8 need Transformer Engine's per-tensor scaled states): "
                                 f"use bf16")
        if self.main_params_dtype != "fp32":
            raise ValueError("--main-params-dtype fp16: megalite keeps fp32 master weights: drop it")
        if self.main_grads_dtype != "fp32":
            raise ValueError("--main-grads-dtype bf16: megalite accumulates main gradients in fp32 (--grad-reduce-dtype "
                             "bf16 reduces them in bf16): drop it")
        if "bf16" in (self.exp_avg_dtype, self.exp_avg_sq_dtype):
            if self.optimizer == "sgd":
                raise ValueError("--exp-avg-dtype / --exp-avg-sq-dtype bf16 are Adam's moments: --optimizer sgd has none")
            if self.use_apex_adam:
                raise ValueError("--exp-avg-dtype / --exp-avg-sq-dtype bf16 run megalite's own AdamW: drop "
                                 "--use-apex-adam")

    def _check_muon(self) -> None:
        if self.optimizer not in ("muon", "dist_muon"):
            muon = [f for f in fields(self) if f.name.startswith("muon_") and getattr(self, f.name) != f.default]
            if muon:
                raise ValueError(f"{flag_of(muon[0])} applies to --optimizer muon (this run's is "
                                 f"{self.optimizer}): add --optimizer muon, or drop it")
            return
        if self.muon_num_ns_steps % 5:
            raise ValueError(f"--muon-num-ns-steps {self.muon_num_ns_steps}: a multiple of 5 (the five quintic "
                             f"Newton-Schulz coefficient sets are applied in turn, as Megatron-Core's)")
        if self.use_apex_adam:
            raise ValueError("--use-apex-adam with --optimizer muon: Muon's AdamW part is PyTorch's fused AdamW; "
                             "drop --use-apex-adam")
