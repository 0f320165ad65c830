"""Shared test helpers: tolerances, gathering TP shards back into full tensors, and the shapes
several test files repeat (waiting on a condition, tiny models and tokenizers, end-to-end runs)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cli import records, torchrun
from megalite import parallel
from megalite.parallel.layers import partition_blocks, tp_unshard


def fresh_seed() -> int:
    """A new seed every run, so equivalence is shown on inputs nobody chose."""
    return int.from_bytes(os.urandom(4), "little")


def ops_run(fn) -> list[str]:
    """The aten operators `fn()` runs, by name (overload packet), in order."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))
    ops: list[str] = []
    with Log():
        fn()
    return ops


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def assert_rel_close(a, b, tol=1e-5, what="tensor"):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = rel_err(a, b)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


def gather_tp(t: torch.Tensor, dim: int, blocks: int = 1) -> torch.Tensor:
    """Each TP rank's `t` joined along `dim` into the full tensor (`blocks`: as `tp_unshard`)."""
    tp = parallel.get_tensor_model_parallel_world_size()
    if tp == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.detach().contiguous(), group=parallel.get_tensor_model_parallel_group())
    return tp_unshard(parts, dim, blocks)


def tp_slice(t: torch.Tensor, dim: int) -> torch.Tensor:
    tp, rank = parallel.get_tensor_model_parallel_world_size(), parallel.get_tensor_model_parallel_rank()
    return t.chunk(tp, dim=dim)[rank]


def wait_for(condition, timeout: float, message, procs=(), poll: float = 0.25):
    """Polls `condition` until it holds; fails the test with `message()` after `timeout` seconds,
    or at once when one of `procs` (Popen objects that must outlive the wait) has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        ended = [p.returncode for p in procs if p.poll() is not None]
        if ended:
            pytest.fail(f"a process that should still run ended early (exit {ended}): {message()}")
        time.sleep(poll)
    pytest.fail(message())


def tiny_gpt_and_optimizer(num_layers: int, **optimizer_args):
    """A tiny fp32 GPT on one rank (tp = pp = dp = 1), its gradients in one bucket of a grad buffer,
    and a MegaliteOptimizer over that buffer at lr 0.1: (model, buffer, optimizer)."""
    from megalite.models import GPTModel, TransformerConfig
    from megalite.optim import MegaliteOptimizer, ParamAndGradBuffer

    parallel.initialize_model_parallel(1)
    model = GPTModel(TransformerConfig(num_layers=num_layers, hidden_size=16, num_attention_heads=2, vocab_size=50,
                                       max_position_embeddings=8), seed=0)
    buf = ParamAndGradBuffer(list(model.parameters()), param_dtype=torch.float32, grad_dtype=torch.float32,
                             bucket_numel=10 ** 9, dp_group=None, dp_size=1, reduce_scatter=False)
    return model, buf, MegaliteOptimizer([buf], lr=0.1, **optimizer_args)


def tiny_sentencepiece(directory: Path, text: str, vocab_size: int = 300):
    """A SentencePiece tokenizer of `vocab_size` ids trained on `text` (kept as directory/t.txt)."""
    from megalite.data import train_sentencepiece

    corpus = directory / "t.txt"
    corpus.write_text(text)
    return train_sentencepiece([corpus], str(directory / "sp"), vocab_size=vocab_size)


def sentencepiece_fixture(text: str, vocab_size: int = 300):
    """A module-scoped fixture: a tiny_sentencepiece trained on `text`, once per test module.
    `tokenizer = sentencepiece_fixture(text)` in a test module makes the fixture `tokenizer`."""
    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory):
        return tiny_sentencepiece(tmp_path_factory.mktemp("tok"), text, vocab_size)

    return fixture


def train_on_the_embedded_corpus(script: str, metrics: Path) -> list[dict]:
    """Runs `script` with no data flags (the embedded corpus) on 2 ranks, pp 2 (the data defaults are
    what is tested here; the layout matrices cover tp x pp), for 20 iterations; asserts it ends cleanly
    and learns (the loss falls by over 0.5 from the first logged iteration, 10, to the last, 20).
    Returns the training records of `metrics`."""
    run = torchrun(script, 2, "--pp", "2", "--train-iters", "20", "--metrics-file", str(metrics))
    assert run.returncode == 0, run.stderr[-3000:]
    recs = records(metrics)
    assert [r["iteration"] for r in recs] == [10, 20]
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.5, recs
    return recs


def randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter moved off its init (zero biases and unit norms would hide mapping bugs), in
    eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # tied parameters are listed once
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


VOCAB_ROWS = ("word_embeddings.weight", "output_layer.weight")


def full_tensors(named: dict[str, torch.Tensor], params: dict[str, torch.nn.Parameter], vocab: int) -> dict:
    """Each rank's shard of every tensor gathered back to the full tensor (vocabulary padding rows dropped)."""
    out = {}
    for name, t in named.items():
        p = params[name]
        full = (gather_tp(t, p.partition_dim, partition_blocks(p)) if getattr(p, "tensor_model_parallel", False)
                else t.detach().clone())
        out[name] = full[:vocab] if name in VOCAB_ROWS else full
    return out


def gpt_forward_backward_record(model: torch.nn.Module, world: int, seed: int, vocab: int) -> dict:
    """A GPT-like model's full weights, logits (padding must be -inf), loss and gradients on fresh
    inputs from `seed`, gathered over TP: what every TP size must agree on. Gradients that are
    partial over TP (sequence parallelism, qk-norm) are summed as `finalize_grads` does."""
    from megalite.optim.grads import is_partial_over_tp

    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(seed + 1)
    ids, labels = torch.randint(0, vocab, (3, 16), generator=gen), torch.randint(0, vocab, (3, 16), generator=gen)
    weights = full_tensors({n: p for n, p in params.items()}, params, vocab)
    logits = gather_tp(model(ids), -1)
    assert torch.isinf(logits[..., vocab:]).all(), "vocabulary padding must be -inf"
    loss = model(ids, labels=labels)
    loss.mean().backward()
    for p in model.parameters():
        if is_partial_over_tp(p) and world > 1:
            dist.all_reduce(p.grad, group=parallel.get_tensor_model_parallel_group())
    grads = full_tensors({n: p.grad for n, p in params.items()}, params, vocab)
    return {"weights": weights, "logits": logits[..., :vocab], "loss": loss.detach(), "grads": grads}


def assert_same_model_run(run: dict, reference: dict, what: str) -> None:
    """`gpt_forward_backward_record`s agree: initial weights bitwise, logits, loss, gradients to 1e-5."""
    for name, w in reference["weights"].items():
        assert torch.equal(run["weights"][name], w), f"initial {name} differs at {what}"
    assert_rel_close(run["logits"], reference["logits"], what=f"logits {what}")
    assert_rel_close(run["loss"], reference["loss"], what=f"loss {what}")
    for name, g in reference["grads"].items():
        assert_rel_close(run["grads"][name], g, what=f"grad of {name} {what}")
