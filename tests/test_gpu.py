"""GPU checks, run on a CUDA machine with `python -m pytest -m gpu` (deselected by default).
Each has a CPU counterpart in the regular suite."""
import importlib.util
from pathlib import Path

import pytest
import torch

from megalite.models import activation_bytes_per_layer

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _need_cuda():
    if not torch.cuda.is_available():
        pytest.fail("GPU tests need CUDA: run them on the GPU machine, or leave out -m gpu")


def test_selective_recompute_saves_at_least_70_percent_of_the_formula_on_gpu():
    """CPU counterpart: tests/test_activation_memory.py::test_measured_activation_bytes_follow_the_formula_on_cpu"""
    spec = importlib.util.spec_from_file_location("activation_memory", ROOT / "scripts" / "activation_memory.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    dev = torch.device("cuda")
    for s, b, h, a in [(1024, 8, 1024, 16), (2048, 4, 2048, 16)]:
        none, selective = (script.measure(s, b, h, a, m, dev) for m in ("none", "selective"))
        predicted = activation_bytes_per_layer(s, b, h, a) - activation_bytes_per_layer(s, b, h, a, recompute="selective")
        assert none - selective >= 0.7 * predicted


# -- fused kernels (CPU counterpart: tests/test_ops.py, same float64 references) ---------------------

from test_ops import layer_norm64, softmax64, softmax64_backward  # noqa: E402

from megalite import ops  # noqa: E402
from megalite.ops import build  # noqa: E402

# Per dtype: the output's own rounding plus fp32 arithmetic.
KERNEL_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _extension():
    module, status = build.load()
    assert status, f"the kernels must build and load on the GPU machine: {status}"
    return module


def _poison(*tensors_like):
    """Fill freed allocator blocks of these sizes with NaN bytes: an output element a kernel
    forgets to write then reads back as NaN instead of a lucky zero."""
    blocks = [torch.full((t.numel() * t.element_size() // 4 + 1,), float("nan"), device="cuda") for t in tensors_like]
    del blocks


def _misaligned(shape, dtype):
    """A contiguous tensor whose data pointer is not 16-byte aligned (the one-element-a-time path)."""
    n = 1
    for d in shape:
        n *= d
    return torch.empty(n + 1, dtype=dtype, device="cuda")[1:].view(shape)


def test_kernels_build_load_and_pass_their_self_check():
    build.reset()
    status = ops.kernels_available()
    assert status, str(status)
    assert _extension().max_cols == ops.MAX_COLS


SOFTMAX_LENGTHS = [1, 7, 31, 32, 33, 100, 128, 255, 256, 257, 1000, 1024, 2047, 2048, 3000, 4096, 5000, 8192, 16384]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_kernels_match_float64(dtype, causal):
    ext = _extension()
    g = torch.Generator(device="cuda").manual_seed(1)
    atol, rtol = KERNEL_TOL[dtype]
    for sk in SOFTMAX_LENGTHS:
        for b, heads, sq, mask_batch, aligned, mask_queries in ((2, 3, 9, 2, True, 9), (3, 2, 5, 1, False, 5),
                                                                 (2, 2, 6, 2, True, 1)):
            if sk > 4096 and b == 3:
                continue
            shape = (b, heads, sq, sk)
            x = (4 * torch.randn(shape, device="cuda", generator=g)).to(dtype)
            if not aligned:
                x = _misaligned(shape, dtype).copy_(x)
            dy = torch.randn(shape, device="cuda", generator=g).to(dtype)
            hidden = None
            if not causal:
                hidden = torch.rand(mask_batch, 1, mask_queries, sk, device="cuda", generator=g) < 0.3
                hidden[0, 0, min(sq // 2, mask_queries - 1)] = True  # rows with every key hidden
            _poison(x, x)
            y = ext.softmax_forward(x, hidden, 0.125, causal)
            full_hidden = torch.ones(sq, sk, dtype=torch.bool, device="cuda").triu(1)[None, None] if causal else hidden
            want = softmax64(x, full_hidden, 0.125)
            assert torch.isfinite(y).all(), f"unwritten or NaN output, sk={sk}"
            torch.testing.assert_close(y.double(), want, atol=atol, rtol=rtol, msg=f"forward sk={sk} {shape}")
            if not causal:
                assert (y[0, :, min(sq // 2, mask_queries - 1)] == 0).all(), "a fully hidden row must be zeros"
            _poison(x)
            dx = ext.softmax_backward(dy, y, 0.125, causal)
            assert torch.isfinite(dx).all()
            torch.testing.assert_close(dx.double(), softmax64_backward(y, dy, 0.125), atol=atol, rtol=rtol,
                                       msg=f"backward sk={sk} {shape}")


def test_public_softmax_autograd_uses_the_kernel_and_falls_back_beyond_its_limit():
    _extension()
    for sk in (300, ops.MAX_COLS + 1):
        x = torch.randn(1, 2, 3, sk, device="cuda", requires_grad=True)
        dy = torch.randn_like(x)
        y = ops.scaled_causal_softmax(x, 0.5)
        y.backward(dy)
        want = softmax64(x.detach(), torch.ones(3, sk, dtype=torch.bool, device="cuda").triu(1)[None, None], 0.5)
        torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x.grad.double(), softmax64_backward(want, dy, 0.5), atol=1e-5, rtol=1e-5)
        assert ("megalite_softmax_forward" in y.grad_fn.name()) == (sk <= ops.MAX_COLS)


NORM_SIZES = [1, 7, 64, 100, 127, 128, 256, 768, 1000, 1024, 2048, 4096, 5120, 8192, 12288, 16384]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms,with_bias", [(False, True), (False, False), (True, False)])
def test_norm_kernels_match_float64(dtype, rms, with_bias):
    _extension()
    g = torch.Generator(device="cuda").manual_seed(2)
    atol, rtol = KERNEL_TOL[dtype]
    for h in NORM_SIZES:
        for rows, aligned in ((37, True), (1000, False)):
            if h >= 8192 and rows == 1000:
                rows = 300
            x = (1 + 2 * torch.randn(rows, h, device="cuda", generator=g)).to(dtype)
            if not aligned:
                x = _misaligned((rows, h), dtype).copy_(x)
            x.requires_grad_(True)
            w = (1 + 0.2 * torch.randn(h, device="cuda", generator=g)).to(dtype).requires_grad_(True)
            b = (0.2 * torch.randn(h, device="cuda", generator=g)).to(dtype).requires_grad_(True) if with_bias else None
            dy = torch.randn(rows, h, device="cuda", generator=g).to(dtype)
            _poison(x, x)
            y = ops.rms_norm(x, w, 1e-5) if rms else ops.layer_norm(x, w, b, 1e-5)
            assert "megalite_norm_forward" in y.grad_fn.name()
            leaves = [x, w] + ([b] if with_bias else [])
            grads = torch.autograd.grad(y, leaves, dy)
            ref = [t.detach().double().requires_grad_(True) for t in leaves]
            want = layer_norm64(ref[0], ref[1], ref[2] if with_bias else None, 1e-5, rms)
            want_grads = torch.autograd.grad(want, ref, dy.double())
            torch.testing.assert_close(y.double(), want.detach(), atol=atol, rtol=rtol, msg=f"forward h={h}")
            for got, exp, name in zip(grads, want_grads, ["x", "weight", "bias"]):
                scale = exp.abs().max().item() or 1.0
                assert torch.isfinite(got).all(), f"grad of {name}, h={h}"
                torch.testing.assert_close(got.double() / scale, exp / scale, atol=4 * atol, rtol=0,
                                           msg=f"grad of {name}, h={h} rows={rows} {dtype}")


def test_norm_backward_is_bitwise_reproducible():
    _extension()
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    runs = [torch.autograd.grad(ops.layer_norm(x, w, b, 1e-5), [x, w, b], dy) for _ in range(3)]
    for other in runs[1:]:
        for a, c in zip(runs[0], other):
            assert torch.equal(a, c)


def test_gpt_with_fused_backends_matches_torch_backends_on_gpu():
    """CPU counterpart: tests/test_ops.py::test_gpt_with_fused_backends_equals_torch_backends"""
    from megalite.testing import run_ranks
    from test_ops import _gpt_backends_on

    out = run_ranks(_gpt_backends_on, 1, args=(7, "cuda"))[0]
    ref_loss, ref_grads = out["torch", "torch"]
    loss, grads = out["fused", "fused"]
    torch.testing.assert_close(loss, ref_loss, atol=0, rtol=1e-5)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-4, msg=name)


def test_a_gpu_built_layer_holds_the_same_full_weights_at_every_tp_size():
    """Weights are drawn on the GPU (init_device); each TP rank keeps its block of the same draw."""
    from megalite.models import preset
    from megalite.models.transformer import TransformerLayer
    from megalite.parallel import state

    config = preset("gpt-tiny")
    saved = state.get_tensor_model_parallel_world_size, state.get_tensor_model_parallel_rank
    try:
        state.get_tensor_model_parallel_world_size, state.get_tensor_model_parallel_rank = (lambda: 1), (lambda: 0)
        whole = TransformerLayer(config, 3, seed=7, device="cuda").mlp.fc1.weight
        shards = []
        for r in range(2):
            state.get_tensor_model_parallel_world_size, state.get_tensor_model_parallel_rank = (lambda: 2), (lambda r=r: r)
            shards.append(TransformerLayer(config, 3, seed=7, device="cuda").mlp.fc1.weight)
    finally:
        state.get_tensor_model_parallel_world_size, state.get_tensor_model_parallel_rank = saved
    assert whole.is_cuda and torch.equal(torch.cat(shards, 0), whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_attention_with_fused_sdpa_matches_the_repeat_kv_reference_on_gpu(dtype):
    """SDPA's GPU kernels with grouped keys and values (enable_gqa), rope and qk-norm, against the
    same attention with k and v expanded per head. CPU counterpart:
    tests/test_llama.py::test_attention_equals_the_repeat_kv_reference."""
    from test_llama import randomize_norms, reference_attention, small_config

    from megalite.models.attention import ParallelAttention
    from megalite.parallel.layers import normal_init

    c = small_config(qk_layernorm=True, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                     max_position_embeddings=512)
    attn = ParallelAttention(c, normal_init(0.2), normal_init(0.2), device="cpu")
    randomize_norms(attn, 1)
    attn = attn.cuda()
    x = torch.randn(512, 2, c.hidden_size, generator=torch.Generator().manual_seed(3)).cuda()
    want = reference_attention(attn, x, c)  # fp32, expanded k/v
    got = attn.to(dtype)(x.to(dtype)).float()
    err = (got - want).abs().max() / want.abs().max()  # relative to the largest output
    assert err <= (2e-2 if dtype == torch.bfloat16 else 1e-5), err


def test_llama_layer_activations_follow_the_formula_on_gpu():
    """Bytes a GQA + SwiGLU + rope layer (SDPA, bf16) leaves for backward on the GPU, against
    megalite.models.memory.layer_activation_bytes. CPU counterpart: tests/test_activation_memory.py."""
    from test_activation_memory import LLAMA_LAYERS, _script

    from megalite.models.memory import layer_activation_bytes

    script, cuda = _script(), torch.device("cuda")
    s, b, h, a = 2048, 2, 2048, 16
    for arch in LLAMA_LAYERS.values():
        arch = {**arch, "attention_backend": "sdpa", "attention_dropout": 0.0}
        if "ffn_hidden_size" in arch:
            arch["ffn_hidden_size"] = arch["ffn_hidden_size"] * h // 256
        _, config = script.build_layer(s, h, a, "none", cuda, torch.bfloat16, **arch)
        measured = script.measure(s, b, h, a, "none", cuda, **arch)
        assert 0.8 <= measured / layer_activation_bytes(config, s, b) <= 1.25, (arch, measured)


def test_zero_stage_3_on_a_gpu_trains_like_stage_0(tmp_path):
    """Stage 3's freed units are CUDA storages resized to zero and refilled before use; on one GPU
    (dp 1: the gather is a copy) the run must match stage 0. Multi-rank stage 3 is proven on CPU
    (tests/test_zero.py); NCCL does not put two ranks on one GPU."""
    from cli import losses, torchrun

    runs = {}
    for stage in ("0", "3"):
        path = tmp_path / f"stage{stage}.jsonl"
        run = torchrun("pretrain_gpt.py", 1, "--mock-data", "--train-iters", "10", "--log-interval", "1", "--bf16",
                       "--num-layers", "4", "--zero-stage", stage, "--metrics-file", str(path))
        assert run.returncode == 0, run.stderr[-3000:]
        runs[stage] = losses(path)
    assert len(runs["3"]) == 10
    for a, b in zip(runs["3"], runs["0"]):
        assert abs(a - b) <= 1e-3 * abs(b), runs


def test_grouped_linear_on_cuda_bf16_runs_pytorchs_grouped_gemm_and_matches_the_loop():
    """The CUDA path of megalite.models.moe.experts.grouped_linear (torch.nn.functional.grouped_mm)
    against the loop the CPU runs (tests/test_moe_dispatch.py checks the loop against one device),
    including an expert with no rows; forward and both gradients."""
    from megalite.models.moe import experts as moe_experts

    torch.manual_seed(0)
    counts = [64, 0, 128, 32]
    x = torch.randn(sum(counts), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert moe_experts._grouped_mm_applies(x, w)
    y = moe_experts.grouped_linear(x, w, counts)
    g = torch.randn_like(y)
    y.backward(g)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = torch.cat([xe @ w32[e].t() for e, xe in enumerate(x32.split(counts))])
    ref.backward(g.float())
    for got, want in ((y, ref), (x.grad, x32.grad), (w.grad, w32.grad)):
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        assert err < 2e-2, err
    assert torch.count_nonzero(w.grad[1]) == 0


def test_split_backward_on_cuda_bf16_gives_the_native_numbers_bitwise_and_defers_every_weight():
    """CPU counterpart: tests/test_split_backward.py. On the GPU: bf16 GEMMs, megalite's fused norm
    kernel (its weight handed over late), the word embedding's scatter and PyTorch's grouped GEMM:
    B leaves every weight gradient to W, and W gives what one backward gives, bit for bit."""
    from megalite import ops
    from megalite.models.moe.experts import grouped_linear
    from megalite.parallel import weight_grad
    from megalite.parallel.grad_accumulation import embedding, linear

    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    table = torch.randn(512, 256, device=dev, dtype=bf, requires_grad=True)
    w1 = torch.randn(1024, 256, device=dev, dtype=bf, requires_grad=True)
    b1 = torch.randn(1024, device=dev, dtype=bf, requires_grad=True)
    norm_w = torch.randn(1024, device=dev, dtype=bf, requires_grad=True)
    experts = torch.randn(4, 256, 1024, device=dev, dtype=bf, requires_grad=True)
    ids = torch.randint(0, 512, (128, 4), device=dev)
    params = [table, w1, b1, norm_w, experts]

    def model():
        x = embedding(ids, table)  # [128, 4, 256]
        h = ops.layer_norm(linear(x, w1, b1), weight_grad.defer_delivery(norm_w), None, 1e-5)
        rows = h.reshape(-1, 1024)
        return grouped_linear(rows, experts, [128, 0, 256, 128]).float().pow(2).mean()

    def run(split: bool, defer: bool):
        for p in params:
            p.grad = None
        with weight_grad.split_ops(split):
            loss = model()
        if defer:
            with weight_grad.deferred() as work:
                loss.backward()
            assert all(p.grad is None for p in params) and len(work) >= 5
            work.run()
        else:
            loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in params]

    native = run(split=False, defer=False)
    for defer in (False, True):
        for a, b in zip(run(split=True, defer=defer), native):
            assert torch.equal(a, b), (defer, (a.float() - b.float()).abs().max())
