"""--deterministic-mode: the same numbers from every run of one command on one machine.

On CPU megalite's steps already are (a test checks it); on GPUs the nondeterminism lives in
kernels that sum with atomics in whatever order threads arrive and in NCCL algorithms that reduce
in the network. The mode therefore:

- turns on `torch.use_deterministic_algorithms(True)` (and cuDNN's deterministic choice): PyTorch's
  scatter-adds, index-adds and its flash-attention backward take their deterministic paths, and an
  operation with none raises instead of running. Inductor stops autotuning. Uninitialized memory is
  filled (NaN, integers' maximum), so a read of memory never written shows in the loss;
- sets `CUBLAS_WORKSPACE_CONFIG=:4096:8` on a GPU when it is unset (cuBLAS needs a fixed workspace to
  repeat a GEMM's sums; PyTorch refuses a GEMM without it);
- asks NCCL for an algorithm that reduces in a fixed order, as Megatron-LM does (NCCL_ALGO one of
  Tree, Ring, CollnetDirect, CollnetChain, ^NVLS): unset, it is set to ^NVLS (NCCL's own choice less
  NVLink SHARP, which reduces inside the switch); any other value is refused in one line.

megalite's own CUDA kernels (kernels/) use no atomics, and its MoE dispatch counts tokens in
integers (exact in any order). `CudaDeterminismAudit` checks on any device that a run reaches none
of the operations PyTorch cannot run deterministically on CUDA (tests/test_deterministic.py runs it
over the layouts)."""
from __future__ import annotations

import os
from collections.abc import MutableMapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megalite.errors import UsageError

NCCL_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")  # Megatron-LM's list
CUBLAS_CONFIGS = (":4096:8", ":16:8")  # the two cuBLAS documents as reproducible


def prepare_environment(env: MutableMapping[str, str], backend: str) -> list[str]:
    """Set or check the variables NCCL and cuBLAS read (before either starts: NCCL at its first
    communicator, cuBLAS at its first handle). Returns what was set, one phrase each; a value that
    cannot give repeatable sums ends the run with a UsageError naming the fix."""
    if backend != "nccl":  # gloo's ring reduces in a fixed order; no cuBLAS on CPU
        return []
    set_here = []
    algo = env.get("NCCL_ALGO")
    if algo is None:
        env["NCCL_ALGO"] = "^NVLS"
        set_here.append("NCCL_ALGO=^NVLS")
    elif algo not in NCCL_ALGOS:
        raise UsageError(f"--deterministic-mode: NCCL_ALGO={algo} may reduce in no fixed order: set it to one of "
                         f"{', '.join(NCCL_ALGOS)} (as Megatron-LM requires) or unset it (megalite then sets ^NVLS)")
    workspace = env.get("CUBLAS_WORKSPACE_CONFIG")
    if workspace is None:
        env["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_CONFIGS[0]
        set_here.append(f"CUBLAS_WORKSPACE_CONFIG={CUBLAS_CONFIGS[0]}")
    elif workspace not in CUBLAS_CONFIGS:
        raise UsageError(f"--deterministic-mode: CUBLAS_WORKSPACE_CONFIG={workspace} does not make cuBLAS "
                         f"repeatable: set it to {' or '.join(CUBLAS_CONFIGS)}, or unset it (megalite then sets "
                         f"{CUBLAS_CONFIGS[0]})")
    return set_here


def enable(backend: str, env: MutableMapping[str, str] | None = None) -> list[str]:
    """The mode for the rest of this process (before the process group starts). Returns what was
    set in the environment, for the run's note."""
    set_here = prepare_environment(os.environ if env is None else env, backend)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return set_here


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _arg(args, kwargs, index: int, name: str, default=None):
    return args[index] if len(args) > index else kwargs.get(name, default)


# The operations torch.use_deterministic_algorithms lists as raising on CUDA (PyTorch 2.13's
# docstring), by aten name: when each call is one (its arguments and result), else always.
_ALWAYS = ("histc", "put", "avg_pool3d_backward", "adaptive_avg_pool2d_backward",
           "adaptive_avg_pool3d_backward", "adaptive_max_pool2d_backward", "fractional_max_pool2d_backward",
           "fractional_max_pool3d_backward", "max_unpool2d", "max_unpool3d", "upsample_linear1d_backward",
           "upsample_bilinear2d_backward", "upsample_bicubic2d_backward", "upsample_trilinear3d_backward",
           "reflection_pad1d_backward", "reflection_pad2d_backward", "reflection_pad3d_backward",
           "grid_sampler_2d_backward", "grid_sampler_3d_backward", "ctc_loss_backward")
_WHEN = {
    "cumsum": lambda args, kwargs, out: _floating(out),
    "bincount": lambda args, kwargs, out: _arg(args, kwargs, 1, "weights") is not None,
    "median": lambda args, kwargs, out: isinstance(out, tuple),  # with indices
    "nll_loss2d_forward": lambda args, kwargs, out: _arg(args, kwargs, 3, "reduction", 1) != 0,
    "nll_loss2d": lambda args, kwargs, out: _arg(args, kwargs, 3, "reduction", 1) != 0,
    "scatter_reduce": lambda args, kwargs, out: _arg(args, kwargs, 4, "reduce") == "prod",
    "embedding_bag": lambda args, kwargs, out: _arg(args, kwargs, 4, "mode", 0) == 2,  # max
}


def _name(func) -> str:
    return func.overloadpacket.__name__.strip("_")


class CudaDeterminismAudit(TorchDispatchMode):
    """Inside it (this thread), every operation that would raise on CUDA under
    --deterministic-mode is recorded in `found` (aten name -> calls), on whatever device it runs:
    so a CPU run proves the GPU run will not stop on one. `operations` counts every name seen."""

    def __init__(self):
        super().__init__()
        self.found: dict[str, int] = {}
        self.operations: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _name(func)
        self.operations[name] = self.operations.get(name, 0) + 1
        when = _WHEN.get(name)
        if (name in _ALWAYS and when is None) or (when is not None and when(args, kwargs, out)):
            self.found[name] = self.found.get(name, 0) + 1
        return out
