"""Gradient norm and per-step communication volume: the global norm is one multi-tensor kernel,
not one kernel per parameter; with the distributed optimizer every bucket (the tied embedding's
too) is reduce-scattered once and all-gathered once, the minimum for the layout."""
import pytest
import torch
from torch.overrides import TorchFunctionMode

from helpers import tiny_gpt_and_optimizer
from megalite.testing import gradient_traffic, run_ranks
from training_ranks import parse


class _CountNorms(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if "norm" in name:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _norm_calls(rank, world):
    model, buf, opt = tiny_gpt_and_optimizer(num_layers=2)
    buf.grad_data.copy_(torch.randn(buf.numel, generator=torch.Generator().manual_seed(0)))
    opt._attach_grads()
    counter = _CountNorms()
    with counter:
        norm = opt.grad_norm()
    want = torch.cat([p.main_grad.double().reshape(-1) for p in model.parameters()]).norm()
    return counter.calls, len(list(model.parameters())), norm.item(), want.item()


def test_grad_norm_is_one_multi_tensor_norm_not_one_per_parameter():
    calls, num_params, norm, want = run_ranks(_norm_calls, 1)[0]
    assert num_params > 10
    assert calls == ["_foreach_norm"], calls
    assert norm == pytest.approx(want, rel=1e-6)


def _step_traffic(rank, world, argv):
    return gradient_traffic(parse(argv), world)


@pytest.mark.parametrize("tp,pp,dp", [(1, 2, 2), (1, 1, 2)])
def test_distributed_optimizer_step_sends_the_minimum_bytes_for_its_layout(tp, pp, dp):
    argv = ["--tp", str(tp), "--pp", str(pp), "--use-distributed-optimizer", "--seq-length", "16",
            "--global-batch-size", "8", "--micro-batch-size", "2", "--ddp-bucket-size", "20000"]
    results = run_ranks(_step_traffic, tp * pp * dp, args=(argv,))
    for sent, minimum, has_tied_bucket in results:
        assert has_tied_bucket == (pp > 1)
        assert sent == minimum, f"{float(sent):.0f} bytes sent, {float(minimum):.0f} needed"


def _params_norm_run(rank, world, argv):
    """The logged params_norm of each iteration, and (one rank) the norm of the final whole weights."""
    from training_ranks import gpt_run, whole_params

    run = gpt_run(argv)
    weights = whole_params(run)
    whole = torch.cat([w.double().reshape(-1) for w in weights.values()]).norm().item() if world == 1 else None
    return [r["params_norm"] for r in run.records], whole


def test_log_params_norm_is_the_whole_weights_norm_at_every_layout():
    argv = ["--train-iters", "3", "--log-interval", "1", "--seq-length", "32", "--global-batch-size", "8",
            "--micro-batch-size", "2", "--eval-iters", "0", "--log-params-norm"]
    [(one, whole)] = run_ranks(_params_norm_run, 1, args=(argv,))
    assert one[-1] == pytest.approx(whole, rel=1e-6)  # each weight counted once (the tied embedding too)
    assert len(set(one)) == 3  # the weights move
    for norms, _ in run_ranks(_params_norm_run, 4, args=(argv + ["--tp", "2", "--zero-stage", "1"],)):
        assert norms == pytest.approx(one, rel=1e-5)
    plain = run_ranks(_params_norm_run, 1, args=([a for a in argv if a != "--log-params-norm"],))[0][0]
    assert plain == [None] * 3
