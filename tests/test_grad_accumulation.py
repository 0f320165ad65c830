"""Linear layers' weight gradients written by the GEMM straight into the gradient buffer, and an
untied embedding's rows added there (issue 30): bitwise the gradients autograd accumulates, over
several micro-batches, for GPT (biases, tied embedding) and a Llama-shaped model (GQA, SwiGLU, untied
embedding and output layer) at TP 1 and 2, with full and selective recomputation; the buffer hears of each weight once all its forward uses are back (a weight used
twice launches its bucket only after both); bf16 weights, ZeRO-2 and compiled code keep autograd's
path; no host sync is added."""
import copy

import pytest
import torch

from megalite import parallel
from megalite.models import GPTModel, TransformerConfig
from megalite.optim.buffers import ParamAndGradBuffer
from megalite.parallel import grad_accumulation
from megalite.parallel.layers import ColumnParallelLinear
from megalite.testing import count_host_syncs, run_ranks

LLAMA = dict(gated_linear_unit=True, activation="silu", normalization="rmsnorm", position_embedding_type="rope",
             num_query_groups=2, add_bias_linear=False, untie_embeddings_and_output_weights=True)
MODELS = {"gpt": {}, "llama": LLAMA, "llama-recompute-full": dict(LLAMA, recompute="full"),
          "gpt-recompute-selective": dict(recompute="selective"), "llama-tp2": LLAMA}


def _config(**kw) -> TransformerConfig:
    return TransformerConfig(**{**dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100,
                                       max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0), **kw})


def _buffer(params, dtype=torch.float32, **kw):
    return ParamAndGradBuffer(params, param_dtype=dtype, grad_dtype=torch.float32, bucket_numel=2000,
                              dp_group=None, dp_size=1, reduce_scatter=False, **kw)


class _Counting:
    """Counts the fused backwards' calls while active (linear, embedding)."""

    def __enter__(self):
        self.calls, self.embedding_calls = 0, 0
        self._originals = (grad_accumulation._LinearIntoMainGrad.backward,
                           grad_accumulation._EmbeddingIntoMainGrad.backward)

        def counted(ctx, g):
            self.calls += 1
            return self._originals[0](ctx, g)

        def counted_embedding(ctx, g):
            self.embedding_calls += 1
            return self._originals[1](ctx, g)
        grad_accumulation._LinearIntoMainGrad.backward = staticmethod(counted)
        grad_accumulation._EmbeddingIntoMainGrad.backward = staticmethod(counted_embedding)
        return self

    def __exit__(self, *exc):
        grad_accumulation._LinearIntoMainGrad.backward = staticmethod(self._originals[0])
        grad_accumulation._EmbeddingIntoMainGrad.backward = staticmethod(self._originals[1])


def _fused_equals_autograd(rank, world, model_kw, micro_batches):
    grad_accumulation.MIN_FUSED_NUMEL = 0  # tiny weights fuse too, here
    parallel.initialize_model_parallel(world)
    model = GPTModel(_config(**model_kw), seed=3, device="cpu").train()
    reference = copy.deepcopy(model)
    batches = [torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(micro_batches)]
    for ids in batches:
        reference(ids, labels=ids).sum().backward()
    buffer = _buffer(list(model.parameters()))
    with _Counting() as counting, count_host_syncs() as syncs:
        for i, ids in enumerate(batches):
            if i == micro_batches - 1:
                buffer.enable_sync()
            model(ids, labels=ids).sum().backward()
    launched, hooks = list(buffer.launch_log), buffer._hooks_seen
    buffer.finish_grad_sync()
    differ = [n for (n, p), q in zip(model.named_parameters(), reference.parameters())
              if not torch.equal(p.main_grad, q.grad)]
    return {"differ": differ, "fused_calls": counting.calls, "embedding_calls": counting.embedding_calls,
            "syncs": syncs.calls, "launched": launched,
            "hooks": hooks, "params": len(buffer.params)}


@pytest.mark.parametrize("name", list(MODELS))
def test_gemm_written_weight_gradients_equal_autograds_bitwise(name):
    tp = 2 if name.endswith("tp2") else 1
    out = run_ranks(_fused_equals_autograd, tp, args=(MODELS[name], 3))[0]
    assert out["differ"] == [], f"gradients differ from autograd's: {out['differ']}"
    linears_per_layer = 4 if name.startswith("gpt") else 5  # qkv|q,kv, proj, fc1, fc2
    untied = name.startswith("llama")  # its output layer fuses, and its embedding's lookups
    assert out["fused_calls"] == 3 * (2 * linears_per_layer + untied)
    assert out["embedding_calls"] == 3 * untied
    assert out["syncs"] == []
    # Buckets still launch during the last backward, before every gradient is in.
    assert out["hooks"] == 3 * out["params"]  # every weight heard of once per micro-batch
    assert out["launched"] and out["launched"][0][1] < out["hooks"], out["launched"]


def _used_twice(rank, world):
    grad_accumulation.MIN_FUSED_NUMEL = 0
    parallel.initialize_model_parallel(1)
    layer = ColumnParallelLinear(8, 6, bias=False, device="cpu")
    other = torch.nn.Parameter(torch.ones(3))
    buffer = _buffer([layer.weight, other])
    x1, x2 = torch.randn(4, 8), torch.randn(4, 8)
    seen_at_ready = []  # what the buffer's hook (registered first) sees: the gradient then
    layer.weight.register_post_accumulate_grad_hook(lambda p: seen_at_ready.append(p.main_grad.clone()))
    with _Counting() as counting:
        (layer(x1).sum() + 2 * layer(x2).sum() + other.sum()).backward()
    want = torch.ones(6, 4) @ x1 + 2 * torch.ones(6, 4) @ x2
    return counting.calls, seen_at_ready, want, buffer._hooks_seen


def test_a_weight_used_twice_is_ready_once_after_both_backwards():
    calls, seen_at_ready, want, hooks = run_ranks(_used_twice, 1)[0]
    assert calls == 2 and hooks == 2  # two fused backwards; the buffer heard of each parameter once
    assert len(seen_at_ready) == 1 and torch.allclose(seen_at_ready[0], want)  # after both, not the first


def test_without_a_buffer_bf16_small_or_compiling_it_is_plain_linear(monkeypatch):
    monkeypatch.setattr(grad_accumulation, "MIN_FUSED_NUMEL", 0)
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    assert grad_accumulation._buffer_of(layer.weight) is None  # no buffer
    bf16 = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.bfloat16))
    _buffer([bf16], dtype=torch.bfloat16)
    assert not hasattr(bf16, "grad_buffer")  # bf16 weights: autograd's gradient, added in fp32
    fp32 = torch.nn.Parameter(torch.randn(3, 4))
    buffer = _buffer([fp32])
    assert grad_accumulation._buffer_of(fp32) is buffer
    with torch.no_grad():
        assert grad_accumulation._buffer_of(fp32) is None  # evaluation
    monkeypatch.setattr(grad_accumulation, "MIN_FUSED_NUMEL", fp32.numel() + 1)
    assert grad_accumulation._buffer_of(fp32) is None  # too small to pay for the Python
    monkeypatch.setattr(grad_accumulation, "MIN_FUSED_NUMEL", 0)
    fp32.grad = None  # someone took the gradient away from the buffer: autograd's path again
    assert grad_accumulation._buffer_of(fp32) is None
    assert torch.equal(grad_accumulation.linear(x, layer.weight, layer.bias, into_main_grad=True), layer(x))
