"""Shared test helpers: tolerances and gathering TP shards back into full tensors."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megalite import parallel


def fresh_seed() -> int:
    """A new seed every run, so equivalence is shown on inputs nobody chose."""
    return int.from_bytes(os.urandom(4), "little")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def assert_rel_close(a, b, tol=1e-5, what="tensor"):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = rel_err(a, b)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


def gather_tp(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Concatenate each TP rank's `t` along `dim`."""
    tp = parallel.get_tensor_model_parallel_world_size()
    if tp == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.detach().contiguous(), group=parallel.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


def tp_slice(t: torch.Tensor, dim: int) -> torch.Tensor:
    tp, rank = parallel.get_tensor_model_parallel_world_size(), parallel.get_tensor_model_parallel_rank()
    return t.chunk(tp, dim=dim)[rank]
