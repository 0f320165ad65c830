"""The split backward of zero-bubble pipeline schedules: B computes input gradients now, W computes
the weight gradients later, from what B kept (Qi et al. 2023, arXiv 2401.10241).

A pipeline stage's backward has two parts of about the same cost: the gradients with respect to its
input (B), which the previous stage waits for, and those with respect to its weights (W), which
nobody waits for until the optimizer step. A schedule that runs W later fills its bubbles with it.

How: while `split_ops()` is on, every use of a weight in megalite's layers builds an op whose
backward can leave its weight-gradient work behind. Inside `deferred()`, a backward runs each such
op's input-gradient part and records its weight-gradient part (a thunk over the tensors it needs:
a linear layer's input and output gradient, an embedding's ids and rows) in a `WeightGrads`, and
returns no weight gradient; `WeightGrads.run()` does the recorded work later and hands each
gradient to autograd, which accumulates it and runs the parameters' hooks (the data-parallel
buckets, ZeRO's reduce-scatters) as if the backward had produced it then.

- GEMMs (`linear`, the experts' grouped GEMM) and the word embedding's scatter are split: W's
  work is not done in B.
- Cheap uses (norm weights and biases, a bias added alone) keep their native backward: the
  gradient is computed in B and only handed over in W (`defer_delivery`), so their numbers are
  the native kernels' own.

Outside `deferred()` the split ops return their weight gradients at once, computed as autograd's
native backward computes them (the same GEMMs on the same operands): bitwise today's numbers.
Each parameter's gradients accumulate over micro-batches in the order their W runs; a schedule
that runs W in micro-batch order gives 1F1B's sums bit for bit.

`--delay-wgrad-compute` (Megatron-Core's flag) also does W's work while a pass waits for an
exchange: a backward recorded with `deferred(uses_of=..., fill=True)` lends its recorded items to
`megalite.parallel.lanes`, which runs them one at a time while a collective is in flight
(`fill_one`), on whichever lane waits. An item goes early only if its parameter receives exactly
one weight gradient in the backward (learned from the model chunk's last whole backward,
`_uses`): that gradient is then accumulated alone, as the whole W would accumulate it. The rest
(a tied embedding's two parts, a chunked dispatch's groups) wait for `run`. So the numbers are
W's, whenever each item runs.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F

from megalite.parallel import lanes

_split = False  # forwards build ops whose weight gradients can be deferred
_split_cheap = True  # ... the cheap ones too (norms, biases), not only the GEMMs'
_pending: "WeightGrads | None" = None  # the backward running now defers weight gradients here
_waiting: "weakref.WeakSet[WeightGrads]" = weakref.WeakSet()  # recorded and not yet run (for memory figures)
_fill: "WeightGrads | None" = None  # whose items a wait for an exchange may run now (--delay-wgrad-compute)
# per model chunk: how many weight gradients each parameter (by id) received in its last whole backward
_uses: "weakref.WeakKeyDictionary[object, dict[int, int]]" = weakref.WeakKeyDictionary()


def splitting() -> bool:
    """Forwards now build split ops (a zero-bubble schedule is running)."""
    return _split and torch.is_grad_enabled() and not torch.compiler.is_compiling()


def deferring() -> bool:
    """A backward that leaves its weight gradients for later is running now."""
    return _pending is not None


def splitting_cheap() -> bool:
    """The split ops defer the cheap weight gradients too (`split_ops(cheap=True)`)."""
    return _split_cheap


@contextmanager
def split_ops(enabled: bool = True, cheap: bool = True):
    """Forwards inside build ops whose backward can defer weight gradients (and recomputations
    inside a backward rebuild the same ops). cheap=False: only the GEMMs' (and the embedding's)
    weight gradients are deferred; norms and biases get theirs in the backward, natively
    (--delay-wgrad-compute: there is nothing to gain from moving them, and each deferred item
    costs an autograd call)."""
    global _split, _split_cheap
    before, _split = (_split, _split_cheap), enabled
    _split_cheap = cheap
    try:
        yield
    finally:
        _split, _split_cheap = before


@contextmanager
def deferred(uses_of: object = None, fill: bool = False):
    """Backwards inside record their split ops' weight-gradient work in the yielded `WeightGrads`
    instead of doing it. `uses_of`: the model chunk the backward runs through (its parameters' use
    counts are learned when the work runs); `fill`: waits for exchanges may run the recorded items
    meanwhile (see the module docstring). Only with no other recorded work waiting: a parameter's
    gradients must accumulate in micro-batch order."""
    global _pending, _fill
    if _pending is not None:
        raise RuntimeError("deferred() does not nest: a backward is already deferring its weight gradients")
    grads = WeightGrads(uses_of)
    _pending = grads
    if fill and uses_of is not None and uses_of in _uses:
        grads.early = {leaf for leaf, n in _uses[uses_of].items() if n == 1}
        _fill = grads
    try:
        yield grads
    finally:
        _pending = None


def is_deferred(param: torch.Tensor) -> bool:
    """`param` (a leaf) had weight-gradient work deferred by the backward running now: its gradient
    hook, which autograd runs with no new gradient, must wait for `WeightGrads.run`."""
    return _pending is not None and id(param) in _pending.leaves


def _leaf_of(t: torch.Tensor) -> torch.Tensor | None:
    """The parameter behind a weight as an op used it (itself, or through a cast, `+ 1`, a slice)."""
    node = t.grad_fn
    while node is not None:
        if hasattr(node, "variable"):  # AccumulateGrad
            return node.variable
        nexts = [n for n, _ in node.next_functions if n is not None]
        if len(nexts) != 1:
            return None
        node = nexts[0]
    return t if t.is_leaf else None


class WeightGrads:
    """The weight-gradient work of one deferred backward: (the tensor an op used, the thunk that
    computes its gradient, the output gradients the thunk keeps, its parameter's id), in the order
    the backward met them."""

    def __init__(self, uses_of: object = None):
        self.items: list[tuple[torch.Tensor, Callable[[], torch.Tensor], tuple, int | None]] = []
        self.leaves: set[int] = set()
        self.uses_of = uses_of
        self.early: set[int] = set()  # parameters whose one item may run while an exchange is in flight
        self.ran_early: list[int] = []  # the parameters whose item did
        self.next = 0  # items before this index are not early candidates any more
        _waiting.add(self)

    def add(self, used: torch.Tensor, thunk: Callable[[], torch.Tensor], held: tuple = ()) -> None:
        leaf = _leaf_of(used)
        self.items.append((used, thunk, held, None if leaf is None else id(leaf)))
        if leaf is not None:
            self.leaves.add(id(leaf))

    def __len__(self) -> int:
        return len(self.items)

    def fill_one(self) -> bool:
        """Run the next recorded item whose parameter has no other (see the module docstring) and
        hand its gradient to autograd now; False when there is none. Called by
        megalite.parallel.lanes while a collective is in flight."""
        i = self.next
        while i < len(self.items) and self.items[i][3] not in self.early:
            i += 1
        self.next = i  # (the items skipped wait for `run`; the one taken leaves its place to the next)
        if i == len(self.items):
            return False
        used, thunk, _, leaf = self.items.pop(i)
        self.ran_early.append(leaf)
        global _pending
        pending, _pending = _pending, None  # (the parameter's hooks see a W, not a deferring B)
        try:
            with torch.enable_grad():
                root = _Deliver.apply(used, thunk)
            torch.autograd.backward([root])
        finally:
            _pending = pending
        return True

    def run(self) -> None:
        """Compute every recorded gradient and hand it to autograd, in one backward: parameters
        accumulate and their hooks run as in a plain backward (ZeRO's end-of-backward callback once).
        Autograd runs a leaf's accumulation as soon as its gradient is ready, so one weight
        gradient is alive at a time; the thunks run in the order recorded."""
        global _fill
        if _fill is self:
            _fill = None
        if self.uses_of is not None:
            counts = self._learn()
            # --delay-wgrad-compute: each parameter with one item gets its gradient alone, as while
            # filling (one backward each: measured 2026-12-05 on the CPU, 27 ms a micro-batch of the
            # tiny MoE's W against 37 in one backward); the others below, together
            self.early, self.next = {leaf for leaf, n in counts.items() if n == 1}, 0
            while self.fill_one():
                pass
        items, self.items = self.items, []
        if not items:
            return
        with torch.enable_grad():
            # Autograd runs the most recently built node first: build them last-recorded first.
            roots = [_Deliver.apply(used, thunk) for used, thunk, *_ in reversed(items)]
        torch.autograd.backward(roots)

    def _learn(self) -> dict[int, int]:
        """Each parameter's items over the whole backward (those run early and the rest), kept for
        the chunk's next backwards; a parameter that ran early must have had no other."""
        counts: dict[int, int] = {}
        for leaf in self.ran_early + [item[3] for item in self.items if item[3] is not None]:
            counts[leaf] = counts.get(leaf, 0) + 1
        twice = [leaf for leaf in self.ran_early if counts[leaf] > 1]
        if twice:
            raise RuntimeError(f"--delay-wgrad-compute: {len(twice)} parameter(s) ran their weight gradient early "
                               "but received another in the same backward (the model's uses changed from one "
                               "backward to the next); drop --delay-wgrad-compute and report it")
        _uses[self.uses_of] = counts
        return counts


def fill_one() -> bool:
    """Run one item of the backward lent for filling (`deferred(fill=True)`), if any; False when
    there is nothing to run (megalite.parallel.lanes calls it while an exchange is in flight)."""
    return _fill is not None and _fill.fill_one()


def forget_fill() -> None:
    """Lend no backward for filling any more: one that raised must not be run later by a wait."""
    global _fill
    _fill = None


def can_fill() -> bool:
    """Whether a backward's recorded items are lent for filling now."""
    return _fill is not None


class _Deliver(torch.autograd.Function):
    """A root whose backward hands `thunk()` to `used` as its gradient."""

    @staticmethod
    def forward(ctx, used, thunk):
        ctx.thunk = thunk
        return used.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        thunk, ctx.thunk = ctx.thunk, None
        return thunk(), None


def give(used: torch.Tensor | None, needed: bool, thunk: Callable[[], torch.Tensor],
         held: tuple = ()) -> torch.Tensor | None:
    """A weight's gradient: recorded for later when deferring, else computed now. `held`: the
    gradients the thunk keeps alive (counted by `held_bytes`)."""
    if used is None or not needed:
        return None
    if _pending is not None:
        _pending.add(used, thunk, held)
        return None
    return thunk()


def give_cheap(used: torch.Tensor | None, needed: bool, thunk: Callable[[], torch.Tensor],
               held: tuple = ()) -> torch.Tensor | None:
    """`give` for a cheap gradient (a bias's): computed now unless the split ops defer the cheap ones
    too (`split_ops(cheap=...)`)."""
    if _split_cheap or used is None or not needed:
        return give(used, needed, thunk, held)
    return thunk()


def held_bytes() -> int:
    """Bytes of the distinct storages of the output gradients that recorded, not yet run, W work
    keeps (the inputs it keeps are saved tensors, which saved-tensor hooks see)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for work in list(_waiting) for _, _, held, _ in work.items for t in held}
    return sum(storages.values())


class _SplitLinear(torch.autograd.Function):
    """y = x W^T + b for 2-D x; backward: dx = dy W now, dW = dy^T x and db = sum dy when W runs
    (the GEMMs autograd's linear backward runs)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.used = (weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        used_w, used_b = ctx.used
        ctx.used = None
        dx = dy.mm(weight) if ctx.needs_input_grad[0] else None
        dw = give(used_w, ctx.needs_input_grad[1], lambda: dy.t().mm(x), (dy,))
        db = give_cheap(used_b, ctx.needs_input_grad[2], lambda: dy.sum(0), (dy,))
        return dx, dw, db


class _SplitEmbedding(torch.autograd.Function):
    """F.embedding(ids, weight); W scatters the rows' gradients into a table (autograd's own
    embedding backward, the same kernel)."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.used, ctx.rows = weight, weight.shape[0]
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        used, rows = ctx.used, ctx.rows
        ctx.used = None
        return None, give(used, ctx.needs_input_grad[1],
                          lambda: torch.ops.aten.embedding_dense_backward(grad, ids, rows, -1, False), (grad,))


class _DeferDelivery(torch.autograd.Function):
    """The weight itself; its gradient, whatever computed it, is handed over when W runs."""

    @staticmethod
    def forward(ctx, weight):
        ctx.used = weight
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        used, ctx.used = ctx.used, None
        return give(used, True, lambda: grad, (grad,))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose weight gradients W can defer (under `split_ops`)."""
    if bias is not None and not (x.dim() == 2 or x.dim() == 3 and x.is_contiguous()):
        # F.linear multiplies such an input, then adds the bias (no fused GEMM): so here too.
        return linear(x, weight) + defer_delivery(bias)
    # Two dimensions inside, the view outside: callers may write into the output in place (the
    # padding logits), which autograd forbids on a view made inside a custom Function.
    y = _SplitLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding whose table gradient W can defer (under `split_ops`)."""
    return _SplitEmbedding.apply(ids, weight)


def defer_delivery(weight: torch.Tensor | None) -> torch.Tensor | None:
    """`weight` for an op with a native backward: under `split_ops` its gradient reaches the
    parameter when W runs (computed in B: for cheap uses, norms and lone biases)."""
    if weight is None or not splitting() or not _split_cheap or not weight.requires_grad:
        return weight
    return _DeferDelivery.apply(weight)


def _set_pending(pending: "WeightGrads | None") -> None:
    global _pending
    _pending = pending


# A backward deferring its weight gradients on one lane of an overlapped pair defers only its own.
lanes.register_lane_local(lambda: _pending, _set_pending)
lanes.set_filler(can_fill, fill_one)
