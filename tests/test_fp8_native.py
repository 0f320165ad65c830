"""The GPU's tiled FP8 GEMMs (megalite.precision.native) on a CPU: torch's own op runs them only on
Hopper and Blackwell, so a stand-in replays its rules here, reading every factor from the place in
memory where torch's checks say the kernel reads it. Our layouts must give the emulation's numbers
through it; a layout off by a transpose must be caught by the first-use check and never reach the
model's numbers."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from megalite.precision import native
from megalite.precision.gemm import emulated_mm, scaled_mm
from megalite.precision.quantize import quantize
from megalite.precision.recipes import BLOCK, E4M3, E5M2, MX_BLOCK


def _per_element(scale: torch.Tensor, recipe, swizzle, rows: int, k: int) -> torch.Tensor:
    """[rows, K] factors of an operand ([rows, K] or b's [N, K]) read from memory as the kernel does."""
    if recipe == F.ScalingType.BlockWise1x128:
        blocks = math.ceil(k / BLOCK)
        memory = torch.as_strided(scale, (rows, blocks), (1, rows), scale.storage_offset())
        return memory.float().repeat_interleave(BLOCK, 1)[:, :k]
    if recipe == F.ScalingType.BlockWise128x128:
        blocks_k = math.ceil(k / BLOCK)
        padded_k = -(-blocks_k // 4) * 4
        memory = torch.as_strided(scale, (padded_k, math.ceil(rows / BLOCK)), (1, padded_k), scale.storage_offset())
        return memory.float().t().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :k]
    assert recipe == F.ScalingType.BlockWise1x32 and swizzle == F.SwizzleType.SWIZZLE_32_4_4
    assert scale.dtype == torch.float8_e8m0fnu and scale.is_contiguous()
    cols = math.ceil(k / MX_BLOCK)
    tiles_per_row = -(-cols // 4)
    r, c = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
    offset = ((r // 128) * tiles_per_row + c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
    assert scale.numel() == -(-rows // 128) * 128 * tiles_per_row * 4
    return scale.float().flatten()[offset].repeat_interleave(MX_BLOCK, 1)[:, :k]


def replayed_scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, swizzle_a=None, swizzle_b=None,
                       output_dtype=torch.bfloat16):
    """torch.nn.functional.scaled_mm's tiled cases as its checks and cuBLAS's layouts describe them."""
    (m, k), n = mat_a.shape, mat_b.shape[1]
    assert mat_b.stride(0) == 1, "b must be column-major"
    fa = _per_element(scale_a, recipe_a, swizzle_a, m, k)
    fb = _per_element(scale_b, recipe_b, swizzle_b, n, k)
    return torch.mm(mat_a.float() * fa, (mat_b.t().float() * fb).t()).to(output_dtype)


@pytest.fixture
def gpu(monkeypatch):
    """Pretend to be a GPU of the given compute capability whose tiled op follows torch's rules."""
    native.forget_verdicts()
    calls = []

    def op(*args, **kwargs):
        calls.append(args[3])
        return replayed_scaled_mm(*args, **kwargs)

    def pretend(major):
        monkeypatch.setattr(native, "_capability", lambda device: (major, 0))
        monkeypatch.setattr(native, "scaled_mm_op", op)
        return calls

    yield pretend
    native.forget_verdicts()


def _operands(m, n, k, tile_a, tile_b, dtype_b=E4M3, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Rows and blocks of very different sizes: a factor read from the wrong tile shows.
    a = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]
    b = torch.randn(n, k, generator=g) * torch.logspace(2, -2, k)[None, :]
    return quantize(a, E4M3, tile_a, power_of_two=True), quantize(b, dtype_b, tile_b, power_of_two=True)


@pytest.mark.parametrize("m,n,k,tile_b", [(256, 256, 384, (BLOCK, BLOCK)),  # forward and dgrad: 128x128 weights
                                          (144, 272, 640, (BLOCK, BLOCK)),  # partial tiles, K/128 = 5 padded to 8
                                          (256, 160, 256, (1, BLOCK))],  # wgrad: 1x128 by 1x128
                         ids=["whole", "partial", "wgrad"])
def test_blockwise_layouts_give_the_emulations_numbers_on_hopper(gpu, m, n, k, tile_b):
    calls = gpu(9)
    a, b = _operands(m, n, k, (1, BLOCK), tile_b)
    assert native.tiled_kind(a, b) == "blockwise"
    want = emulated_mm(a, b, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = scaled_mm(a, b, torch.float32)
    assert torch.equal(got, want)
    assert len(calls) == 1 and all(native._verdicts.values())


@pytest.mark.parametrize("m,n,k", [(256, 128, 256), (144, 48, 96)], ids=["whole", "padded"])
def test_mxfp8_swizzled_e8m0_factors_give_the_emulations_numbers_on_blackwell(gpu, m, n, k):
    calls = gpu(10)
    a, b = _operands(m, n, k, (1, MX_BLOCK), (1, MX_BLOCK))
    assert native.tiled_kind(a, b) == "mxfp8"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = scaled_mm(a, b, torch.float32)
    assert torch.equal(got, emulated_mm(a, b, torch.float32)) and len(calls) == 1


def test_where_the_kernels_do_not_apply_the_emulation_runs(gpu):
    gpu(9)
    a, b = _operands(128, 128, 256, (1, MX_BLOCK), (1, MX_BLOCK))
    assert native.tiled_kind(a, b) is None  # mxfp8 on Hopper
    a, b = _operands(128, 128, 256, (1, BLOCK), (BLOCK, BLOCK), dtype_b=E5M2)
    assert native.tiled_kind(a, b) is None  # cuBLAS's blockwise GEMM takes E4M3 only (hybrid's gradients)
    a, b = _operands(120, 128, 256, (1, BLOCK), (BLOCK, BLOCK))
    assert native.tiled_kind(a, b) is None  # rows not a multiple of 16
    gpu(8)
    a, b = _operands(128, 128, 256, (1, BLOCK), (BLOCK, BLOCK))
    assert native.tiled_kind(a, b) is None  # Ampere


def test_a_cpu_always_emulates():
    a, b = _operands(128, 128, 256, (1, BLOCK), (BLOCK, BLOCK))
    assert native.tiled_kind(a, b) is None


def test_a_layout_off_by_a_transpose_is_caught_once_and_the_run_keeps_the_emulations_numbers(gpu, monkeypatch):
    calls = gpu(9)
    right = native.blockwise_factors
    monkeypatch.setattr(native, "blockwise_factors", lambda q, role: right(q, role).contiguous()
                        if q.tile == (1, BLOCK) else right(q, role))  # row-major: the kernel reads other tiles
    a, b = _operands(256, 256, 384, (1, BLOCK), (BLOCK, BLOCK))
    want = emulated_mm(a, b, torch.bfloat16)
    with pytest.warns(RuntimeWarning, match=r"blockwise FP8 GEMM differs from the emulation .* runs emulated"):
        assert torch.equal(scaled_mm(a, b, torch.bfloat16), want)
    assert len(calls) == 1 and list(native._verdicts.values()) == [False]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        for seed in (1, 2):  # other token counts of the same kind: no second try, no second warning
            a2, b2 = _operands(128 * seed, 256, 384, (1, BLOCK), (BLOCK, BLOCK), seed=seed)
            assert torch.equal(scaled_mm(a2, b2, torch.bfloat16), emulated_mm(a2, b2, torch.bfloat16))
    assert len(calls) == 1


def test_an_op_this_build_lacks_falls_back_with_one_warning(gpu, monkeypatch):
    gpu(10)

    def refuses(*args, **kwargs):
        raise NotImplementedError("Block-wise scaling for Float8_e8m0fnu requires ...")

    monkeypatch.setattr(native, "scaled_mm_op", refuses)
    a, b = _operands(128, 128, 128, (1, MX_BLOCK), (1, MX_BLOCK))
    with pytest.warns(RuntimeWarning, match="mxfp8 FP8 GEMM failed: Block-wise scaling"):
        assert torch.equal(scaled_mm(a, b, torch.float32), emulated_mm(a, b, torch.float32))


def test_after_the_check_the_native_gemm_runs_alone_without_host_syncs(gpu, monkeypatch):
    calls = gpu(9)
    a, b = _operands(256, 256, 256, (1, BLOCK), (BLOCK, BLOCK))
    scaled_mm(a, b, torch.bfloat16)
    emulations = []
    real = native.trusted

    def counting(key, run_native, run_emulated):
        return real(key, run_native, lambda: emulations.append(1) or run_emulated())

    monkeypatch.setattr(native, "trusted", counting)
    syncs = []
    monkeypatch.setattr(torch.Tensor, "item", lambda self: syncs.append(1) or 0)
    for m in (128, 384, 256):  # the experts' token counts change; the kind stays
        a, b = _operands(m, 256, 256, (1, BLOCK), (BLOCK, BLOCK), seed=m)
        scaled_mm(a, b, torch.bfloat16)
    assert len(calls) == 4 and not emulations and not syncs


def test_an_inf_on_the_first_problem_decides_nothing(gpu):
    calls = gpu(9)
    a, b = _operands(128, 128, 256, (1, BLOCK), (BLOCK, BLOCK))
    a.scale_inv[0, 0] = float("inf")
    scaled_mm(a, b, torch.float32)
    assert not native._verdicts and not calls
    a, b = _operands(128, 128, 256, (1, BLOCK), (BLOCK, BLOCK))
    scaled_mm(a, b, torch.float32)
    assert list(native._verdicts.values()) == [True] and len(calls) == 1


def test_a_blockwise_layer_runs_all_three_gemms_natively_after_their_checks(gpu):
    """FP8Linear's forward (1x128 x 128x128), input gradient (the same, on W^T) and weight gradient
    (1x128 x 1x128): each kind checked once, all agreeing, the layer's numbers the emulation's."""
    from megalite.parallel.fp8_linear import FP8Linear, fp8_linear
    from megalite.precision.recipes import Recipe

    torch.manual_seed(0)
    x = torch.randn(256, 256, requires_grad=True)
    w = torch.randn(384, 256, requires_grad=True)

    def run():
        y = fp8_linear(x, w, None, FP8Linear(Recipe("blockwise")))
        y.pow(2).sum().backward()
        out = (y.detach(), x.grad.clone(), w.grad.clone())
        x.grad = w.grad = None
        return out

    want = run()
    calls = gpu(9)
    got = run()
    assert len(calls) == 3 and len(native._verdicts) == 3 and all(native._verdicts.values())
    for g, e in zip(got, want):
        assert torch.equal(g, e)


# ---- the experts' grouped GEMM ----------------------------------------------------------------------------------------

def replayed_scaled_grouped_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, swizzle_a=None, swizzle_b=None,
                               bias=None, offs=None, output_dtype=torch.bfloat16):
    """torch.nn.functional.scaled_grouped_mm's row-wise 2-D x 3-D case as its checks describe it."""
    assert recipe_a == recipe_b == F.ScalingType.RowWise and mat_a.dim() == 2 and mat_b.dim() == 3
    assert mat_a.stride(1) == 1 and mat_b.stride(1) == 1, "a row-major, b each expert's transpose"
    (total, k), (experts, k_b, n) = mat_a.shape, mat_b.shape
    assert k == k_b and k % 16 == 0 and n % 16 == 0 and output_dtype == torch.bfloat16
    assert scale_a.shape == (total,) and scale_a.is_contiguous() and scale_a.dtype == torch.float32
    assert scale_b.shape == (experts, n) and scale_b.stride(1) == 1 and scale_b.dtype == torch.float32
    assert offs.dtype == torch.int32 and offs.shape == (experts,) and int(offs[-1]) == total
    out, start = torch.empty(total, n, dtype=output_dtype), 0
    for e, end in enumerate(offs.tolist()):
        a = mat_a[start:end].float() * scale_a[start:end, None]
        out[start:end] = (a @ (mat_b[e].float() * scale_b[e][None, :])).to(output_dtype)
        start = end
    return out


@pytest.fixture
def grouped_gpu(monkeypatch):
    native.forget_verdicts()
    calls = []

    def op(*args, **kwargs):
        calls.append(1)
        return replayed_scaled_grouped_mm(*args, **kwargs)

    def pretend():
        native.forget_verdicts()
        monkeypatch.setattr(native, "_capability", lambda device: (9, 0))
        monkeypatch.setattr(native, "scaled_grouped_mm_op", op)
        return calls

    yield pretend
    native.forget_verdicts()


def _expert_layer(counts, seed=0):
    from megalite.parallel.fp8_linear import FP8Linear
    from megalite.precision.recipes import Recipe

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(sum(counts), 64, generator=g) * torch.logspace(-1, 1, sum(counts))[:, None]).bfloat16()
    w = (torch.randn(len(counts), 48, 64, generator=g) * torch.tensor([0.01, 1.0, 30.0, 0.3])[:, None, None]).bfloat16()
    return x.requires_grad_(), w.requires_grad_(), [FP8Linear(Recipe("tensorwise")) for _ in counts]


def _run_experts(counts, seed=0):
    from megalite.parallel.fp8_linear import fp8_grouped_linear

    x, w, states = _expert_layer(counts, seed)
    y = fp8_grouped_linear(x, w, counts, states)
    (y.float() * torch.linspace(-1, 1, y.shape[1])).sum().backward()
    return y.detach(), x.grad


def test_the_grouped_gemm_runs_the_experts_forward_and_input_gradient_after_its_check(grouped_gpu):
    counts = [16, 0, 48, 32]  # an expert without tokens: its weight is in b, none of it read
    want = _run_experts(counts)
    calls = grouped_gpu()
    got_y, got_dx = _run_experts(counts)
    assert len(calls) == 2 and len(native._verdicts) == 2 and all(native._verdicts.values())
    for g, e in ((got_y, want[0]), (got_dx, want[1])):
        assert float((g.float() - e.float()).norm() / e.float().norm()) <= torch.finfo(torch.bfloat16).eps
    # Other token counts: the same kinds, no new check, the grouped GEMM alone.
    _run_experts([8, 40, 0, 0], seed=1)
    assert len(calls) == 4 and len(native._verdicts) == 2


def test_a_grouped_gemm_that_pairs_experts_wrongly_is_caught(grouped_gpu, monkeypatch):
    right = native.grouped_mm

    def shifted(a, b, counts, out_dtype):  # every expert multiplied by its neighbour's weight
        return right(a, b[1:] + b[:1], counts, out_dtype)

    want = _run_experts([16, 32, 48, 16])
    grouped_gpu()
    monkeypatch.setattr(native, "grouped_mm", shifted)
    with pytest.warns(RuntimeWarning, match="grouped FP8 GEMM differs from the emulation"):
        got = _run_experts([16, 32, 48, 16])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
def test_on_this_gpu_the_kernels_it_has_pass_their_first_use_check():
    """scripts/gpu_checks.sh fp8: the real ops on a Hopper (blockwise, grouped) or Blackwell (mxfp8,
    grouped). The logic is the CPU tests' above; this proves torch's kernels read our layouts."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    native.forget_verdicts()
    major = torch.cuda.get_device_capability()[0]
    tiles = {9: ((1, BLOCK), (BLOCK, BLOCK)), 10: ((1, MX_BLOCK), (1, MX_BLOCK))}.get(major)
    if tiles is None:
        pytest.skip(f"compute capability {major}.x has neither kernel")
    a, b = _operands(256, 384, 512, *tiles)
    a, b = (type(a)(a.data.cuda(), a.scale_inv.cuda(), a.tile), type(b)(b.data.cuda(), b.scale_inv.cuda(), b.tile))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaled_mm(a, b, torch.bfloat16)
        from megalite.parallel.fp8_linear import fp8_grouped_linear

        x, w, states = _expert_layer([32, 0, 64, 32])
        fp8_grouped_linear(x.detach().cuda(), w.detach().cuda(), [32, 0, 64, 32], states)
    kinds = {key[0] for key, ok in native._verdicts.items() if ok}
    assert kinds == {"blockwise" if major == 9 else "mxfp8", "grouped"}, native._verdicts
    native.forget_verdicts()
