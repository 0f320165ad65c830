"""The precision section: the dtype the model trains in, fp16's loss scaling, and FP8 (Megatron-LM's
flags and defaults; docs/fp8.md)."""
from __future__ import annotations

from dataclasses import dataclass

from megalite.config.fields import NON_NEGATIVE, POSITIVE, POSITIVE_INT, check_numbers, opt
from megalite.precision.recipes import AMAX_ALGOS, FORMATS, RECIPES, Recipe, fp8_layer_numbers


@dataclass
class PrecisionConfig:
    """The dtype the model trains in, fp16's loss scaling, and the GEMMs in FP8."""
    bf16: bool = opt(False, "bf16 model, fp32 master weights")
    fp16: bool = opt(False, "fp16 model, fp32 master weights, loss scaling")
    loss_scale: float | None = opt(None, "fp16: a fixed loss scale (default: dynamic)", check=POSITIVE)
    initial_loss_scale: float = opt(2.0 ** 16, "fp16: the dynamic scale's start", check=POSITIVE)
    loss_scale_window: int = opt(1000, "clean steps before the scale grows", check=POSITIVE_INT)
    hysteresis: int = opt(2, "overflowing steps before the scale shrinks", check=POSITIVE_INT)
    min_loss_scale: float = opt(1.0, "fp16: the dynamic scale's floor", check=POSITIVE)
    no_tf32: bool = opt(False, "fp32 runs: full-FP32 matmuls instead of TF32 tensor cores (MFU then against the "
                               "FP32 peak)")
    disable_bf16_reduced_precision_matmul: bool = opt(
        False, "bf16 GEMMs: every partial sum in fp32 (PyTorch's allow_bf16_reduced_precision_reduction off; CUDA)")
    fp8_format: str | None = opt(None, "the transformer layers' linear GEMMs in FP8: e4m3 everywhere, or hybrid "
                                       "(E4M3 forward, E5M2 gradients); docs/fp8.md", choices=FORMATS)
    fp8_recipe: str = opt("delayed", "FP8 scales: tensorwise (this tensor's amax), delayed (earlier steps' "
                                     "amaxes), blockwise (1x128 activations, 128x128 weights) or mxfp8 (E8M0 per "
                                     "32 elements)", choices=RECIPES)
    fp8_margin: int = opt(0, "delayed scaling: scales divided by 2^margin", check=NON_NEGATIVE)
    fp8_amax_history_len: int = opt(1, "delayed scaling: steps of amax history per tensor", check=POSITIVE_INT)
    fp8_amax_compute_algo: str = opt("most_recent", "delayed scaling: the amax a scale comes from: the newest, "
                                                    "or the history's max", choices=AMAX_ALGOS)
    fp8_wgrad: bool = opt(True, "FP8 weight-gradient GEMMs (--no-fp8-wgrad: in the model's dtype)",
                          sets={"--no-fp8-wgrad": False})
    fp8_param_gather: bool = opt(False, "ZeRO-3 gathers FP8 weights as FP8 (1 byte an element; delayed scaling; "
                                        "the same numbers; a note and no effect below --zero-stage 3)")
    first_last_layers_bf16: bool = opt(False, "FP8: keep the first and last transformer layers in the model's "
                                              "dtype (how many: the next two flags)")
    num_layers_at_start_in_bf16: int = opt(1, "with --first-last-layers-bf16: layers kept at the start",
                                           check=NON_NEGATIVE)
    num_layers_at_end_in_bf16: int = opt(1, "with --first-last-layers-bf16: layers kept at the end",
                                         check=NON_NEGATIVE)

    def check(self) -> None:
        check_numbers(self)
        if self.bf16 and self.fp16:
            raise ValueError("--bf16 and --fp16 exclude each other: keep one")
        if self.loss_scale is not None and not self.fp16:
            raise ValueError("--loss-scale applies to --fp16 only")
        if self.fp16 and self.loss_scale is None and self.min_loss_scale > self.initial_loss_scale:
            raise ValueError(f"--min-loss-scale {self.min_loss_scale} is above --initial-loss-scale "
                             f"{self.initial_loss_scale}")
        if self.fp8_format is None:
            given = [flag for flag, changed in (
                ("--fp8-recipe", self.fp8_recipe != "delayed"), ("--fp8-margin", self.fp8_margin != 0),
                ("--fp8-amax-history-len", self.fp8_amax_history_len != 1),
                ("--fp8-amax-compute-algo", self.fp8_amax_compute_algo != "most_recent"),
                ("--no-fp8-wgrad", not self.fp8_wgrad), ("--first-last-layers-bf16", self.first_last_layers_bf16),
                ("--fp8-param-gather", self.fp8_param_gather))
                if changed]
            if given:
                raise ValueError(f"{given[0]} applies to FP8 training only: add --fp8-format e4m3 (or hybrid), "
                                 f"or drop it")
        if not self.first_last_layers_bf16 and (self.num_layers_at_start_in_bf16, self.num_layers_at_end_in_bf16) != (1, 1):
            raise ValueError("--num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16 apply with "
                             "--first-last-layers-bf16: add it, or drop them")
        if self.fp8_format is not None and self.fp8_param_gather and self.fp8_recipe != "delayed":
            raise ValueError(f"--fp8-param-gather quantizes each shard with delayed scaling's scale, known before "
                             f"the gather; --fp8-recipe {self.fp8_recipe} needs the whole weight first: use "
                             f"--fp8-recipe delayed, or drop --fp8-param-gather")

    def fp8(self) -> Recipe | None:
        """The FP8 recipe these settings describe, or None (no FP8)."""
        if self.fp8_format is None:
            return None
        return Recipe(self.fp8_recipe, self.fp8_format, self.fp8_amax_history_len, self.fp8_amax_compute_algo,
                      self.fp8_margin, self.fp8_wgrad)

    def fp8_layers(self, num_layers: int) -> range:
        """The transformer layers that run in FP8 (none without --fp8-format); a ValueError when
        --first-last-layers-bf16 leaves none."""
        if self.fp8_format is None:
            return range(0)
        return fp8_layer_numbers(num_layers, self.first_last_layers_bf16, self.num_layers_at_start_in_bf16,
                                 self.num_layers_at_end_in_bf16)
