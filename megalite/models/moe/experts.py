"""A rank's local experts as one grouped matrix multiply.

Each local expert's weights are one slice of a 3-D parameter: fc1 [local experts, rows, hidden]
(a gated expert's rows: its gate rows, then its up rows, each split over expert tensor parallelism
like `ColumnParallelLinear(partition_blocks=2)`), fc2 [local experts, hidden, ffn / ETP] (columns
split like `RowParallelLinear`). Tokens arrive sorted by expert with a count per expert; the
output is partial over ETP (the dispatcher sums it). Initialization is layout-free: every rank
draws the full [experts, ...] tensors from the same generator and keeps its experts and its ETP
part of each, so any (EP, ETP) builds the same model from one seed.

`grouped_linear` is the one multiply: PyTorch's grouped GEMM (`torch.nn.functional.grouped_mm`)
where the device runs it (CUDA, bf16), and elsewhere a loop of GEMMs over the experts' row blocks,
written in place, whose backward fills one weight-gradient tensor (no per-expert full-size zeros).
"""
from __future__ import annotations

import torch
from torch import nn

from megalite.models.config import TransformerConfig
from megalite.models.mlp import activation_function, glu_function
from megalite.models.rng import weight_init
from megalite.parallel import state, weight_grad
from megalite.parallel.fp8_linear import FP8Linear, amax_groups, fp8_grouped_linear
from megalite.parallel.layers import default_device, init_device, tp_shard


def _grouped_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """PyTorch's grouped GEMM runs here (else the loop): CUDA bf16 on compute capability 8.0 or newer,
    or a CPU in fp32 (measured: 0.99 of the loop's time at the tiny shape, 0.91 at 124m,
    scripts/benchmark_moe_layer.py --compare grouped); rows of 16-byte multiples; some rows at all."""
    if not (hasattr(torch.nn.functional, "grouped_mm") and x.shape[0] > 0 and x.dtype == weight.dtype
            and all(n * weight.element_size() % 16 == 0 for n in weight.shape[1:])):
        return False
    if x.is_cuda:
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    # torch's meta function for grouped_mm accepts bf16 only, so a compiled graph keeps the loop
    return x.device.type == "cpu" and x.dtype == torch.float32 and not torch.compiler.is_compiling()


def _offsets(counts: list[int], device) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32).to(device, non_blocking=True)


def _multiply(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    if _grouped_mm_applies(x, weight):
        return torch.nn.functional.grouped_mm(x, weight.transpose(1, 2), offs=_offsets(counts, x.device))
    out = x.new_empty((x.shape[0], weight.shape[1]))
    for e, (xe, ye) in enumerate(zip(x.split(counts), out.split(counts))):
        if ye.shape[0]:
            torch.mm(xe, weight[e].t(), out=ye)
    return out


def _input_gradient(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    if _grouped_mm_applies(x, weight):
        return torch.nn.functional.grouped_mm(grad, weight, offs=_offsets(counts, x.device))
    grad_x = grad.new_empty(x.shape)
    for e, (ge, gxe) in enumerate(zip(grad.split(counts), grad_x.split(counts))):
        if ge.shape[0]:
            torch.mm(ge, weight[e], out=gxe)
    return grad_x


def _weight_gradient(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """dW[e] = grad[rows of e]^T x[rows of e]."""
    if _grouped_mm_applies(x, weight):
        return torch.nn.functional.grouped_mm(grad.t(), x, offs=_offsets(counts, x.device))
    grad_w = torch.empty_like(weight)
    for e, (ge, xe) in enumerate(zip(grad.split(counts), x.split(counts))):
        if ge.shape[0]:
            torch.mm(ge.t(), xe, out=grad_w[e])
        else:  # an expert no token reached: a zero gradient
            grad_w[e].zero_()
    return grad_w


class _GroupedLinear(torch.autograd.Function):
    """y[rows of e] = x[rows of e] @ weight[e]^T for each expert e (weight [E, out, in])."""

    @staticmethod
    def forward(ctx, x, weight, counts):
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.used = counts, weight
        return _multiply(x, weight, counts)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        counts, grad = ctx.counts, grad.contiguous()
        grad_x = _input_gradient(grad, x, weight, counts) if ctx.needs_input_grad[0] else None
        return grad_x, weight_grad.give(ctx.used, ctx.needs_input_grad[1],
                                        lambda: _weight_gradient(grad, x, weight, counts), (grad,)), None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """x [sum(counts), in] sorted by expert, weight [E, out, in] -> [sum(counts), out]."""
    return _GroupedLinear.apply(x, weight, list(counts))


class SharedGradient:
    """One weight's gradient over the groups of a chunked dispatch (megalite.models.moe.chunked): each
    group's backward leaves its rows and their output gradients here, and the last group to run
    computes the whole weight's gradient from all of them at once: the rows joined in expert order
    are the unchunked layer's, so this is the unchunked GEMM, bit for bit (the others hand autograd
    nothing). Handing each group's slice to autograd instead made it build and add a zero-filled
    full-size gradient per group; filling a slice per group cost a copy of the weight."""

    def __init__(self, groups: int):
        self.left, self.parts = groups, []

    def add(self, weight: torch.Tensor, lo: int, x: torch.Tensor, grad: torch.Tensor,
            counts: list[int]) -> torch.Tensor | None:
        self.parts.append((lo, x, grad, counts))
        self.left -= 1
        if self.left:
            return None
        parts, self.parts = sorted(self.parts, key=lambda part: part[0]), []
        x = torch.cat([part[1] for part in parts])
        grad = torch.cat([part[2] for part in parts])
        return _weight_gradient(grad, x, weight, [n for part in parts for n in part[3]])


class _GroupedLinearOfGroup(torch.autograd.Function):
    """`_GroupedLinear` over local experts lo..hi-1 of `weight` (their slice, the same GEMMs); the
    weight's gradient through `shared`."""

    @staticmethod
    def forward(ctx, x, weight, counts, lo, hi, shared):
        part = weight[lo:hi]
        ctx.save_for_backward(x, part)
        ctx.counts, ctx.used, ctx.group = counts, weight, (lo, shared)
        return _multiply(x, part, counts)

    @staticmethod
    def backward(ctx, grad):
        x, part = ctx.saved_tensors
        (lo, shared), counts, grad = ctx.group, ctx.counts, grad.contiguous()
        grad_x = _input_gradient(grad, x, part, counts) if ctx.needs_input_grad[0] else None
        used = ctx.used
        grad_w = weight_grad.give(used, ctx.needs_input_grad[1], lambda: shared.add(used, lo, x, grad, counts),
                                  (grad,))
        return grad_x, grad_w, None, None, None, None


def _per_row(bias: torch.Tensor, repeats: torch.Tensor, rows: int) -> torch.Tensor:
    """Each expert's bias [local experts, width] repeated for its rows (`repeats` [local experts] on the
    device, `rows` their sum): [rows, width]."""
    return bias.repeat_interleave(repeats, dim=0, output_size=rows)


class GroupedMLP(nn.Module):
    """This rank's experts (experts [ep_rank * local, (ep_rank + 1) * local)), each an MLP:
    fc2(act(fc1 x)), or gated fc2(act(gate) * up) when `config.gated_linear_unit`; with
    `config.add_bias_linear` (gpt-oss), fc1 and fc2 biases per expert, zero at init, fc2's added before
    the router's weight (p (fc2(h) + b), as Megatron-Core's grouped experts): at ETP 1 only, as there."""

    def __init__(self, config: TransformerConfig, init_method=None, output_init_method=None, device=None,
                 ffn_hidden_size: int | None = None):
        super().__init__()
        ep, etp = state.get_expert_model_parallel_world_size(), state.get_expert_tensor_parallel_world_size()
        experts, hidden = config.num_moe_experts, config.hidden_size
        ffn = ffn_hidden_size or config.moe_ffn_hidden_size
        if experts % ep:
            raise ValueError(f"the number of experts ({experts}) is not divisible by the expert-parallel size "
                             f"({ep}): choose --ep among the divisors of {experts}")
        if ffn % etp:
            raise ValueError(f"--moe-ffn-hidden-size ({ffn}) is not divisible by the expert-tensor-parallel size "
                             f"({etp}): choose --etp among its divisors")
        self.num_local_experts = experts // ep
        self.gated = config.gated_linear_unit
        blocks = 2 if self.gated else 1
        first = self.first_expert = state.get_expert_model_parallel_rank() * self.num_local_experts
        self.num_experts = experts
        mine = slice(first, first + self.num_local_experts)
        etp_rank = state.get_expert_tensor_parallel_rank()
        device = default_device(device)
        where = init_device(device)
        fc1 = torch.zeros(experts, blocks * ffn, hidden, dtype=torch.float32, device=where)
        (init_method or weight_init(config))(fc1)
        fc2 = torch.zeros(experts, hidden, ffn, dtype=torch.float32, device=where)
        (output_init_method or weight_init(config))(fc2)
        self.fc1_weight = self._parameter(tp_shard(fc1[mine], 1, etp, etp_rank, blocks), config, device, 1, blocks)
        self.fc2_weight = self._parameter(tp_shard(fc2[mine], 2, etp, etp_rank), config, device, 2, 1)
        self.activation, self.glu = activation_function(config), glu_function(config)
        self.fc1_bias = self.fc2_bias = None
        if config.add_bias_linear:
            if etp > 1:
                raise ValueError(f"experts with biases (add_bias_linear with --num-experts) run at --etp 1, as "
                                 f"Megatron-Core's: --etp {etp} would add fc2's bias on every ETP rank; use --etp 1")
            zeros = torch.zeros(self.num_local_experts, blocks * ffn, dtype=torch.float32)
            self.fc1_bias = self._parameter(zeros, config, device, 1, blocks)
            self.fc2_bias = self._parameter(torch.zeros(self.num_local_experts, hidden), config, device, 1, 1)
            for bias in (self.fc1_bias, self.fc2_bias):  # each expert's bias is 1-D: no decay, as Megatron-Core's
                bias.no_weight_decay = True
        self.fc1_fp8: list[FP8Linear] | None = None  # `use_fp8`: one state per local expert
        self.fc2_fp8: list[FP8Linear] | None = None

    def use_fp8(self, recipe) -> None:
        """Run the experts' GEMMs in FP8 as `recipe` says, each expert with its own scales; None: not."""
        if recipe is None:
            self.fc1_fp8 = self.fc2_fp8 = None
            return
        device = self.fc1_weight.device
        self.fc1_fp8 = [FP8Linear(recipe, amax_groups("expert_fc1"), device) for _ in range(self.num_local_experts)]
        self.fc2_fp8 = [FP8Linear(recipe, amax_groups("expert_fc2"), device) for _ in range(self.num_local_experts)]

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, counts: list[int], states, group=None) -> torch.Tensor:
        if group is not None:
            lo, hi, shared = group
            if states is None:
                return _GroupedLinearOfGroup.apply(x, weight, list(counts), lo, hi, shared)
            weight, states = weight[lo:hi], states[lo:hi]  # (FP8: autograd adds each group's slice up)
        return grouped_linear(x, weight, counts) if states is None else fp8_grouped_linear(x, weight, counts, states)

    def shared_gradients(self, groups: int) -> tuple[SharedGradient, SharedGradient]:
        """fc1's and fc2's gradients over one chunked dispatch of `groups` groups."""
        return SharedGradient(groups), SharedGradient(groups)

    @staticmethod
    def _parameter(shard: torch.Tensor, config, device, dim: int, blocks: int) -> nn.Parameter:
        p = nn.Parameter(shard.to(device=device, dtype=config.params_dtype).contiguous())
        p.expert_parallel = True  # sharded over EP (dim 0) and ETP (`partition_dim`), reduced over EDP
        p.partition_dim = dim
        if blocks > 1:
            p.partition_blocks = blocks
        return p

    def forward(self, x: torch.Tensor, counts: list[int], group=None) -> torch.Tensor:
        """x [N, hidden] sorted by local expert (counts[e] rows each) -> [N, hidden], partial over ETP.
        `group` (lo, hi, `shared_gradients`): the rows are those of local experts lo..hi-1 only
        (counts has hi - lo entries): their slices of the weights, the same GEMMs."""
        g1 = g2 = None
        if group is not None:
            lo, hi, (shared1, shared2) = group
            g1, g2 = (lo, hi, shared1), (lo, hi, shared2)
        h = self._linear(x, self.fc1_weight, counts, self.fc1_fp8, g1)
        if self.fc1_bias is not None:  # the rows' experts, once for both biases (from the host: no sync)
            repeats = torch.tensor(counts).to(x.device, non_blocking=True)
            h = h + _per_row(self._of_group(self.fc1_bias, group), repeats, x.shape[0])
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.glu(gate, up)
        else:
            h = self.activation(h)
        y = self._linear(h, self.fc2_weight, counts, self.fc2_fp8, g2)
        return y if self.fc2_bias is None else y + _per_row(self._of_group(self.fc2_bias, group), repeats, x.shape[0])

    @staticmethod
    def _of_group(bias: torch.Tensor, group) -> torch.Tensor:
        """This group's experts' biases, their gradient handed over with the weights' (split backward: W)."""
        bias = weight_grad.defer_delivery(bias)
        return bias if group is None else bias[group[0]:group[1]]
