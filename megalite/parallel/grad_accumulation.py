"""Weight gradients of linear layers written straight into the gradient buffer.

Autograd would compute a linear layer's weight gradient into a new tensor and then add it to the
parameter's `.grad` (the buffer's `main_grad` view): a second pass over every weight gradient, per
micro-batch. Here the backward writes the GEMM's output into `main_grad` itself: the step's first
write overwrites (the buffer is not zeroed between steps), later micro-batches add. The numbers are
those of autograd's path (the same GEMM; the same addition when accumulating), one memory pass fewer.

It applies to a weight whose buffer opted in (`ParamAndGradBuffer`: same dtype as its gradients,
not ZeRO-2/3, which reduce separate gradients) where the caller asks (`linear(...,
into_main_grad=True)`). The backward returns no weight gradient, and autograd still runs the
weight's post-accumulate hook once every use of it is back, so the buffer's bucket readiness is
what it was. Without a buffer `linear` is F.linear. `embedding` does the same for an untied word
embedding: its rows' gradients are added into the buffer (index_add_, as autograd's embedding
backward sums them) instead of into a zeroed table.

Under torch.compile a use whose weight fuses stays in the graph: a traced autograd Function whose
backward calls an opaque custom op (`megalite::add_weight_grad`, `megalite::add_embedding_grad`)
that writes the buffer as the eager backward does. The op has no output and takes no gradient
tensor: it reaches the parameter by `grad_key` (an int the graph holds as a constant) and is
registered as having a side effect, so neither dynamo, AOTAutograd nor inductor drops it. (A mutated
graph input, main_grad, would be saved for the backward, and autograd's version check on it failed
under activation recomputation.) So the compiled model keeps one graph, and no weight gradient is
copied into the buffer afterwards. A tied embedding's two parts are then written one after the
other, in whichever order the compiled backward runs them (no data joins the two ops): the first
write of the step overwrites and the second adds, so main_grad is output + lookup (bitwise eager's
where the output's op runs first, as it does under aot_eager), and later micro-batches add both,
within rounding of autograd's G + (output + lookup).

A tied word embedding (`tied=True` on both calls: the output layer multiplies by the table the
lookup read, in the same graph) is summed by autograd as output + lookup, where the lookup's part
is a vocabulary-sized zeroed table with the rows added. In a step's first micro-batch the output
GEMM writes `main_grad` and the lookup adds each distinct row's sum once (`add_row_sums`): the same
single addition per element, with no vocabulary-sized temporary. Later micro-batches hand both
parts back to autograd, whose order of sums (G + (output + lookup)) a fused path could not keep.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from megalite.parallel import weight_grad

# Below this many elements a weight keeps autograd's path in eager code: the fused backward's
# Python costs about 0.1 ms a call on a CPU, more than the pass it saves (scripts/benchmark_step.py:
# a 4-layer h256 model ran 2-3% slower fused, a 124M one 3.4% faster; docs/BENCHMARKS.md). Compiled
# code fuses every weight: its traced Function costs nothing at run time, and the op it calls a few
# microseconds.
MIN_FUSED_NUMEL = 1 << 20


def _may_fuse(weight: torch.Tensor) -> bool:
    """What can be known when a graph is traced: the weight has a buffer that takes its gradient,
    needs one now, and (eagerly) is large enough to pay for the fused backward's Python."""
    # A bool, not the buffer: a traced graph guards on its value alone (the buffer object would add
    # identity and aliasing guards, checked in Python on every call of the compiled code).
    return (getattr(weight, "has_grad_buffer", False) and torch.is_grad_enabled() and weight.requires_grad
            and (torch.compiler.is_compiling() or weight.numel() >= MIN_FUSED_NUMEL))


def _buffer_of(weight: torch.Tensor):
    """The buffer that takes this weight's gradient straight from the GEMM, or None."""
    if not _may_fuse(weight) or not _still_in_the_buffer(weight):
        return None
    return weight.grad_buffer


def _still_in_the_buffer(p: torch.nn.Parameter) -> bool:
    """At run time: `p`'s gradient is still the buffer's. None: a new step (ParamAndGradBuffer's
    zero_grad); another tensor: autograd gave it one since, and its path takes over."""
    return p.grad is None or p.grad is p.main_grad


# -- in a compiled graph (see the module's docstring) ------------------------------------------
# The ops find the parameter, and so its buffer, by `grad_key`: an int, which a traced graph holds
# as a constant. No gradient tensor enters the graph (see the module's docstring).
_KEYED: dict[int, "weakref.ref"] = {}


def key_parameter(p: torch.nn.Parameter) -> None:
    """Let compiled code reach `p`'s buffer through `p.grad_key` (ParamAndGradBuffer calls this)."""
    key = p.grad_key = id(p)
    _KEYED[key] = weakref.ref(p, lambda _: _KEYED.pop(key, None))


def _keyed(key: int) -> torch.nn.Parameter:
    ref = _KEYED.get(key)
    p = None if ref is None else ref()
    if p is None:
        raise RuntimeError("a compiled graph's fused gradient names a parameter that no longer exists")
    return p


def _add_weight_grad_now(grad_out: torch.Tensor, inputs: torch.Tensor, key: int) -> None:
    p = _keyed(key)
    if _still_in_the_buffer(p):
        p.grad_buffer.add_weight_grad(p, grad_out, inputs)
    else:  # autograd's accumulation, as the uncompiled path would leave it
        p.grad.add_(grad_out.t().mm(inputs))


def _add_embedding_grad_now(ids: torch.Tensor, rows: torch.Tensor, key: int) -> None:
    p = _keyed(key)
    if _still_in_the_buffer(p):
        p.grad_buffer.add_embedding_grad(p, ids, rows)
    else:
        p.grad.index_add_(0, ids, rows)


# Defined with the plain Library API, not torch.library.custom_op, whose Python wrappers cost more
# a call than the op itself at small sizes (a compiled GPT of 4 layers calls 18 a step).
_LIBRARY = torch.library.Library("megalite", "FRAGMENT")  # (megalite.ops defines others in it)


def _define_side_effect_op(name: str, schema: str, kernel) -> None:
    _LIBRARY.define(name + schema)
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake("megalite::" + name, lambda *args: None, lib=_LIBRARY)
    # Its effect is on the buffer, outside the graph: no output, yet not dead code.
    torch.fx.node.has_side_effect(getattr(torch.ops.megalite, name).default)


_define_side_effect_op("add_weight_grad", "(Tensor grad_out, Tensor inputs, int key) -> ()", _add_weight_grad_now)
_define_side_effect_op("add_embedding_grad", "(Tensor ids, Tensor rows, int key) -> ()", _add_embedding_grad_now)


class _LinearIntoMainGradTraced(torch.autograd.Function):
    """`_LinearIntoMainGrad` as a compiled graph holds it: the weight's gradient written by an op."""

    @staticmethod
    def forward(ctx, x, weight, bias, key):
        ctx.save_for_backward(x, weight)
        ctx.key, ctx.has_bias = key, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        torch.ops.megalite.add_weight_grad(dy, x, ctx.key)
        return dy.mm(weight), None, dy.sum(0) if ctx.has_bias else None, None


class _EmbeddingIntoMainGradTraced(torch.autograd.Function):
    """`_EmbeddingIntoMainGrad` as a compiled graph holds it: the rows' gradients added by an op."""

    @staticmethod
    def forward(ctx, ids, weight, key):
        ctx.save_for_backward(ids)
        ctx.key = key
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        torch.ops.megalite.add_embedding_grad(ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1]), ctx.key)
        return None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           into_main_grad: bool = False, tied: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias); with `into_main_grad`, the weight's gradient goes straight into its
    gradient buffer when it has one. Every use of the weight must come through here, or through
    `embedding(..., tied=True)` with `tied=True` here (a tied word embedding)."""
    if torch.compiler.is_compiling():
        if into_main_grad and _may_fuse(weight):
            y = _LinearIntoMainGradTraced.apply(x.reshape(-1, x.shape[-1]), weight, bias, weight.grad_key)
            return y.view(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight, bias)
    if weight_grad.splitting() and (not tied or weight_grad.splitting_cheap()):
        return weight_grad.linear(x, weight, bias)  # W later (into main_grad the usual way then)
    buffer = _buffer_of(weight) if into_main_grad else None
    # F.linear adds a bias to a 3-D input in the GEMM (addmm) only when the input is contiguous.
    if buffer is None or bias is not None and x.dim() > 2 and not (x.dim() == 3 and x.is_contiguous()):
        return F.linear(x, weight, bias)
    # Two dimensions inside, the view outside: a caller may modify the output in place (the
    # padding logits), which autograd forbids on a view made inside a custom Function.
    y = _LinearIntoMainGrad.apply(x.reshape(-1, x.shape[-1]), weight, bias, buffer, tied)
    return y.view(*x.shape[:-1], weight.shape[0])


def embedding(ids: torch.Tensor, weight: torch.Tensor, into_main_grad: bool = False,
              tied: bool = False) -> torch.Tensor:
    """F.embedding(ids, weight); with `into_main_grad` (the table is looked up once per forward and
    not multiplied, or `tied`: also multiplied once by `linear(..., tied=True)` later in the same
    forward), the rows' gradients are added straight into the weight's gradient buffer, with no
    vocabulary-sized zeroed tensor and no second pass over it."""
    if torch.compiler.is_compiling():
        if into_main_grad and _may_fuse(weight):
            return _EmbeddingIntoMainGradTraced.apply(ids, weight, weight.grad_key)
        return F.embedding(ids, weight)
    if weight_grad.splitting() and weight_grad.splitting_cheap():
        # (--delay-wgrad-compute leaves the table's scatter where it is: memory-bound, and a split one
        # would build a vocabulary-sized zeroed table)
        return weight_grad.embedding(ids, weight)
    buffer = _buffer_of(weight) if into_main_grad else None
    if buffer is None:
        return F.embedding(ids, weight)
    return _EmbeddingIntoMainGrad.apply(ids, weight, buffer, tied)


def add_row_sums(table: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """table[k] += (the rows whose id is k, summed from zero in the order they come), for 1-D `ids`
    and 2-D `rows`: one addition per element of `table`, as `table + zeros.index_add_(ids, rows)`
    makes, with no table-sized temporary. The sums are made per distinct id in slots sized by the
    batch, so no size depends on the data: no host sync."""
    n = ids.numel()
    sorted_ids, order = torch.sort(ids, stable=True)
    first = torch.ones(n, dtype=torch.bool, device=ids.device)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    slot_of_sorted = first.cumsum(0) - 1  # distinct ids numbered in sorted order
    slot = torch.empty_like(slot_of_sorted).scatter_(0, order, slot_of_sorted)
    sums = rows.new_zeros(n, rows.shape[1]).index_add_(0, slot, rows)  # each slot summed in batch order
    # Slots past the last distinct id keep id 0 and a zero sum: adding it changes nothing.
    table.index_add_(0, ids.new_zeros(n).scatter_(0, slot_of_sorted, sorted_ids), sums)


class _EmbeddingIntoMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, buffer, tied):
        ctx.save_for_backward(ids)
        ctx.param, ctx.buffer, ctx.tied = weight, buffer, tied
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        ids, rows = ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.tied:
            return None, ctx.buffer.add_tied_lookup_grad(ctx.param, ids, rows), None, None
        ctx.buffer.add_embedding_grad(ctx.param, ids, rows)
        return None, None, None, None


class _LinearIntoMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, buffer, tied):
        ctx.save_for_backward(x, weight)
        # The parameter itself: under recomputation the saved weight comes back as another tensor.
        ctx.param, ctx.buffer, ctx.has_bias, ctx.tied = weight, buffer, bias is not None, tied
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors  # both 2-D
        # What autograd's linear backward computes: dx = dy W, dW = dy^T x, db = sum of dy's rows.
        dx = dy.mm(weight) if ctx.needs_input_grad[0] else None
        if ctx.tied:
            dw = ctx.buffer.add_tied_output_grad(ctx.param, dy, x)
        else:
            dw = ctx.buffer.add_weight_grad(ctx.param, dy, x)
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None
