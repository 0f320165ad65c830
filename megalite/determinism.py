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
- asks NCCL for an algorithm that reduces in a fixed order. Megatron-LM accepts NCCL_ALGO one of
  Tree, Ring, CollnetDirect, CollnetChain, ^NVLS; megalite keeps Ring and ^NVLS and refuses the
  other three in one line, since NCCL has no Tree (nor, without the SHARP plugin, CollNet)
  all-gather, reduce-scatter or broadcast, which megalite runs: the run would stop at its first.
  Unset, it is set to Ring (always available, one fixed order).

megalite's own CUDA kernels (kernels/) use no atomics, and its MoE dispatch counts tokens in
integers (exact in any order). `CudaDeterminismAudit` checks on any device that a run reaches none
of the operations PyTorch cannot run deterministically on CUDA (tests/test_deterministic.py runs it
over the layouts)."""
from __future__ import annotations

import contextlib
import os
from collections.abc import MutableMapping

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megalite.errors import UsageError

MEGATRON_NCCL_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")  # Megatron-LM's list
NCCL_ALGOS = ("Ring", "^NVLS")  # of those, the ones with every collective megalite runs
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
        env["NCCL_ALGO"] = "Ring"
        set_here.append("NCCL_ALGO=Ring")
    elif algo in MEGATRON_NCCL_ALGOS and algo not in NCCL_ALGOS:
        raise UsageError(f"--deterministic-mode: NCCL_ALGO={algo} leaves NCCL no algorithm for the all-gathers, "
                         f"reduce-scatters and broadcasts megalite runs: set it to Ring or ^NVLS, or unset it "
                         f"(megalite then sets Ring)")
    elif algo not in NCCL_ALGOS:
        raise UsageError(f"--deterministic-mode: NCCL_ALGO={algo} may reduce in no fixed order: set it to Ring or "
                         f"^NVLS (of Megatron-LM's {', '.join(MEGATRON_NCCL_ALGOS)}), or unset it (megalite then "
                         f"sets Ring)")
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
    """The mode (before the process group starts), until `scoped` restores what was before. Returns
    what was set in the environment, for the run's note; a process group already started with NCCL
    read NCCL_ALGO before it was set, which the note says."""
    set_here = prepare_environment(os.environ if env is None else env, backend)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if backend == "nccl" and dist.is_initialized() and "NCCL_ALGO=Ring" in set_here:
        set_here[set_here.index("NCCL_ALGO=Ring")] += " (too late for the process group already started)"
    return set_here


@contextlib.contextmanager
def scoped():
    """A run: whatever `enable` switches inside is switched back after it (PyTorch's flags and the
    two variables), so a later run in the process without the flag runs as it would alone."""
    state = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             {k: os.environ.get(k) for k in ("NCCL_ALGO", "CUBLAS_WORKSPACE_CONFIG")})
    try:
        yield
    finally:
        algorithms, warn_only, cudnn_deterministic, cudnn_benchmark, env = state
        torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_deterministic, cudnn_benchmark
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def prefix_sums(x: torch.Tensor, block: int = 256) -> torch.Tensor:
    """x.cumsum(-1); under deterministic algorithms, where PyTorch refuses a floating-point cumsum
    on CUDA, the same sums by triangular matmuls in blocks of `block` (which cuBLAS repeats; they
    differ from cumsum's in rounding only)."""
    if not torch.are_deterministic_algorithms_enabled() or not x.is_floating_point():
        return x.cumsum(-1)
    *lead, v = x.shape
    n = -(-v // block)
    blocks = torch.nn.functional.pad(x, (0, n * block - v)).reshape(*lead, n, block)
    within = blocks @ torch.ones(block, block, dtype=x.dtype, device=x.device).triu()  # inclusive, per block
    before = within[..., -1] @ torch.ones(n, n, dtype=x.dtype, device=x.device).triu(1)  # the blocks before
    return (within + before.unsqueeze(-1)).reshape(*lead, n * block)[..., :v]


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _arg(args, kwargs, index: int, name: str, default=None):
    return args[index] if len(args) > index else kwargs.get(name, default)


# The operations that raise on CUDA in the mode, by aten name: when each call is one (its arguments
# and result), else always. torch.use_deterministic_algorithms' docstring (PyTorch 2.13) lists most;
# its CUDA sources add nanmedian and kthvalue (as median), index_reduce, the antialiased upsampling
# backwards and scatter's multiply. Left out: resize_ of quantized tensors (megalite has none).
_ALWAYS = ("histc", "put", "kthvalue", "index_reduce", "upsample_bilinear2d_aa_backward",
           "upsample_bicubic2d_aa_backward", "avg_pool3d_backward", "adaptive_avg_pool2d_backward",
           "adaptive_avg_pool3d_backward", "adaptive_max_pool2d_backward", "fractional_max_pool2d_backward",
           "fractional_max_pool3d_backward", "max_unpool2d", "max_unpool3d", "upsample_linear1d_backward",
           "upsample_bilinear2d_backward", "upsample_bicubic2d_backward", "upsample_trilinear3d_backward",
           "reflection_pad1d_backward", "reflection_pad2d_backward", "reflection_pad3d_backward",
           "grid_sampler_2d_backward", "grid_sampler_3d_backward", "ctc_loss_backward")
_WHEN = {
    "cumsum": lambda args, kwargs, out: _floating(out),
    "bincount": lambda args, kwargs, out: _arg(args, kwargs, 1, "weights") is not None,
    "median": lambda args, kwargs, out: isinstance(out, tuple),  # with indices
    "nanmedian": lambda args, kwargs, out: isinstance(out, tuple),
    "scatter": lambda args, kwargs, out: _arg(args, kwargs, 4, "reduce") == "multiply",
    "nll_loss2d_forward": lambda args, kwargs, out: _arg(args, kwargs, 3, "reduction", 1) != 0,
    "nll_loss2d": lambda args, kwargs, out: _arg(args, kwargs, 3, "reduction", 1) != 0,
    "scatter_reduce": lambda args, kwargs, out: _arg(args, kwargs, 4, "reduce") == "prod",
    "embedding_bag": lambda args, kwargs, out: _arg(args, kwargs, 4, "mode", 0) == 2,  # max
}


def _name(func) -> str:
    return func.overloadpacket.__name__.strip("_")


class CudaDeterminismAudit(TorchDispatchMode):
    """Inside it, every operation that would raise on CUDA under --deterministic-mode is recorded in
    `found` (aten name -> calls), on whatever device it runs: a CPU run shows what a GPU run of the
    same code would reach. `operations` counts every name seen. It sees this thread's operations
    only (not the forward lane of --overlap-moe-expert-parallel-comm), and the code a CPU takes
    (not the CUDA-only kernels: megalite's fused ones, grouped GEMMs, varlen flash attention)."""

    def __init__(self):
        super().__init__()
        self.found: dict[str, int] = {}
        self.operations: dict[str, int] = {}
        self.under_the_mode = 0  # operations run with PyTorch's deterministic algorithms on

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _name(func)
        self.operations[name] = self.operations.get(name, 0) + 1
        self.under_the_mode += torch.are_deterministic_algorithms_enabled()
        when = _WHEN.get(name)
        if (name in _ALWAYS and when is None) or (when is not None and when(args, kwargs, out)):
            self.found[name] = self.found.get(name, 0) + 1
        return out
