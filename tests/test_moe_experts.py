"""grouped_linear's two paths on a CPU: torch's grouped GEMM (fp32, rows of 16-byte multiples, not
while compiling) and the loop of torch.mm; both equal per-expert matmuls in outputs and gradients,
experts without rows included, and a compiled graph takes the loop (torch's meta function for the
grouped GEMM takes bf16 only)."""
import pytest
import torch

from megalite.models.moe import experts as E


def _per_expert(x, w, counts):
    return torch.cat([xe @ w[e].t() for e, xe in enumerate(x.split(counts))])


def _run(fn, x, w, grad):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = fn(x, w)
    y.backward(grad)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("counts", [[5, 0, 7, 4], [0, 0, 16, 0], [4, 4, 4, 4]], ids=["uneven", "one", "even"])
def test_the_grouped_gemm_and_the_loop_equal_per_expert_matmuls(counts):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(sum(counts), 8, generator=g), torch.randn(4, 12, 8, generator=g)
    grad = torch.randn(sum(counts), 12, generator=g)
    assert E._grouped_mm_applies(x, w)
    want = _run(lambda a, b: _per_expert(a, b, counts), x, w, grad)
    grouped = _run(lambda a, b: E.grouped_linear(a, b, counts), x, w, grad)
    original = E._grouped_mm_applies
    E._grouped_mm_applies = lambda a, b: False
    try:
        loop = _run(lambda a, b: E.grouped_linear(a, b, counts), x, w, grad)
    finally:
        E._grouped_mm_applies = original
    for got in (grouped, loop):
        for a, b in zip(got, want):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    assert grouped[2][[c == 0 for c in counts]].abs().sum() == 0  # experts no row reached: zero gradient


def test_where_the_grouped_gemm_applies_on_a_cpu(monkeypatch):
    x, w = torch.randn(4, 8), torch.randn(2, 12, 8)
    assert E._grouped_mm_applies(x, w)
    assert not E._grouped_mm_applies(x.bfloat16(), w.bfloat16())  # CPU bf16: the loop
    assert not E._grouped_mm_applies(torch.randn(4, 6), torch.randn(2, 12, 6))  # 24-byte rows
    assert not E._grouped_mm_applies(x[:0], w)  # no rows
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not E._grouped_mm_applies(x, w)


def test_a_compiled_grouped_linear_equals_the_eager_one():
    counts = [3, 0, 5]
    g = torch.Generator().manual_seed(1)
    x, w, grad = torch.randn(8, 8, generator=g), torch.randn(3, 4, 8, generator=g), torch.randn(8, 4, generator=g)
    eager = _run(lambda a, b: E.grouped_linear(a, b, counts), x, w, grad)
    compiled = _run(torch.compile(lambda a, b: E.grouped_linear(a, b, counts), backend="aot_eager"), x, w, grad)
    for a, b in zip(compiled, eager):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
