"""AdamW with its moments stored in bf16 (--use-precision-aware-optimizer --exp-avg-dtype bf16
--exp-avg-sq-dtype bf16, Megatron-LM's flags; Transformer Engine's FusedAdam does the same there).

Each step reads the stored moments as fp32, updates them and the fp32 master with PyTorch's own
fused AdamW kernel (decoupled weight decay, bias corrections), and stores the moments back rounded
to bf16: the update uses the unrounded fp32 moments, as TE's kernel does. The masters stay fp32. A moment in fp32
is kept as it is (one may be bf16 and the other fp32). Half the bytes of Adam's states per stored
bf16 moment; a step with inf/NaN gradients is skipped on the device (`found_inf`), and the clip rides
in as `grad_scale`, as in the fused AdamW it replaces: no host sync.
"""
from __future__ import annotations

import torch


class LowPrecisionAdamW(torch.optim.Optimizer):
    def __init__(self, groups, *, lr: float, betas: tuple[float, float], eps: float,
                 exp_avg_dtype: torch.dtype, exp_avg_sq_dtype: torch.dtype):
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        self.state_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        self.grad_scale = self.found_inf = None
        self.defaults["fused"] = True  # (MegaliteOptimizer: skip and clip on the device, as the fused AdamW)

    def _moment(self, state: dict, name: str, master: torch.Tensor) -> torch.Tensor:
        """The stored moment in its dtype (a loaded fp32 one converted once)."""
        dtype = self.state_dtypes[name]
        if name not in state:
            state[name] = torch.zeros_like(master, dtype=dtype)
        elif state[name].dtype != dtype:
            state[name] = state[name].to(dtype)
        return state[name]

    @torch.no_grad()
    def step(self, closure=None):
        skip = self.found_inf
        for group in self.param_groups:
            lr, wd, eps, (beta1, beta2) = group["lr"], group["weight_decay"], group["eps"], group["betas"]
            for master in group["params"]:
                if master.grad is None:
                    continue
                state = self.state[master]
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
                step = state["step"] + 1
                stored = [self._moment(state, "exp_avg", master).view(-1),
                          self._moment(state, "exp_avg_sq", master).view(-1)]
                flat, grads = master.view(-1), master.grad.reshape(-1)
                # A chunk at a time: the fp32 temporaries stay a few chunks' (not the largest master's) size
                for lo in range(0, flat.numel(), _CHUNK):
                    part = slice(lo, lo + _CHUNK)
                    self._update(flat[part], grads[part], stored[0][part], stored[1][part], lr, wd, eps, beta1, beta2,
                                 step, skip)
                state["step"] = step if skip is None else state["step"] + (1 - skip)
        return None

    def _update(self, weights, grad, m_stored, v_stored, lr, wd, eps, beta1, beta2, step, skip):
        m, v = m_stored.float(), v_stored.float()  # fresh fp32 copies
        if _FUSED is not None:  # PyTorch's fused AdamW kernel on them: its numbers, skip and clip
            _FUSED([weights], [grad], [m], [v], [], [step], lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd,
                   eps=eps, amsgrad=False, maximize=False, grad_scale=self.grad_scale, found_inf=skip)
        else:
            self._unfused(weights, grad, m, v, lr, wd, eps, beta1, beta2, step, skip)
        m_stored.copy_(m)  # (a skipped step leaves m and v as read: bf16 -> fp32 -> bf16 is exact)
        v_stored.copy_(v)

    def _unfused(self, weights, grad, m, v, lr, wd, eps, beta1, beta2, step, skip):
        grad = grad if self.grad_scale is None else grad / self.grad_scale
        m_read, v_read = (m.clone(), v.clone()) if skip is not None else (m, v)
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias1, bias2_sqrt = 1 - torch.pow(beta1, step), (1 - torch.pow(beta2, step)).sqrt()
        update = v.sqrt().div_(bias2_sqrt).add_(eps)  # the denominator, then the step
        update = torch.div(m, update, out=update).mul_(lr / bias1)
        update.add_(weights, alpha=lr * wd)  # + lr wd w: the decoupled decay
        if skip is not None:  # a skipped step moves nothing (inf/NaN become zero steps)
            keep = skip > 0
            update = torch.where(keep, 0.0, update)
            m.copy_(torch.where(keep, m_read, m))
            v.copy_(torch.where(keep, v_read, v))
        weights.sub_(update)


_FUSED = getattr(torch, "_fused_adamw_", None)  # (a private op: where a PyTorch lacks it, the passes above)
_CHUNK = 1 << 24  # elements of a master updated at once


def adamw(groups, *, lr: float, betas: tuple[float, float], eps: float, exp_avg_dtype: str = "fp32",
          exp_avg_sq_dtype: str = "fp32") -> torch.optim.Optimizer:
    """PyTorch's fused AdamW with fp32 moments, else LowPrecisionAdamW storing them as given ("fp32", "bf16")."""
    if exp_avg_dtype == exp_avg_sq_dtype == "fp32":
        # Fused on CPU too: one code path, and its `found_inf` input skips a step without a host sync.
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    return LowPrecisionAdamW(groups, lr=lr, betas=betas, eps=eps, exp_avg_dtype=dtypes[exp_avg_dtype],
                             exp_avg_sq_dtype=dtypes[exp_avg_sq_dtype])
