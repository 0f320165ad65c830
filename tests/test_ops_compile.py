"""The fused kernels' Python side, proven on CPU with a stand-in extension that computes what the
kernels compute: the custom operators' autograd formulas give the reference gradients, and a
transformer layer on the fused backends compiles at tp=2 without a graph break (before, every
call into the extension broke the graph on a GPU)."""
from __future__ import annotations

import pytest
import torch

from megalite import ops
from megalite.ops import reference
from megalite.testing import run_ranks


def _opaque(fn):
    """Like a pybind entry point, opaque to torch.compile: called from a traced region it breaks
    the graph (unless the call sits inside a custom operator, which is never traced into)."""
    return staticmethod(torch._dynamo.disable(fn))


class CpuExtension:
    """The extension's four entry points, in PyTorch: outputs, statistics and per-block partial
    sums shaped as the CUDA kernels return them."""

    @_opaque
    def softmax_forward(x, mask, scale, causal):
        if causal:
            return reference.scaled_causal_softmax(x, scale)
        return reference.scaled_masked_softmax(x, mask, scale)

    @_opaque
    def softmax_backward(dy, y, scale, causal):
        return scale * y * (dy - (dy * y).sum(-1, keepdim=True))

    @_opaque
    def norm_forward(x, w, b, eps, rms):
        xf = x.float().reshape(-1, x.shape[-1])
        mean = torch.zeros(xf.shape[0]) if rms else xf.mean(-1)
        centred = xf - mean[:, None]
        rstd = torch.rsqrt(centred.square().mean(-1) + eps)
        y = centred * rstd[:, None] * w.float() + (0 if b is None else b.float())
        return [y.to(x.dtype).reshape(x.shape), mean, rstd]

    @_opaque
    def norm_backward(dy, x, w, mean, rstd, rms):
        xf, g = x.float().reshape(-1, x.shape[-1]), dy.float().reshape(-1, x.shape[-1])
        xhat = (xf - mean[:, None]) * rstd[:, None]
        gx = g * w.float()
        dx = gx - (0 if rms else gx.mean(-1, keepdim=True)) - xhat * (gx * xhat).mean(-1, keepdim=True)
        dx = dx * rstd[:, None]
        # Two "blocks" of partial sums, as the kernel leaves them.
        dw = torch.stack([(g * xhat)[::2].sum(0), (g * xhat)[1::2].sum(0)])
        db = torch.stack([g[::2].sum(0), g[1::2].sum(0)])
        return [dx.to(x.dtype).reshape(x.shape), dw, db]


@pytest.fixture
def kernel_path(monkeypatch):
    """Route megalite.ops to the kernel path on CPU tensors, through the stand-in extension."""
    from megalite.ops import build

    monkeypatch.setattr(build, "_loaded", (CpuExtension(), build.KernelStatus(True, "CPU stand-in")))
    monkeypatch.setattr(ops, "_extension_for", lambda *tensors: CpuExtension())


@pytest.mark.parametrize("which", ["masked", "causal", "layer_norm", "layer_norm_no_bias", "rms_norm"])
def test_custom_operators_give_the_reference_outputs_and_gradients(kernel_path, which):
    gen = torch.Generator().manual_seed(5)
    if which in ("masked", "causal"):
        x = torch.randn(2, 3, 5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
        mask = torch.rand(2, 1, 5, 7, generator=gen) < 0.3
        leaves = [x]
        fused = lambda: ops.scaled_masked_softmax(x, mask, 0.5) if which == "masked" else \
            ops.scaled_causal_softmax(x, 0.5)  # noqa: E731
        ref = lambda: reference.scaled_masked_softmax(x, mask, 0.5) if which == "masked" else \
            reference.scaled_causal_softmax(x, 0.5)  # noqa: E731
    else:
        x = torch.randn(4, 3, 16, generator=gen, requires_grad=True)
        w = torch.randn(16, generator=gen, requires_grad=True)
        b = torch.randn(16, generator=gen, requires_grad=True)
        leaves = [x, w] + ([b] if which == "layer_norm" else [])
        bias = b if which == "layer_norm" else None
        fused = (lambda: ops.rms_norm(x, w, 1e-5)) if which == "rms_norm" else (lambda: ops.layer_norm(x, w, bias, 1e-5))
        ref = ((lambda: reference.rms_norm(x, w, 1e-5)) if which == "rms_norm"
               else (lambda: reference.layer_norm(x, w, bias, 1e-5)))
    dy = torch.randn(fused().shape, generator=gen, dtype=x.dtype)
    y = fused()
    assert "megalite_" in y.grad_fn.name(), y.grad_fn.name()
    got = torch.autograd.grad(y, leaves, dy)
    want_y = ref()
    want = torch.autograd.grad(want_y, leaves, dy)
    torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)
    for g, h in zip(got, want):
        torch.testing.assert_close(g, h, atol=1e-5, rtol=1e-5)


def test_a_double_backward_through_a_kernel_raises(kernel_path):
    x = torch.randn(1, 1, 3, 4, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(ops.scaled_causal_softmax(x, 1.0).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(g.sum(), x)


def fused_layer_compiles(rank, world):
    import torch._dynamo

    from megalite import parallel
    from megalite.models import preset
    from megalite.models.transformer import TransformerLayer, compile_layers
    from megalite.ops import build

    build._loaded = (CpuExtension(), build.KernelStatus(True, "CPU stand-in"))
    ops._extension_for = lambda *tensors: CpuExtension()
    parallel.initialize_model_parallel(world)
    config = preset("gpt-tiny", attention_backend="fused", norm_backend="fused")
    eager, compiled = TransformerLayer(config, 0, seed=3), TransformerLayer(config, 0, seed=3)
    torch._dynamo.reset()
    x = torch.randn(16, 2, config.hidden_size, generator=torch.Generator().manual_seed(1))
    explained = torch._dynamo.explain(compiled)(x, None)

    class Holder(torch.nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.layers = torch.nn.ModuleList([layer])

    compile_layers(Holder(compiled), backend="aot_eager")
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = eager(a, None), compiled(b, None)
    ya.square().sum().backward()
    yb.square().sum().backward()
    same = torch.allclose(ya, yb, atol=1e-6) and all(
        torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(eager.parameters(), compiled.parameters()))
    return explained.graph_break_count, explained.graph_count, same


def test_a_layer_on_the_fused_backends_compiles_without_graph_breaks_at_tp2():
    for breaks, graphs, same in run_ranks(fused_layer_compiles, 2):
        assert (breaks, graphs) == (0, 1)
        assert same
