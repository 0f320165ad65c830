"""Linear layers' weight gradients written by the GEMM straight into the gradient buffer, and an
untied embedding's rows added there (issue 30): bitwise the gradients autograd accumulates, over
several micro-batches, for GPT (biases, tied embedding) and a Llama-shaped model (GQA, SwiGLU, untied
embedding and output layer) at TP 1 and 2, with full and selective recomputation; the buffer hears
of each weight once all its forward uses are back (a weight used twice launches its bucket only
after both); compiled code writes the buffer from inside its graph; bf16 weights and ZeRO-2 keep
autograd's path; no host sync is added."""
import copy

import pytest
import torch

from helpers import ops_run
from megalite import parallel
from megalite.models import BERTModel, GPTModel, TransformerConfig
from megalite.optim import buffers
from megalite.optim.buffers import ParamAndGradBuffer
from megalite.parallel import grad_accumulation, tp_overlap
from megalite.parallel.layers import ColumnParallelLinear
from megalite.testing import count_host_syncs, run_ranks
from training_ranks import side_by_side

LLAMA = dict(gated_linear_unit=True, activation="silu", normalization="rmsnorm", position_embedding_type="rope",
             num_query_groups=2, add_bias_linear=False, untie_embeddings_and_output_weights=True)
MODELS = {"gpt": {}, "llama": LLAMA, "llama-recompute-full": dict(LLAMA, recompute="full"),
          "gpt-recompute-selective": dict(recompute="selective"), "llama-tp2": LLAMA, "gpt-tp2": {},
          "gpt-sp-tp2": dict(sequence_parallel=True), "bert": {}, "bert-tp2": {}}


def _config(**kw) -> TransformerConfig:
    return TransformerConfig(**{**dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100,
                                       max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0), **kw})


def _buffer(params, dtype=torch.float32, **kw):
    return ParamAndGradBuffer(params, param_dtype=dtype, grad_dtype=torch.float32, bucket_numel=2000,
                              dp_group=None, dp_size=1, reduce_scatter=False, **kw)


class _Counting:
    """Counts the fused backwards' calls while active (linear, embedding). Sequence-parallel linears
    write theirs from megalite.parallel.tp_overlap (one GEMM per layer as well): counted when they
    write into the buffer."""

    def __enter__(self):
        self.calls, self.embedding_calls = 0, 0
        self._originals = (grad_accumulation._LinearIntoMainGrad.backward,
                           grad_accumulation._EmbeddingIntoMainGrad.backward, tp_overlap._grads_of_weight)

        def counted(ctx, g):
            self.calls += 1
            return self._originals[0](ctx, g)

        def counted_embedding(ctx, g):
            self.embedding_calls += 1
            return self._originals[1](ctx, g)

        def counted_sequence_parallel(ctx, dy, x):
            self.calls += ctx.buffer is not None
            return self._originals[2](ctx, dy, x)
        grad_accumulation._LinearIntoMainGrad.backward = staticmethod(counted)
        grad_accumulation._EmbeddingIntoMainGrad.backward = staticmethod(counted_embedding)
        tp_overlap._grads_of_weight = counted_sequence_parallel
        return self

    def __exit__(self, *exc):
        grad_accumulation._LinearIntoMainGrad.backward = staticmethod(self._originals[0])
        grad_accumulation._EmbeddingIntoMainGrad.backward = staticmethod(self._originals[1])
        tp_overlap._grads_of_weight = self._originals[2]


def _loss(model, ids):
    # BERT (compiled or not): its masked-LM logits, a tied output layer with a bias, padding masked.
    if isinstance(getattr(model, "_orig_mod", model), BERTModel):
        return model(ids, lm_labels=ids)[0].sum()
    return model(ids, labels=ids).sum()


def _fused_equals_autograd(rank, world, model_kw, micro_batches, kind="gpt", memset_gemm=True):
    grad_accumulation.MIN_FUSED_NUMEL = 0  # tiny weights fuse too, here
    # A first write on a CPU as large weights take it (memset + adding GEMM), or as a GPU's: mm(out=).
    buffers.MEMSET_GEMM_MIN_NUMEL = 0 if memset_gemm else 1 << 40
    parallel.initialize_model_parallel(world)
    model = (BERTModel if kind == "bert" else GPTModel)(_config(**model_kw), seed=3, device="cpu").train()
    reference = copy.deepcopy(model)
    batches = [torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(micro_batches)]
    for ids in batches:
        _loss(reference, ids).backward()
    buffer = _buffer(list(model.parameters()))
    with _Counting() as counting, count_host_syncs() as syncs:
        for i, ids in enumerate(batches):
            if i == micro_batches - 1:
                buffer.enable_sync()
            _loss(model, ids).backward()
    launched, hooks = list(buffer.launch_log), buffer._hooks_seen
    buffer.finish_grad_sync()
    # (BERT's binary head is unused without sentence-order labels: no gradient, a zero main_grad)
    differ = [n for (n, p), q in zip(model.named_parameters(), reference.parameters())
              if not torch.equal(p.main_grad, q.grad if q.grad is not None else torch.zeros_like(q))]
    return {"differ": differ, "fused_calls": counting.calls, "embedding_calls": counting.embedding_calls,
            "syncs": syncs.calls, "launched": launched,
            "hooks": hooks, "params": sum(q.grad is not None for q in reference.parameters())}


def _each_fused(rank, world, names):
    """_fused_equals_autograd for each model in turn, in one process, each from no model-parallel state.
    The TP 2 cases write the step's first gradient as a GPU does (one overwriting GEMM), the rest
    as a CPU does at size (write_gemm: a memset, then a GEMM that adds)."""
    out = {}
    for name in names:
        parallel.destroy_model_parallel()
        out[name] = _fused_equals_autograd(rank, world, MODELS[name], 3, name.split("-")[0], world == 1)
    return out


# Fused weight writes per micro-batch: the 2 layers' linears and the output layer (tied for GPT and
# BERT, whose masked-LM dense and pooler keep autograd's path); the lookups are the embedding writes.
COMPILED = {"gpt": 9, "llama": 11, "bert": 9, "llama-recompute-full": 11, "gpt-recompute-selective": 9}


@pytest.fixture(scope="module")
def models():
    """name -> rank 0's result, eager (the MODELS) and compiled (the COMPILED): the eager TP 1 and TP 2
    cases each in one spawn, beside the one-rank spawn that compiles every model in turn (it leaves a
    core idle)."""
    by_tp = {tp: [n for n in MODELS if (2 if n.endswith("tp2") else 1) == tp] for tp in (1, 2)}
    compiled, *eager = side_by_side(
        lambda: run_ranks(_all_compiled, 1, args=(list(COMPILED),), timeout=600)[0],
        *(lambda tp=tp: run_ranks(_each_fused, tp, args=(by_tp[tp],), timeout=600)[0] for tp in by_tp))
    return {"eager": {k: v for got in eager for k, v in got.items()}, "compiled": compiled}


@pytest.mark.parametrize("name", list(MODELS))
def test_gemm_written_weight_gradients_equal_autograds_bitwise(models, name):
    out = models["eager"][name]
    assert out["differ"] == [], f"gradients differ from autograd's: {out['differ']}"
    linears_per_layer = 5 if name.startswith("llama") else 4  # qkv|q,kv, proj, fc1, fc2
    # The output layer fuses, and the embedding's lookups: untied (llama) or tied (gpt, bert).
    assert out["fused_calls"] == 3 * (2 * linears_per_layer + 1)
    assert out["embedding_calls"] == 3
    assert out["syncs"] == []
    # Buckets still launch during the last backward, before every gradient is in.
    assert out["hooks"] == 3 * out["params"]  # every weight with a gradient heard of once per micro-batch
    assert out["launched"] and out["launched"][0][1] < out["hooks"], out["launched"]


def _second_step(rank, world, model_kw):
    """Two steps through one buffer, `zero_grad` between them (which does not clear the buffer): the
    second step's gradients are bitwise a fresh autograd run's, and a parameter with no gradient in
    it reads zero, not the first step's."""
    grad_accumulation.MIN_FUSED_NUMEL = 0
    parallel.initialize_model_parallel(1)
    model = GPTModel(_config(**model_kw), seed=3, device="cpu").train()
    extra = torch.nn.Parameter(torch.ones(3))  # used in the first step only
    reference = copy.deepcopy(model)
    buffers.MEMSET_GEMM_MIN_NUMEL = 0  # (write_gemm: garbage under its memset, not zeros)
    buffer = _buffer(list(model.parameters()) + [extra])
    batches = [torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    (model(batches[0], labels=batches[0]).sum() + extra.sum()).backward()
    buffer.finish_grad_sync()
    first_extra = extra.main_grad.clone()
    buffer.zero_grad()
    stale = buffer.grad_data.abs().sum().item()  # the first step's gradients, still there
    for i, ids in enumerate(batches[1:]):
        if i == 2:
            buffer.enable_sync()
        model(ids, labels=ids).sum().backward()
        reference(ids, labels=ids).sum().backward()
    buffer.finish_grad_sync()
    differ = [n for (n, p), q in zip(model.named_parameters(), reference.parameters())
              if not torch.equal(p.main_grad, q.grad)]
    grads_are_views = all(p.grad is p.main_grad for p in buffer.params)
    return differ, first_extra, extra.main_grad.clone(), stale, grads_are_views


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_the_buffer_is_not_cleared_between_steps_and_each_step_is_autograds(name):
    differ, first_extra, extra, stale, views = run_ranks(_second_step, 1, args=(MODELS[name],))[0]
    assert stale > 0  # zero_grad left the buffer as it was: no pass over it
    assert differ == []
    assert first_extra.tolist() == [1, 1, 1] and extra.tolist() == [0, 0, 0]
    assert views  # after the step every parameter's .grad is its main_grad again


def _tied_stages(rank, world, micro_batches):
    """A tied GPT cut in two pipeline stages: the first only looks the table up, the last only
    multiplies by it; each stage's gradient equals autograd's (the input gradient of the last
    stage's received activations feeds the first stage's backward, as the schedule does)."""
    grad_accumulation.MIN_FUSED_NUMEL = 0
    parallel.initialize_model_parallel(1)
    config = _config(num_layers=2)
    first = GPTModel(config, pre_process=True, post_process=False, layer_numbers=[0], seed=3, device="cpu").train()
    last = GPTModel(config, pre_process=False, post_process=True, layer_numbers=[1], seed=3, device="cpu").train()
    ref_first, ref_last = copy.deepcopy(first), copy.deepcopy(last)
    buffers = [_buffer(list(first.parameters())), _buffer(list(last.parameters()))]
    batches = [torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(micro_batches)]
    with _Counting() as counting:
        for fused, (a, b) in ((False, (ref_first, ref_last)), (True, (first, last))):
            for ids in batches:
                h = a(ids)
                received = h.detach().requires_grad_()
                b.set_input_tensor(received)
                b(labels=ids).sum().backward()
                h.backward(received.grad)
    differ = [n for m, ref in ((first, ref_first), (last, ref_last))
              for (n, p), q in zip(m.named_parameters(), ref.parameters()) if not torch.equal(p.main_grad, q.grad)]
    return differ, counting.calls, counting.embedding_calls, [b._tied_pending for b in buffers]


def test_tied_embedding_on_two_stages_fuses_each_use_bitwise():
    differ, calls, embedding_calls, pending = run_ranks(_tied_stages, 1, args=(3,))[0]
    assert differ == []
    assert calls == 3 * (2 * 4 + 1) and embedding_calls == 3  # both layers' linears, the output, the lookup
    assert pending == [set(), set()]  # neither stage holds both uses


def test_row_sums_add_once_per_row_as_a_zeroed_table_would_bitwise():
    g = torch.Generator().manual_seed(0)
    for n, vocab in ((1, 7), (64, 5), (64, 1000), (300, 40)):
        ids = torch.randint(0, vocab, (n,), generator=g)
        rows = torch.randn(n, 6, generator=g) * torch.logspace(-3, 3, n).unsqueeze(1)  # sums that round
        table = torch.randn(vocab, 6, generator=g)
        want = table + torch.zeros_like(table).index_add_(0, ids, rows)  # autograd: output + lookup
        got = table.clone()
        grad_accumulation.add_row_sums(got, ids, rows)
        assert torch.equal(got, want), (n, vocab)
    ids = torch.tensor([3, 3, 3])  # id 0 absent: the idle slots add zeros to row 0 and change nothing
    got = torch.zeros(4, 2)
    grad_accumulation.add_row_sums(got, ids, torch.ones(3, 2))
    assert got.tolist() == [[0, 0], [0, 0], [0, 0], [3, 3]]


def test_write_gemm_gives_mms_bits_over_whatever_the_buffer_held():
    """A weight gradient's first write (write_gemm): on a CPU a memset and a GEMM that adds, which
    skips MKL's slower zero pass of an overwriting GEMM (scripts/gemm_into.py); the same bits as
    torch.mm for every summation length, fp32 and bf16, whatever NaNs the view held before."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for k, m, n in ((1, 128, 128), (64, 8192, 256), (300, 33, 517), (4096, 256, 128)):
            a, b = torch.randn(k, m, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype)
            flat = torch.full((m * n + 64,), float("nan"), dtype=dtype)
            out = flat[64:].view(m, n)  # a view into a buffer, as main_grad is
            buffers.write_gemm(out, a.t(), b)
            assert torch.equal(out, torch.mm(a.t(), b)), (dtype, k, m, n)
            assert flat[:64].isnan().all()  # nothing outside the view written
    big, small = torch.empty(128, 128), torch.empty(64, 64)
    assert big.numel() >= buffers.MEMSET_GEMM_MIN_NUMEL > small.numel()
    x, y = torch.randn(8, 128), torch.randn(8, 64)
    assert ops_run(lambda: buffers.write_gemm(big, x.t(), x)) == ["t", "zero_", "addmm_"]
    assert ops_run(lambda: buffers.write_gemm(small, y.t(), y)) == ["t", "mm"]  # below it the zero pass is cheaper
    # Elsewhere (a GPU's GEMM writes beta 0 in its epilogue) one GEMM, no memset: shown on meta tensors.
    meta, xm = torch.empty(128, 128, device="meta"), x.to("meta")
    assert ops_run(lambda: buffers.write_gemm(meta, xm.t(), xm)) == ["t", "mm"]


def test_gemm_into_script_times_both_ways_and_checks_their_bits():
    """scripts/gemm_into.py (the figures in docs/optimizer.md) on its smoke shapes."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "gemm_into.py"
    spec = importlib.util.spec_from_file_location("gemm_into", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = script.main(["--quick"])
    assert [r["shape"] for r in rows] == ["quick", "quick embedding"]
    for r in rows:
        assert r["bitwise"] and r["overwrite_us"] > 0 and r["zero_then_add_us"] > 0
        assert r["ratio"] == r["zero_then_add_us"] / r["overwrite_us"]


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


def test_without_a_buffer_bf16_or_small_it_is_plain_linear(monkeypatch):
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
    fp32.grad = None  # a new step (the buffer's zero_grad): main_grad is written, not added to
    assert grad_accumulation._buffer_of(fp32) is buffer
    fp32.grad = torch.zeros_like(fp32)  # someone gave it another gradient tensor: autograd's path again
    assert grad_accumulation._buffer_of(fp32) is None
    assert torch.equal(grad_accumulation.linear(x, layer.weight, layer.bias, into_main_grad=True), layer(x))


def test_the_compiled_graphs_ops_write_the_buffer_or_the_gradient_autograd_gave():
    """What compiled code calls in backward, by the parameter's key: the step's first write
    overwrites main_grad, later ones add; a gradient tensor autograd handed over since is added to."""
    p = torch.nn.Parameter(torch.randn(3, 4))
    _buffer([p])
    p.main_grad.fill_(7.0)  # the last step's gradient, not zeroed
    p.grad = None  # a new step
    dy, x = torch.randn(5, 3), torch.randn(5, 4)
    torch.ops.megalite.add_weight_grad(dy, x, p.grad_key)
    assert torch.equal(p.main_grad, dy.t().mm(x))
    torch.ops.megalite.add_weight_grad(dy, x, p.grad_key)
    assert torch.equal(p.main_grad, dy.t().mm(x) + dy.t().mm(x))
    p.grad = torch.ones(3, 4)  # another tensor: autograd's accumulation, main_grad left alone
    before = p.main_grad.clone()
    torch.ops.megalite.add_weight_grad(dy, x, p.grad_key)
    assert torch.equal(p.grad, torch.ones(3, 4) + dy.t().mm(x)) and torch.equal(p.main_grad, before)

    table = torch.nn.Parameter(torch.randn(6, 2))
    _buffer([table])
    table.main_grad.fill_(7.0)
    table.grad = None
    ids, rows = torch.tensor([1, 4, 1]), torch.randn(3, 2)
    torch.ops.megalite.add_embedding_grad(ids, rows, table.grad_key)
    assert torch.equal(table.main_grad, torch.zeros(6, 2).index_add_(0, ids, rows))
    gone = torch.nn.Parameter(torch.randn(6, 2))
    grad_accumulation.key_parameter(gone)
    key = gone.grad_key
    del gone
    with pytest.raises(RuntimeError, match="no longer exists"):
        torch.ops.megalite.add_embedding_grad(ids, rows, key)


class _CountingBuffer:
    """Counts the buffer's fused writes (as compiled code makes them: no custom Function backward
    runs eagerly there) while active."""

    def __init__(self, buffer):
        self.calls, self.embedding_calls = 0, 0
        add_weight_grad, add_embedding_grad = buffer.add_weight_grad, buffer.add_embedding_grad

        def counted(*args, **kwargs):
            self.calls += 1
            return add_weight_grad(*args, **kwargs)

        def counted_embedding(*args, **kwargs):
            self.embedding_calls += 1
            return add_embedding_grad(*args, **kwargs)
        buffer.add_weight_grad, buffer.add_embedding_grad = counted, counted_embedding


def _graph_counting_backend(graphs):
    """aot_eager (what inductor is given, traced through AOTAutograd and run eagerly), counting the
    graphs dynamo hands it."""
    from torch._dynamo.backends.registry import lookup_backend

    def backend(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)
    return backend


def _compiled(rank, world, name):
    """The model compiled whole: its fused uses stay in the graph, and their gradients go into the
    buffer through the custom ops. Three micro-batches (the second and third add, their backwards
    after both forwards); the gradients against autograd's, the graphs made, the fused writes counted."""
    import torch._dynamo
    torch._dynamo.reset()
    parallel.initialize_model_parallel(1)
    # The eager size floor out of reach: compiled code fuses every weight regardless.
    grad_accumulation.MIN_FUSED_NUMEL = 1 << 40
    buffers.MEMSET_GEMM_MIN_NUMEL = 0
    model = (BERTModel if name == "bert" else GPTModel)(_config(**MODELS[name]), seed=3, device="cpu").train()
    reference = copy.deepcopy(model)
    buffer = _buffer(list(model.parameters()))
    counting = _CountingBuffer(buffer)
    graphs = []
    compiled = torch.compile(model, backend=_graph_counting_backend(graphs))
    batches = [torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    losses = []
    for i, ids in enumerate(batches):
        losses.append(_loss(compiled, ids))
        _loss(reference, ids).backward()
        if i == 0:
            losses.pop().backward()
    # As a pipeline's warm-up leaves them: two forwards' graphs held, then their backwards.
    for loss in losses:
        loss.backward()
    buffer.finish_grad_sync()
    worst = max(((p.main_grad - (0 if q.grad is None else q.grad)).abs().max()
                 / (1e-30 if q.grad is None else q.grad.abs().max().clamp_min(1e-30))).item()
                for p, q in zip(model.parameters(), reference.parameters()))
    return worst, len(graphs), counting.calls, counting.embedding_calls


def _all_compiled(rank, world, names):
    """_compiled for each model in turn, in one process (each starts from a reset dynamo and no
    model-parallel state): the first compilation pays for dynamo's and AOTAutograd's warm-up, the others do not."""
    out = {}
    for name in names:
        parallel.destroy_model_parallel()
        out[name] = _compiled(rank, world, name)
    return out


@pytest.mark.parametrize("name,writes", list(COMPILED.items()))
def test_compiled_code_writes_every_fused_gradient_from_its_graph(models, name, writes):
    """Every weight fuses (the eager size floor does not apply): each use writes the buffer from
    inside the one graph, recomputed layers too (their writes come once, from the backward). Leaving
    the graph for the fused uses made 5 graphs for GPT, 4 for Llama."""
    worst, graphs, calls, embedding_calls = models["compiled"][name]
    assert worst <= 1e-6
    assert graphs == 1
    assert calls == 3 * writes and embedding_calls == 3
