"""The split backward of zero-bubble schedules (megalite.parallel.weight_grad): B leaves every
weight's gradient to W, W gives what one backward gives, and with nothing deferred the split ops
are bitwise autograd's own."""
import pytest
import torch
import torch.nn.functional as F

from megalite.models.moe.experts import grouped_linear
from megalite.parallel import weight_grad


def _grads(fn, params, inputs, split: bool, defer: bool):
    """fn's output and gradients with respect to params and inputs, built with or without split
    ops, with W deferred (and run after) or not."""
    for t in params + inputs:
        t.grad = None
    with weight_grad.split_ops(split):
        out = fn()
    g = torch.ones_like(out) * torch.linspace(-1, 1, out.numel()).view(out.shape)
    if defer:
        with weight_grad.deferred() as work:
            out.backward(g)
        assert all(p.grad is None for p in params), "a weight got its gradient in B"
        assert len(work) > 0
        assert all(t.grad is not None for t in inputs), "B must give the input gradients"
        work.run()
    else:
        out.backward(g)
    return [out.detach().clone()] + [t.grad.clone() for t in params + inputs]


def _cases():
    torch.manual_seed(0)
    x3 = torch.randn(6, 3, 16, requires_grad=True)
    w, b = torch.randn(24, 16, requires_grad=True), torch.randn(24, requires_grad=True)
    ids = torch.randint(0, 10, (5, 3))
    table = torch.randn(10, 16, requires_grad=True)
    xg = torch.randn(9, 16, requires_grad=True)
    wg = torch.randn(3, 8, 16, requires_grad=True)
    from megalite.parallel.grad_accumulation import embedding, linear
    return {
        "linear 3-D with bias": (lambda: linear(x3, w, b), [w, b], [x3]),
        "linear 2-D no bias": (lambda: linear(x3[0], w), [w], [x3]),
        "linear on a transposed input": (lambda: linear(x3.transpose(0, 1), w, b), [w, b], [x3]),
        "linear on a 4-D input": (lambda: linear(x3.view(2, 3, 3, 16), w, b), [w, b], [x3]),
        "linear on a cast weight": (lambda: linear(x3, w.double().float()), [w], [x3]),
        "embedding": (lambda: embedding(ids, table) * 2, [table], []),
        "tied embedding and output": (lambda: linear(embedding(ids, table), table), [table], []),
        "grouped experts (one without tokens)": (lambda: grouped_linear(xg, wg, [4, 0, 5]), [wg], [xg]),
        "norm weight and bias": (lambda: F.layer_norm(x3, (16,), weight_grad.defer_delivery(b[:16]),
                                                      weight_grad.defer_delivery(w[0])), [w, b], [x3]),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_split_ops_give_autograd_numbers_bitwise_deferred_or_not(name):
    fn, params, inputs = _cases()[name]
    native = _grads(fn, params, inputs, split=False, defer=False)
    for defer in (False, True):
        split = _grads(fn, params, inputs, split=True, defer=defer)
        for a, b in zip(split, native):
            assert torch.equal(a, b), (name, defer, (a - b).abs().max())


def test_parameter_hooks_wait_for_w_and_run_once_with_the_gradient():
    w = torch.nn.Parameter(torch.randn(4, 3))
    seen = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(None if weight_grad.is_deferred(p) else p.grad.clone()))
    x = torch.randn(2, 3, requires_grad=True)
    with weight_grad.split_ops():
        y = weight_grad.linear(x, w)
    with weight_grad.deferred() as work:
        y.sum().backward()
    assert seen == [None] and w.grad is None  # autograd ran the hook with no gradient: the buffers skip it
    work.run()
    assert len(seen) == 2 and torch.equal(seen[1], torch.ones(2, 4).t().mm(x.detach()))


def test_deferred_does_not_nest():
    with weight_grad.deferred():
        with pytest.raises(RuntimeError, match="does not nest"):
            with weight_grad.deferred():
                pass


def test_w_computes_each_gradient_in_recorded_order_and_accumulates_it_before_the_next():
    """One weight gradient alive at a time: autograd accumulates each (and runs its hooks) as soon
    as its thunk returns it."""
    log = []
    params = [torch.nn.Parameter(torch.randn(3, 3)) for _ in range(4)]
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda p, i=i: log.append(("accumulated", i)))
    work = weight_grad.WeightGrads()
    for i, p in enumerate(params):
        work.add(p, lambda i=i: (log.append(("computed", i)), torch.full((3, 3), float(i)))[1])
    work.run()
    assert log == [(kind, i) for i in range(4) for kind in ("computed", "accumulated")]
    assert [float(p.grad[0, 0]) for p in params] == [0.0, 1.0, 2.0, 3.0] and len(work) == 0
