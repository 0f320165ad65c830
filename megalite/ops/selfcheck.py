"""A few-millisecond check, run once after the kernels load, that each of them agrees with the
PyTorch path on small inputs: a broken build or driver falls back instead of training on wrong
numbers."""
from __future__ import annotations

import torch

from megalite.ops import reference


def self_check(ext, device="cuda") -> str | None:
    """None when every kernel agrees with the reference, else what disagreed. The first kernel
    call may come from evaluation under no_grad / inference_mode, while the check differentiates
    the reference: it runs with autograd on, whatever the caller's mode."""
    with torch.inference_mode(False), torch.enable_grad():
        return _compare(ext, torch.device(device))


def _compare(ext, dev: torch.device) -> str | None:
    g = torch.Generator(device=dev).manual_seed(0)
    # Odd and vector-friendly sizes, a warp-per-row and a block-per-row configuration.
    for sk, dtype, tol in ((77, torch.float32, 1e-5), (1024, torch.float32, 1e-5), (640, torch.bfloat16, 1e-2),
                           (333, torch.float16, 2e-3)):
        x = torch.randn(2, 3, 5, sk, device=dev, generator=g).to(dtype)
        dy = torch.randn(2, 3, 5, sk, device=dev, generator=g).to(dtype)
        masks = [torch.rand(2, 1, 5, sk, device=dev, generator=g) < 0.3,   # per batch and query
                 torch.rand(1, 1, 1, sk, device=dev, generator=g) < 0.3]   # broadcast over both
        masks[0][0, 0, 1] = True  # one row with every key hidden
        for causal, m in ((True, None), (False, masks[0]), (False, masks[1]), (False, None)):
            y = ext.softmax_forward(x, m, 0.5, causal)
            want = reference.scaled_causal_softmax(x, 0.5) if causal else reference.scaled_masked_softmax(x, m, 0.5)
            if not torch.allclose(y.float(), want.float(), atol=tol, rtol=tol):
                return f"softmax forward, sk={sk}, {dtype}, causal={causal}"
            dx = ext.softmax_backward(dy, y, 0.5, causal)
            yf = y.float()
            want_dx = 0.5 * yf * (dy.float() - (dy.float() * yf).sum(-1, keepdim=True))
            if not torch.allclose(dx.float(), want_dx, atol=tol, rtol=tol):
                return f"softmax backward, sk={sk}, {dtype}, causal={causal}"
    for h, dtype, tol in ((100, torch.float32, 1e-4), (1024, torch.float32, 1e-4), (2048, torch.bfloat16, 5e-2),
                          (96, torch.float16, 1e-2)):
        x = torch.randn(37, h, device=dev, generator=g).to(dtype)
        w = (1 + 0.1 * torch.randn(h, device=dev, generator=g)).to(dtype)
        b = (0.1 * torch.randn(h, device=dev, generator=g)).to(dtype)
        dy = torch.randn(37, h, device=dev, generator=g).to(dtype)
        for rms in (False, True):
            y, mean, rstd = ext.norm_forward(x, w, None if rms else b, 1e-5, rms)
            leaves = [t.float().requires_grad_(True) for t in ((x, w) if rms else (x, w, b))]
            want = reference.rms_norm(*leaves, 1e-5) if rms else reference.layer_norm(*leaves, 1e-5)
            what = f"{'rms' if rms else 'layer'}_norm, hidden={h}, {dtype}"
            if not torch.allclose(y.float(), want.detach(), atol=tol, rtol=tol):
                return f"{what}: forward"
            want_grads = torch.autograd.grad(want, leaves, dy.float())
            dx, dw_part, db_part = ext.norm_backward(dy, x, w, mean, rstd, rms)
            got = [dx.float(), dw_part.sum(0)] + ([] if rms else [db_part.sum(0)])
            for name, a, e in zip(("dx", "dw", "db"), got, want_grads):
                scale = e.abs().max().clamp_min(1.0)
                if not torch.allclose(a / scale, e / scale, atol=4 * tol, rtol=0):
                    return f"{what}: backward {name}"
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return None
