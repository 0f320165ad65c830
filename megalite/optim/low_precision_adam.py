"""AdamW with its moments stored in bf16 (--use-precision-aware-optimizer --exp-avg-dtype bf16
--exp-avg-sq-dtype bf16, Megatron-LM's flags; Transformer Engine's FusedAdam does the same there).

Each step reads the stored moments as fp32, updates them and the fp32 master as PyTorch's AdamW
does (decoupled weight decay, bias corrections), and stores the moments back rounded to bf16: the
update uses the unrounded fp32 moments, as TE's kernel does. The masters stay fp32. A moment in fp32
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
                grad = master.grad if self.grad_scale is None else master.grad / self.grad_scale
                state = self.state[master]
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
                stored = [self._moment(state, "exp_avg", master), self._moment(state, "exp_avg_sq", master)]
                exp_avg, exp_avg_sq = (s.float() for s in stored)  # (fresh fp32 copies)
                step = state["step"] + 1
                weights = master.mul(1 - lr * wd)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias1 = 1 - torch.pow(beta1, step)
                bias2_sqrt = (1 - torch.pow(beta2, step)).sqrt()
                denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(eps)
                weights.sub_(exp_avg / denom * (lr / bias1))
                for into, value in ((master, weights), (stored[0], exp_avg), (stored[1], exp_avg_sq)):
                    into.copy_(value if skip is None else torch.where(skip > 0, into.float(), value))
                state["step"] = step if skip is None else state["step"] + (1 - skip)
        return None


def adamw(groups, *, lr: float, betas: tuple[float, float], eps: float, exp_avg_dtype: str = "fp32",
          exp_avg_sq_dtype: str = "fp32") -> torch.optim.Optimizer:
    """PyTorch's fused AdamW with fp32 moments, else LowPrecisionAdamW storing them as given ("fp32", "bf16")."""
    if exp_avg_dtype == exp_avg_sq_dtype == "fp32":
        # Fused on CPU too: one code path, and its `found_inf` input skips a step without a host sync.
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    return LowPrecisionAdamW(groups, lr=lr, betas=betas, eps=eps, exp_avg_dtype=dtypes[exp_avg_dtype],
                             exp_avg_sq_dtype=dtypes[exp_avg_sq_dtype])
