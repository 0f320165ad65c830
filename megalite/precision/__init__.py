"""FP8's numbers: formats and recipes as data (`recipes`), quantization as each recipe says
(`quantize`), the scaled GEMM (`gemm`), delayed scaling's state (`scaling`). Plain tensor math: the
parallel layers (megalite.parallel.fp8_linear) and the models (megalite.models.fp8) use it."""
from megalite.precision.gemm import scaled_mm
from megalite.precision.quantize import Quantized, quantize
from megalite.precision.recipes import FORMATS, RECIPES, Recipe
from megalite.precision.scaling import DelayedScaling

__all__ = ["FORMATS", "RECIPES", "DelayedScaling", "Quantized", "Recipe", "quantize", "scaled_mm"]
