"""A tensor-parallel linear layer's three GEMMs in FP8 (megalite.precision): forward y = x W^T,
input gradient dx = dy W, weight gradient dW = dy^T x, each operand quantized as the recipe says,
the result in the activations' dtype (the weight gradient in the weight's), master weights and
optimizer untouched. Biases, the output layer, norms, softmax and losses stay in higher precision.

Each operand is quantized along its GEMM's contraction: x and W along the input features for the
forward; dy along the output features and W^T for dx; dy^T and x^T along the tokens for dW. A
tensor-wide scale serves both orientations (a transpose of the same FP8 values), as does a 128 x 128
block; 1 x 128 and 1 x 32 tiles are quantized again from the higher-precision tensor.

Layouts agree with one device: under current scaling (tensorwise) an operand sharded over tensor or
context parallelism takes the amax of the whole tensor (an all-reduce MAX over the ranks that hold
its parts: `amax_groups`), so each rank quantizes its part exactly as one device quantizes the
whole. Delayed scaling reduces once per step instead (megalite.models.fp8). The weight is quantized
in each forward (its FP8 copy, and the transposed one dx needs, saved for the backward); keeping it
over a step's micro-batches would need to know when the optimizer changed it.

Under a zero-bubble schedule the weight-gradient GEMM is left for W like any linear's
(megalite.parallel.weight_grad.give).
"""
from __future__ import annotations

import torch

from megalite.parallel import state, traffic, weight_grad
from megalite.precision.gemm import grouped_scaled_mm, scaled_mm
from megalite.precision.quantize import Quantized, amax_of, quantize
from megalite.precision.recipes import Recipe
from megalite.precision.scaling import DelayedScaling


# Which group's ranks hold the parts of each operand (input, weight, output gradient), by the kind of
# layer: tokens are split over context parallelism, features over TP. A column layer's input is
# whole on every TP rank (gathered under sequence parallelism), so is a row layer's output gradient;
# a replicated weight (MLA's down-projections) sees each TP rank's part of its output gradient's sum;
# an expert's tokens are whole over expert tensor parallelism, which splits fc1's rows and fc2's columns.
_AMAX_GROUPS = {
    "column": ("context", "tensor", "tensor_context"),
    "row": ("tensor_context", "tensor", "context"),
    "replicated": ("context", None, "tensor_context"),
    "expert_fc1": (None, "expert_tensor", "expert_tensor"),
    "expert_fc2": ("expert_tensor", "expert_tensor", None),
}
_GROUP_OF = {"context": lambda: state.get_context_parallel_group(),
             "tensor": lambda: state.get_tensor_model_parallel_group(),
             "tensor_context": lambda: state.get_tensor_and_context_parallel_group(),
             "expert_tensor": lambda: state.get_expert_tensor_parallel_group()}


def amax_groups(kind: str) -> dict[str, object]:
    """{role: the group over which a tensor-wide amax of that operand is reduced, or None} for a
    layer of `kind` (a key of `_AMAX_GROUPS`); groups of one rank are None."""
    names = dict(zip(("input", "weight", "grad"), _AMAX_GROUPS[kind]))
    if not state.model_parallel_is_initialized():
        return dict.fromkeys(names)
    groups = {role: None if name is None else _GROUP_OF[name]() for role, name in names.items()}
    return {role: g if g is not None and torch.distributed.get_world_size(g) > 1 else None
            for role, g in groups.items()}


class FP8Linear:
    """What one layer's FP8 GEMMs need: the recipe, the amax groups and delayed scaling's state."""

    def __init__(self, recipe: Recipe, groups: dict[str, object] | None = None, device=None):
        self.recipe = recipe
        self.groups = groups or {"input": None, "weight": None, "grad": None}
        self.scaling = DelayedScaling(recipe, device) if recipe.delayed else None

    def quantize(self, x: torch.Tensor, role: str, record: bool = True) -> Quantized:
        """x laid [rows, contraction] in `role`'s format and tiles; delayed scaling notes its amax
        unless not `record` (evaluation reads the scales and leaves the step's amaxes alone)."""
        r = self.recipe
        dtype, tile = r.dtype(role), r.tile(role)
        if tile is not None:
            return quantize(x, dtype, tile, r.power_of_two)
        amax = amax_of(x)
        if self.scaling is not None:
            scale = self.scaling.record(role, amax) if record else self.scaling.current(role)
            return quantize(x, dtype, scale=scale, amax=amax)
        group = self.groups.get(role)
        if group is not None:
            traffic.counted_all_reduce("fp8", amax, group=group, op=torch.distributed.ReduceOp.MAX)
        return quantize(x, dtype, amax=amax)

    def weight_t(self, w: torch.Tensor, qw: Quantized) -> Quantized:
        """W^T laid for dx (along the output features): the forward's FP8 values transposed where
        the scale allows (tensor-wide, square blocks), else W quantized again along them."""
        tile = self.recipe.tile("weight")
        if tile is None or tile[0] == tile[1]:
            return qw.t()
        return self.quantize(w.detach().t(), "weight")


class _FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, fp8: FP8Linear, record: bool):
        qx = fp8.quantize(x, "input", record)
        # ZeRO-3 may have gathered the weight as FP8 already (megalite.optim.fp8_gather): the same values
        qw = getattr(weight, "fp8_gathered", None) or fp8.quantize(weight.detach(), "weight", record)
        y = scaled_mm(qx, qw, x.dtype)
        if bias is not None:
            y = y + bias
        # What dW needs: x's FP8 values (tensor-wide: transposed later), or x itself (re-quantized
        # along the tokens; and for --no-fp8-wgrad).
        keep_fp8 = fp8.recipe.tile("input") is None and fp8.recipe.wgrad
        qw_t = fp8.weight_t(weight, qw) if ctx.needs_input_grad[0] else None
        ctx.save_for_backward(qx.data if keep_fp8 else x, qx.scale_inv if keep_fp8 else None,
                              *((qw_t.data, qw_t.scale_inv) if qw_t is not None else (None, None)))
        ctx.fp8, ctx.keep_fp8, ctx.used, ctx.weight_dtype = fp8, keep_fp8, (weight, bias), weight.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        saved_x, x_scale_inv, w_t, w_t_scale_inv = ctx.saved_tensors
        dtype = ctx.weight_dtype
        fp8, (used_w, used_b) = ctx.fp8, ctx.used
        ctx.used = None
        qdy = fp8.quantize(dy, "grad")
        dx = None
        if ctx.needs_input_grad[0]:
            dx = scaled_mm(qdy, Quantized(w_t, w_t_scale_inv, fp8.recipe.tile("weight")), dy.dtype)

        def weight_gradient():
            if not fp8.recipe.wgrad:
                return dy.t().mm(saved_x).to(dtype)
            if ctx.keep_fp8:  # one tensor-wide scale: the same FP8 values, transposed
                return scaled_mm(qdy.t(), Quantized(saved_x, x_scale_inv).t(), dtype)
            return scaled_mm(fp8.quantize(dy.t(), "grad"), fp8.quantize(saved_x.t(), "input"), dtype)

        dw = weight_grad.give(used_w, ctx.needs_input_grad[1], weight_gradient, (dy,))
        db = weight_grad.give_cheap(used_b, ctx.needs_input_grad[2], lambda: dy.sum(0), (dy,))
        return dx, dw, db, None, None


@torch.compiler.disable  # its scales and collectives run eagerly between compiled regions
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8: FP8Linear) -> torch.Tensor:
    """F.linear(x, weight, bias) with its GEMMs in FP8 as `fp8.recipe` says."""
    # (Inside a Function's forward gradients are always off: whether this is training is asked here.)
    y = _FP8LinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, bias, fp8, torch.is_grad_enabled())
    return y.view(*x.shape[:-1], weight.shape[0])


class _FP8GroupedLinearFunction(torch.autograd.Function):
    """y[rows of e] = x[rows of e] W[e]^T for each local expert e, in FP8 with expert e's own scales
    (`states[e]`): the loop of `_FP8LinearFunction`'s GEMMs, one weight-gradient tensor filled. As
    there, the forward keeps what the backward reuses: each expert's x in FP8 (one tensor-wide scale)
    and W^T laid for dx, so no quantization (nor its amax reduction) runs twice."""

    @staticmethod
    def forward(ctx, x, weight, counts, states, record):
        tensor_wide = bool(states) and states[0].recipe.tile("input") is None and states[0].recipe.wgrad
        kept = []  # per expert: x's FP8 values and factor, W^T's (None where not kept)
        q_x, q_w = [], []
        for e, xe in enumerate(x.split(counts)):
            if not xe.shape[0]:
                kept += [None] * 4
                q_x.append(None)
                q_w.append(None)
                continue
            st = states[e]
            qx, qw = st.quantize(xe, "input", record), st.quantize(weight[e].detach(), "weight", record)
            q_x.append(qx)
            q_w.append(qw)
            qw_t = st.weight_t(weight[e], qw) if ctx.needs_input_grad[0] else None
            kept += [qx.data, qx.scale_inv] if tensor_wide else [None, None]
            kept += [qw_t.data, qw_t.scale_inv] if qw_t is not None else [None, None]
        out = grouped_scaled_mm(q_x, q_w, counts, x.new_empty((x.shape[0], weight.shape[1])))
        ctx.save_for_backward(x, weight, *kept)
        ctx.counts, ctx.states, ctx.used = counts, states, weight
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight, *kept = ctx.saved_tensors
        counts, states, used = ctx.counts, ctx.states, ctx.used
        ctx.used = None
        dy = dy.contiguous()
        pieces = list(zip(dy.split(counts), x.split(counts)))
        # Each expert's gradient quantized once for both GEMMs where one scale serves both.
        q_dy = [states[e].quantize(ge, "grad") if ge.shape[0] else None for e, (ge, _) in enumerate(pieces)]
        q_x = [None if kept[4 * e] is None else Quantized(kept[4 * e], kept[4 * e + 1]) for e in range(len(pieces))]
        dx = None
        if ctx.needs_input_grad[0]:
            w_t = [None if q is None else Quantized(kept[4 * e + 2], kept[4 * e + 3], states[e].recipe.tile("weight"))
                   for e, q in enumerate(q_dy)]
            dx = grouped_scaled_mm(q_dy, w_t, counts, dy.new_empty(x.shape))

        def weight_gradient():
            grad_w = torch.zeros_like(weight)  # an expert no token reached: a zero gradient
            for e, (ge, xe) in enumerate(pieces):
                if ge.shape[0]:
                    grad_w[e] = _weight_gradient(states[e], ge, xe, q_dy[e], q_x[e], weight.dtype)
            return grad_w

        return dx, weight_grad.give(used, ctx.needs_input_grad[1], weight_gradient, (dy,)), None, None, None


def _weight_gradient(fp8: FP8Linear, dy: torch.Tensor, x: torch.Tensor, q_dy: Quantized, q_x: Quantized | None,
                     dtype) -> torch.Tensor:
    """dW = dy^T x for one expert: both quantized along the tokens (a tensor-wide scale: `q_dy` and
    `q_x`, x quantized as the forward quantized it, transposed)."""
    if not fp8.recipe.wgrad:
        return dy.t().mm(x).to(dtype)
    if q_x is not None:
        return scaled_mm(q_dy.t(), q_x.t(), dtype)
    return scaled_mm(fp8.quantize(dy.t(), "grad"), fp8.quantize(x.t(), "input"), dtype)


@torch.compiler.disable
def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int], states: list[FP8Linear]):
    """x [sum(counts), in] sorted by expert, weight [E, out, in] -> [sum(counts), out], each expert's
    GEMMs in FP8 with its own scales."""
    return _FP8GroupedLinearFunction.apply(x, weight, list(counts), states, torch.is_grad_enabled())
