"""megalite.ops on the CPU: the PyTorch paths against float64 references, the model's fused
backends against its explicit ones, compiled layers against eager ones, the self-check (the build
logic: tests/test_ops_build.py).
The CUDA kernels themselves are checked on the GPU by tests/test_gpu.py against the same references."""
import pytest
import torch

from helpers import fresh_seed
from megalite import ops


# -- float64 references, written from the definitions -------------------------------------------

def softmax64(x, hidden, scale):
    """softmax over the visible keys, 0 on hidden ones and on rows with none visible."""
    s = x.double() * scale
    e = torch.where(hidden, torch.zeros_like(s), torch.exp(s - s.masked_fill(hidden, -1e300).amax(-1, keepdim=True)))
    total = e.sum(-1, keepdim=True)
    return torch.where(total > 0, e / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(e))


def softmax64_backward(y, dy, scale):
    y, dy = y.double(), dy.double()
    return scale * y * (dy - (dy * y).sum(-1, keepdim=True))


def layer_norm64(x, w, b, eps, rms=False):
    x = x.double()
    mean = torch.zeros_like(x[..., :1]) if rms else x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps) * w.double()
    return y if b is None else y + b.double()


TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float64: 1e-12}


def _scores(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(shape, generator=g)).to(dtype).requires_grad_(True), torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mask_batch", [1, 2])
def test_masked_softmax_matches_float64(dtype, mask_batch):
    seed = fresh_seed()
    x, dy = _scores((2, 3, 5, 37), dtype, seed)
    hidden = torch.rand(mask_batch, 1, 5, 37, generator=torch.Generator().manual_seed(seed + 1)) < 0.4
    hidden[0, 0, 2] = True  # a row with every key hidden
    y = ops.scaled_masked_softmax(x, hidden, 0.7)
    assert y.dtype == dtype and y.shape == x.shape
    want = softmax64(x.detach(), hidden, 0.7)
    torch.testing.assert_close(y.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(y[:, :, 2][0], torch.zeros_like(y[:, :, 2][0])), "a fully hidden row must be zeros"
    y.backward(dy)
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(x.grad.double(), softmax64_backward(want, dy, 0.7), atol=4 * TOL[dtype],
                               rtol=4 * TOL[dtype])


def test_padding_mask_broadcasts_over_heads_and_queries():
    x, _ = _scores((2, 4, 6, 6), torch.float32, fresh_seed())
    keys_hidden = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])[:, None, None, :]  # [b, 1, 1, sk]
    y = ops.scaled_masked_softmax(x, keys_hidden, 1.0)
    # fp32 against float64: fp32's tolerance (a float64 comparison's default 1e-7 fails on some seeds)
    torch.testing.assert_close(y.double(), softmax64(x.detach(), keys_hidden.expand(2, 1, 6, 6), 1.0),
                               atol=TOL[torch.float32], rtol=TOL[torch.float32])
    assert torch.all(y[1, ..., 4:] == 0)


def test_unmasked_softmax_is_plain_softmax():
    x, _ = _scores((1, 2, 3, 9), torch.float32, fresh_seed())
    torch.testing.assert_close(ops.scaled_masked_softmax(x, None, 0.3), torch.softmax(x * 0.3, -1))


@pytest.mark.parametrize("sq,sk", [(7, 7), (3, 8)])
def test_causal_softmax_hides_later_keys(sq, sk):
    x, dy = _scores((2, 2, sq, sk), torch.float32, fresh_seed())
    y = ops.scaled_causal_softmax(x, 0.5)
    hidden = torch.ones(sq, sk, dtype=torch.bool).triu(1)  # key k > query q, top-left aligned like SDPA
    want = softmax64(x.detach(), hidden[None, None], 0.5)
    torch.testing.assert_close(y.double(), want, atol=2e-6, rtol=2e-6)
    y.backward(dy)
    torch.testing.assert_close(x.grad.double(), softmax64_backward(want, dy, 0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask,message", [
    (torch.zeros(2, 3, 5, 7, dtype=torch.bool), "does not broadcast"),
    (torch.zeros(2, 1, 4, 7, dtype=torch.bool), "does not broadcast"),
    (torch.zeros(3, 1, 5, 7, dtype=torch.bool), "does not broadcast"),
    (torch.zeros(2, 1, 5, 7), "must be bool"),
])
def test_bad_masks_are_clear_errors(mask, message):
    with pytest.raises(ValueError, match=message):
        ops.scaled_masked_softmax(torch.zeros(2, 3, 5, 7), mask, 1.0)
    with pytest.raises(ValueError, match=r"\[batch, heads, sq, sk\]"):
        ops.scaled_causal_softmax(torch.zeros(5, 7), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rms,with_bias", [(False, True), (False, False), (True, False)])
def test_norms_match_float64(dtype, rms, with_bias):
    g = torch.Generator().manual_seed(fresh_seed())
    x = (2 + 3 * torch.randn(4, 3, 45, generator=g)).to(dtype).requires_grad_(True)
    w = (1 + 0.2 * torch.randn(45, generator=g)).to(dtype).requires_grad_(True)
    b = (0.2 * torch.randn(45, generator=g)).to(dtype).requires_grad_(True) if with_bias else None
    dy = torch.randn(4, 3, 45, generator=g).to(dtype)
    y = ops.rms_norm(x, w, 1e-5) if rms else ops.layer_norm(x, w, b, 1e-5)
    assert y.dtype == dtype
    leaves = [x, w] + ([b] if with_bias else [])
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    b64 = b.detach().double().requires_grad_(True) if with_bias else None
    want = layer_norm64(x64, w64, b64, 1e-5, rms)
    tol = TOL[dtype] * (1 if dtype == torch.float32 else 2)
    torch.testing.assert_close(y.double(), want.detach(), atol=tol, rtol=tol)
    grads = torch.autograd.grad(y, leaves, dy)
    want_grads = torch.autograd.grad(want, [x64, w64] + ([b64] if with_bias else []), dy.double())
    for got, ref, name in zip(grads, want_grads, ["x", "weight", "bias"]):
        scale = ref.abs().max().item() or 1.0  # weight/bias grads are sums over rows
        torch.testing.assert_close(got.double() / scale, ref / scale, atol=8 * tol, rtol=0, msg=f"grad of {name}")


def test_norm_shape_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"weight \(5,\).*\(2, 4\)"):
        ops.layer_norm(torch.zeros(2, 4), torch.ones(5), None, 1e-5)


# -- the model's fused backends equal its explicit ones ----------------------------------------------

def _attention_inputs(seed, b=2, heads=3, s=8, d=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, heads, s, d, generator=g, requires_grad=True) for _ in range(3)]


@pytest.mark.parametrize("case", ["causal", "bidirectional", "padding"])
def test_fused_softmax_attention_equals_explicit_attention(case):
    from megalite.models.attention import _explicit_attention, _fused_softmax_attention
    seed = fresh_seed()
    allowed = None
    if case == "padding":
        allowed = torch.ones(2, 1, 1, 8, dtype=torch.bool)
        allowed[1, ..., 5:] = False
    causal = case == "causal"
    outs, grads = [], []
    for fn in (_explicit_attention, _fused_softmax_attention):
        q, k, v = _attention_inputs(seed)
        out = fn(q, k, v, allowed, 0.0, causal)
        out.square().sum().backward()
        outs.append(out)
        grads.append([t.grad for t in (q, k, v)])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-5)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _gpt_backends(rank, world, seed):
    return _gpt_backends_on(rank, world, seed, "cpu")


def _gpt_backends_on(rank, world, seed, device):
    from megalite import parallel
    from megalite.models import GPTModel, TransformerConfig
    parallel.initialize_model_parallel(1)
    out = {}
    for attn, norm in (("torch", "torch"), ("fused", "auto"), ("fused", "fused")):
        parallel.model_parallel_manual_seed(seed)
        config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                                   max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
                                   attention_backend=attn, norm_backend=norm)
        model = GPTModel(config, seed=seed, device=device)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed)).to(device)
        loss = model(ids, labels=ids.roll(-1, 1)).mean()
        loss.backward()
        out[attn, norm] = (loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()})
    return out


def test_gpt_with_fused_backends_equals_torch_backends():
    out = __import__("megalite.testing", fromlist=["run_ranks"]).run_ranks(_gpt_backends, 1, args=(fresh_seed(),))[0]
    ref_loss, ref_grads = out["torch", "torch"]
    for key in (("fused", "auto"), ("fused", "fused")):
        loss, grads = out[key]
        torch.testing.assert_close(loss, ref_loss, atol=0, rtol=1e-6)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, atol=1e-7, rtol=1e-5, msg=f"{name} with {key}")


def _compiled_vs_eager(rank, world, seed):
    import torch._dynamo  # noqa: F401 - for its counters

    from megalite import parallel
    from megalite.models import GPTModel, TransformerConfig, compile_layers
    parallel.initialize_model_parallel(1)
    out = []
    for compiled in (False, True):
        parallel.model_parallel_manual_seed(seed)
        config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                                   max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
        model = GPTModel(config, seed=seed)
        names = [n for n, _ in model.named_parameters()]
        if compiled:
            compile_layers(model, backend="aot_eager")  # dynamo + AOT autograd, no code generation
            assert [n for n, _ in model.named_parameters()] == names, "compiling must not rename parameters"
            assert model.layers[0].input_layernorm.backend == "torch", "auto norms compile as F.layer_norm"
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))
        loss = model(ids, labels=ids.roll(-1, 1)).mean()
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return out, graphs


def test_compiled_layers_equal_eager_layers():
    from megalite.testing import run_ranks
    (eager, compiled), graphs = run_ranks(_compiled_vs_eager, 1, args=(fresh_seed(),), timeout=300)[0]
    assert graphs >= 1, "the layers were not compiled"
    torch.testing.assert_close(compiled[0], eager[0], atol=0, rtol=1e-6)
    for name, g in eager[1].items():
        torch.testing.assert_close(compiled[1][name], g, atol=1e-7, rtol=1e-5, msg=name)


class _ReferenceExtension:
    """The compiled extension's interface computed on the PyTorch path, so the self-check's
    logic runs on a CPU. norm_backward's partial sums come back as one [1, h] block."""

    def softmax_forward(self, x, mask, scale, causal):
        from megalite.ops import reference

        return reference.scaled_causal_softmax(x, scale) if causal else reference.scaled_masked_softmax(x, mask, scale)

    def softmax_backward(self, dy, y, scale, causal):
        yf, dyf = y.float(), dy.float()
        return (scale * yf * (dyf - (dyf * yf).sum(-1, keepdim=True))).to(y.dtype)

    def norm_forward(self, x, w, b, eps, rms):
        xf = x.float()
        mean = torch.zeros_like(xf[..., 0]) if rms else xf.mean(-1)
        var = xf.pow(2).mean(-1) if rms else (xf - mean[..., None]).pow(2).mean(-1)
        rstd = torch.rsqrt(var + eps)
        y = (xf - mean[..., None]) * rstd[..., None] * w.float() + (0 if b is None else b.float())
        return y.to(x.dtype), mean, rstd

    def norm_backward(self, dy, x, w, mean, rstd, rms):
        xhat = (x.float() - mean[..., None]) * rstd[..., None]
        g = dy.float() * w.float()
        inner = g - (g * xhat).mean(-1, keepdim=True) * xhat
        if not rms:
            inner = inner - g.mean(-1, keepdim=True)
        dx = (rstd[..., None] * inner).to(x.dtype)
        return dx, (dy.float() * xhat).sum(0, keepdim=True), dy.float().sum(0, keepdim=True)


class _WrongNormGradient(_ReferenceExtension):
    def norm_backward(self, *args):
        dx, dw, db = super().norm_backward(*args)
        return dx * 1.5, dw, db


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_self_check_passes_when_first_called_under_no_grad_or_inference_mode(mode):
    from megalite.ops.selfcheck import self_check

    with mode():
        assert self_check(_ReferenceExtension(), device="cpu") is None
        assert "layer_norm, hidden=100, torch.float32: backward dx" == self_check(_WrongNormGradient(), device="cpu")
    assert self_check(_ReferenceExtension(), device="cpu") is None
