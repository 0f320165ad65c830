"""FP8 recipes proven on the CPU: each quantization against the recipe's formula written out in
float64, each scaled GEMM against a float64 product of the same FP8 operands, delayed scaling's
history and scale rule, bad input that never hides, and a linear layer's three GEMMs."""
import math

import pytest
import torch

from megalite.parallel.fp8_linear import FP8Linear, fp8_linear
from megalite.precision.gemm import emulated_mm, scaled_mm
from megalite.precision.quantize import Quantized, quantize
from megalite.precision.recipes import E4M3, E5M2, FP8_MAX, RECIPES, Recipe
from megalite.precision.scaling import DelayedScaling, fit_history

MANTISSA_BITS, MIN_EXPONENT = {E4M3: 3, E5M2: 2}, {E4M3: -6, E5M2: -14}


def fp8_round(v: float, dtype) -> float:
    """v saturated to the format's range and rounded to its nearest value (ties to even), in float64."""
    if math.isnan(v):
        return v
    top = FP8_MAX[dtype]
    v = max(-top, min(top, v))
    if v == 0:
        return 0.0
    exponent = max(math.floor(math.log2(abs(v))), MIN_EXPONENT[dtype])
    quantum = 2.0 ** (exponent - MANTISSA_BITS[dtype])
    return round(v / quantum) * quantum  # Python's round: half to even


def reference_quantize(x: torch.Tensor, dtype, tile, power_of_two):
    """(values, per-element scale) as the recipe says: the scale from the tile's amax in fp32, the
    product in fp32, then rounded onto the FP8 grid here."""
    rows, cols = x.shape
    tr, tc = tile or (rows, cols)
    scales = torch.empty(rows, cols, dtype=torch.float64)
    for i in range(0, rows, tr):
        for j in range(0, cols, tc):
            amax = x[i:i + tr, j:j + tc].abs().max().float()
            if amax == 0:
                s = torch.tensor(1.0)
            elif power_of_two:
                s = torch.tensor(2.0 ** math.floor(math.log2((FP8_MAX[dtype] / amax).item())))
            else:
                s = torch.tensor(FP8_MAX[dtype], dtype=torch.float32) / amax
            scales[i:i + tr, j:j + tc] = s.double()
    product = (x.float() * scales.float()).double()
    values = torch.tensor([[fp8_round(v, dtype) for v in row] for row in product.tolist()], dtype=torch.float64)
    return values, scales


CASES = [(recipe, fmt) for recipe in RECIPES for fmt in ("e4m3", "hybrid")]


@pytest.mark.parametrize("recipe, fmt", CASES, ids=[f"{r}-{f}" for r, f in CASES])
@pytest.mark.parametrize("role", ["input", "weight", "grad"])
def test_each_quantization_is_the_recipes_formula_written_out(recipe, fmt, role):
    r = Recipe("tensorwise" if recipe == "delayed" else recipe, fmt)
    dtype, tile = r.dtype(role), r.tile(role)
    g = torch.Generator().manual_seed(7)
    # Rows of very different magnitudes (so tiles differ), a zero row, and values beyond E4M3's range.
    x = torch.randn(130, 160, generator=g) * torch.logspace(-6, 3, 130).unsqueeze(1)
    x[5] = 0
    q = quantize(x, dtype, tile, r.power_of_two)
    values, scales = reference_quantize(x, dtype, tile, r.power_of_two)
    assert q.data.dtype == dtype and q.data.shape == x.shape
    assert torch.equal(q.data.double(), values), f"{(q.data.double() != values).sum()} values differ"
    per_element = Quantized(torch.ones_like(x).to(dtype), q.scale_inv, tile).dequantize().double()
    assert torch.equal(per_element, (1.0 / scales.float()).double())  # 1/s in fp32
    if r.power_of_two:  # E8M0 holds them: exact powers of two
        assert torch.equal(torch.log2(q.scale_inv).round(), torch.log2(q.scale_inv))
        stored = q.scale_inv.to(torch.float8_e8m0fnu).float()
        assert torch.equal(stored, q.scale_inv)
    if fmt == "hybrid":
        assert r.dtype("grad") == E5M2 and r.dtype("input") == r.dtype("weight") == E4M3


def test_tiles_are_deepseeks_and_mx_sizes():
    assert Recipe("blockwise").tile("input") == Recipe("blockwise").tile("grad") == (1, 128)
    assert Recipe("blockwise").tile("weight") == (128, 128)
    assert {Recipe("mxfp8").tile(role) for role in ("input", "weight", "grad")} == {(1, 32)}
    assert Recipe("tensorwise").tile("input") is None and Recipe("delayed").tile("weight") is None
    x = torch.zeros(3, 100)
    x[1, 40] = 300.0  # one 32-wide block with amax 300: scale 2^floor(log2(448/300)) = 1, so 1/s = 1
    x[2, 70] = 1e-3  # 448/1e-3 = 448000 -> 2^18
    q = quantize(x, E4M3, (1, 32), power_of_two=True)
    assert q.scale_inv.shape == (3, 4)
    assert q.scale_inv[1, 1] == 1.0 and q.scale_inv[2, 2] == 2.0 ** -18 and q.scale_inv[0, 0] == 1.0


@pytest.mark.parametrize("recipe, fmt", CASES, ids=[f"{r}-{f}" for r, f in CASES])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_each_scaled_gemm_equals_a_float64_product_of_its_operands_within_the_outputs_rounding(recipe, fmt,
                                                                                              out_dtype):
    r = Recipe(recipe, fmt)
    g = torch.Generator().manual_seed(3)
    a = quantize(torch.randn(48, 256, generator=g), r.dtype("grad"), r.tile("grad"), r.power_of_two)
    b = quantize(torch.randn(80, 256, generator=g) * 0.05, r.dtype("weight"), r.tile("weight"), r.power_of_two)
    out = scaled_mm(a, b, out_dtype)
    exact = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()
    magnitude = a.dequantize(torch.float64).abs() @ b.dequantize(torch.float64).abs().t()
    eps = torch.finfo(out_dtype).eps
    # One rounding to the output (eps/2 of the value) plus fp32 accumulation over 256 terms.
    bound = eps / 2 * exact.abs() + 256 * torch.finfo(torch.float32).eps * magnitude
    assert out.dtype == out_dtype
    assert ((out.double() - exact).abs() <= bound).all()


def test_tensor_wide_scales_run_torchs_scaled_gemm_with_the_emulations_numbers():
    g = torch.Generator().manual_seed(5)
    a, b = quantize(torch.randn(32, 64, generator=g), E5M2), quantize(torch.randn(16, 64, generator=g), E4M3)
    calls = []
    real = torch._scaled_mm
    try:
        torch._scaled_mm = lambda *args, **kw: calls.append(1) or real(*args, **kw)
        out = scaled_mm(a, b, torch.float32)
    finally:
        torch._scaled_mm = real
    assert calls == [1]
    assert torch.allclose(out, emulated_mm(a, b, torch.float32), rtol=1e-6, atol=1e-6)


def test_the_cpu_scaled_gemm_gives_the_same_numbers_on_every_cpu():
    # On an AMX CPU torch's op would take oneDNN's FP8 kernel (~500x slower, and it applies the scales
    # after the sum, a last-bit difference); megalite turns oneDNN off around it, so every CPU gives
    # the op's own fp32 path: the scaled operands' product, bitwise.
    g = torch.Generator().manual_seed(6)
    a, b = quantize(torch.randn(48, 64, generator=g), E4M3), quantize(torch.randn(32, 64, generator=g), E4M3)
    out = scaled_mm(a, b, torch.float32)
    assert torch.equal(out, torch.mm(a.data.float() * a.scale_inv, (b.data.float() * b.scale_inv).t()))
    with torch.backends.mkldnn.flags(enabled=True):
        with_onednn = torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv,
                                       out_dtype=torch.float32)
    assert torch.allclose(out, with_onednn, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_an_inf_or_nan_operand_makes_the_output_nan_never_a_saturated_number(recipe, bad):
    fp8 = FP8Linear(Recipe(recipe, "hybrid"))
    x, w = torch.randn(4, 64), torch.randn(32, 64) * 0.1
    x[2, 7] = bad
    y = fp8_linear(x, w, None, fp8)
    assert torch.isnan(y[2]).any(), "a non-finite input must not become a finite output"
    if fp8.scaling is not None:  # the input's amax is not finite: its next scale stays what it was
        fp8.scaling.update(fp8.scaling.amax_now.clone())
        assert fp8.scaling.scale[0] == 1.0 and torch.isclose(fp8.scaling.scale[1], 448.0 / w.abs().max())


def test_delayed_scaling_rolls_its_history_and_chooses_scales_as_transformer_engine_does():
    s = DelayedScaling(Recipe("delayed", "hybrid", amax_history_len=3, amax_compute_algo="max", margin=1))
    assert torch.equal(s.scale, torch.ones(3))  # an empty history quantizes with scale 1
    for amax in ([2.0, 4.0, 8.0], [1.0, 16.0, 0.0], [0.5, 0.25, float("inf")], [0.5, 0.25, 1.0]):
        s.update(torch.tensor(amax))
    # newest first; a zero amax (the grad that did not run at step 2) did not enter the history
    assert s.history.tolist() == [[0.5, 0.5, 1.0], [0.25, 0.25, 16.0], [1.0, float("inf"), 8.0]]
    # max over the history, then (max / amax) / 2^margin; the grad's inf amax keeps its last scale
    assert s.scale.tolist() == [448 / 1.0 / 2, 448 / 16.0 / 2, 57344 / 8.0 / 2]
    recent = DelayedScaling(Recipe("delayed", "e4m3", amax_history_len=3))
    recent.update(torch.tensor([2.0, 4.0, 8.0]))
    recent.update(torch.tensor([1.0, 1.0, 1.0]))
    assert recent.scale.tolist() == [448.0, 448.0, 448.0]
    assert recent.amax_now.tolist() == [0.0, 0.0, 0.0]


def test_a_saved_history_fits_a_run_with_another_history_length_keeping_the_newest_amaxes():
    s = DelayedScaling(Recipe("delayed", amax_history_len=4))
    for amax in range(1, 6):
        s.update(torch.full((3,), float(amax)))
    assert fit_history(s.history, 2)[0].tolist() == [5.0, 4.0]
    assert fit_history(s.history, 6)[0].tolist() == [5.0, 4.0, 3.0, 2.0, 0.0, 0.0]
    assert fit_history(s.history, 4) is s.history


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("wgrad", [True, False])
def test_a_linear_layers_three_gemms_are_fp8_products_of_the_recipes_operands(recipe, wgrad):
    r = Recipe(recipe, "hybrid", wgrad=wgrad)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(40, 256, generator=g).requires_grad_()
    w = (torch.randn(64, 256, generator=g) * 0.05).requires_grad_()
    b = torch.randn(64, generator=g).requires_grad_()
    dy = torch.randn(40, 64, generator=g) * 1e-3
    fp8 = FP8Linear(r)
    y = fp8_linear(x, w, b, fp8)
    y.backward(dy)

    def q(t, role):
        return quantize(t.detach(), r.dtype(role), r.tile(role), r.power_of_two,
                        scale=torch.tensor(1.0) if r.delayed else None)

    def mm(a, c):  # the product of two quantized operands, exactly, then rounded to fp32
        return (a.dequantize(torch.float64) @ c.dequantize(torch.float64).t()).float()

    tol = dict(rtol=1e-5, atol=1e-5)
    assert torch.allclose(y, mm(q(x, "input"), q(w, "weight")) + b, **tol)
    w_t = q(w, "weight").t() if r.tile("weight") in (None, (128, 128)) else q(w.t(), "weight")
    assert torch.allclose(x.grad, mm(q(dy, "grad"), w_t), **tol)
    if not wgrad:
        assert torch.allclose(w.grad, dy.t() @ x.detach(), **tol)
    elif r.tile("input") is None:  # one scale: the forward's FP8 values, transposed
        assert torch.allclose(w.grad, mm(q(dy, "grad").t(), q(x, "input").t()), **tol)
    else:  # tiles along the tokens: quantized again
        assert torch.allclose(w.grad, mm(q(dy.t(), "grad"), q(x.t(), "input")), **tol)
    assert torch.allclose(b.grad, dy.sum(0))
    # FP8 really ran: not the high-precision product
    assert not torch.allclose(y, x.detach() @ w.detach().t() + b, rtol=1e-4, atol=1e-5)


def test_recomputing_a_forward_quantizes_it_bitwise_the_same():
    for recipe in RECIPES:
        fp8 = FP8Linear(Recipe(recipe))
        x, w = torch.randn(16, 128), torch.randn(32, 128)
        assert torch.equal(fp8_linear(x, w, None, fp8), fp8_linear(x, w, None, fp8)), recipe


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_the_gpus_scaled_gemm_equals_the_emulation_within_the_outputs_rounding(fmt):
    """The CUDA path of the CPU test above (torch._scaled_mm on FP8 tensor cores)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    r = Recipe("tensorwise", fmt)
    g = torch.Generator().manual_seed(3)
    a = quantize(torch.randn(64, 256, generator=g).cuda(), r.dtype("grad"))
    b = quantize(torch.randn(128, 256, generator=g).cuda() * 0.05, r.dtype("weight"))
    out = scaled_mm(a, b, torch.bfloat16)
    exact = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()
    magnitude = a.dequantize(torch.float64).abs() @ b.dequantize(torch.float64).abs().t()
    bound = torch.finfo(torch.bfloat16).eps / 2 * exact.abs() + 256 * torch.finfo(torch.float32).eps * magnitude
    assert ((out.double() - exact).abs() <= bound).all()


def test_evaluation_quantizes_with_delayed_scales_and_records_no_amax():
    fp8 = FP8Linear(Recipe("delayed"))
    x, w = torch.randn(8, 64), torch.randn(16, 64)
    with torch.no_grad():
        fp8_linear(x, w, None, fp8)
    assert torch.equal(fp8.scaling.amax_now, torch.zeros(3))  # the step's scales are not the validation's
    fp8_linear(x, w.requires_grad_(), None, fp8).sum().backward()
    assert torch.equal(fp8.scaling.amax_now[:2], torch.stack([x.abs().max(), w.detach().abs().max()]))
    assert fp8.scaling.amax_now[2] == 1.0  # the output gradient of a sum: ones


def test_an_amax_too_small_for_its_quotient_takes_fp32s_largest_scale_not_a_nan():
    q = quantize(torch.tensor([[1e-37, 0.0, -5e-38, 0.0]]), E4M3)
    assert torch.isfinite(q.data.float()).all() and q.data.float()[0, 1] == 0
    assert q.scale_inv == 1.0 / torch.finfo(torch.float32).max


def test_loaded_histories_choose_scales_with_the_runs_own_settings():
    saved = DelayedScaling(Recipe("delayed", "e4m3", amax_history_len=2))
    saved.update(torch.tensor([2.0, 4.0, 8.0]))
    resumed = DelayedScaling(Recipe("delayed", "hybrid", amax_history_len=2, margin=1))
    resumed.history.copy_(saved.history)
    resumed.scale.copy_(saved.scale)
    resumed.rescale()
    assert resumed.scale.tolist() == [448 / 2 / 2, 448 / 4 / 2, 57344 / 8 / 2]
