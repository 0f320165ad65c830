"""Attention sinks (--softmax-type off-by-one / learnable, megalite.models.softmax_sink): every backend
gives Megatron-Core's SoftmaxOne numbers (written out here in float64), gradients included; packed
documents and windows; ring and all-to-all context parallelism against one device, the sinks'
gradients too; the sinks are one parameter a head, TP-layout free, without weight decay; MLA and BERT;
generation's cache; tp 2 with SP, cp 2 and pp 2 train as one rank; checkpoints, Megatron-LM's args and
dist-checkpoint key, the planner's command and the refusals."""
from __future__ import annotations

import argparse

import pytest
import torch

from helpers import rel_err
from megalite.models import BERTModel, GPTModel
from megalite.models.presets import preset
from megalite.models.window import band_mask
from megalite.testing import run_ranks
from training_ranks import built_model, refusal, train_losses


def _sink_reference(q, k, v, sink, allowed):
    """Megatron-Core's unfused softmax with an offset, in float64: softmax over [scores, sink] with the
    sink's column dropped; k and v expanded to q's heads; `allowed` [.., sq, sk] True = attend."""
    q, k, v, sink = (t.double() for t in (q, k, v, sink))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~allowed, float("-inf"))
    column = sink.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1] @ v


def _inputs(heads=4, groups=2, s=12, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, s, d, generator=gen) for h in (heads, groups, groups))
    return q, k, v, torch.randn(heads, generator=gen)


def _grads(fn, *inputs):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), [t.grad for t in inputs]


@pytest.mark.parametrize("backend", ["sdpa", "fused", "torch"])
@pytest.mark.parametrize("mask", ["causal", "window", "padding", "bidirectional"])
def test_every_backend_is_megatron_cores_sink_softmax(backend, mask):
    from megalite.models.attention import ATTENTION_BACKENDS, _expand_groups

    q, k, v, sink = _inputs()
    s = q.shape[2]
    causal = mask in ("causal", "window")
    allowed = {"causal": None, "window": band_mask(s, s, (3, 0), True, "cpu"), "bidirectional": None,
               "padding": torch.arange(s).view(1, 1, 1, s) < torch.tensor([s, 7]).view(2, 1, 1, 1)}[mask]
    whole = allowed if allowed is not None else torch.ones(s, s, dtype=torch.bool).tril(0 if causal else s)
    want, want_grads = _grads(lambda q, k, v, sink: _sink_reference(q, k, v, sink, whole), q, k, v, sink)

    def attend(q, k, v, sink):
        if backend != "sdpa":  # the layer expands the groups for these backends
            k, v = _expand_groups(k, v, q.shape[1])
        return ATTENTION_BACKENDS[backend](q, k, v, allowed, 0.0, causal, sink=sink)
    got, grads = _grads(attend, q, k, v, sink)
    assert rel_err(got, want) <= 1e-6
    for g, w in zip(grads, want_grads):
        assert rel_err(g, w) <= 1e-5
    plain = ATTENTION_BACKENDS[backend](q, *_expand_groups(k, v, 4), allowed, 0.0, causal)
    assert rel_err(got, plain) > 1e-2  # the sink takes its share of every row


def test_off_by_one_is_a_zero_logit_and_a_very_negative_sink_is_vanilla():
    from megalite.models.attention import _sdpa_attention

    q, k, v, _ = _inputs(groups=4)
    plain = _sdpa_attention(q, k, v, None, 0.0, True)
    assert rel_err(_sdpa_attention(q, k, v, None, 0.0, True, sink=torch.full((4,), -200.0)), plain) <= 1e-6
    off_by_one = _sdpa_attention(q, k, v, None, 0.0, True, sink=torch.zeros(4))
    # the first query sees one key, score x: its output is v0 e^x / (e^x + 1)
    x = (q[:, :, 0] * k[:, :, 0]).sum(-1, keepdim=True) / 8 ** 0.5
    assert rel_err(off_by_one[:, :, 0], v[:, :, 0] * torch.sigmoid(x)) <= 1e-6


def test_packed_documents_attend_with_their_sinks():
    from megalite.models.attention import _sdpa_attention
    from megalite.models.documents import PackedDocuments, varlen_attention

    q, k, v, sink = _inputs(s=16)
    bounds = torch.tensor([0, 5, 16, 25, 32])  # row 0: documents of 5 and 11 tokens; row 1: 9 and 7
    documents = PackedDocuments(torch.zeros(2, 16, dtype=torch.long), bounds, None)
    got = varlen_attention(q, k, v, documents, lambda *a: _sdpa_attention(*a, sink=sink), 0.0, flash=False,
                           window=(4, 0))
    pos = torch.arange(16)
    for row, cuts in enumerate(([0, 5, 16], [0, 9, 16])):
        doc = torch.bucketize(pos, torch.tensor(cuts[1:]), right=True)
        allowed = (doc[:, None] == doc[None, :]) & band_mask(16, 16, (4, 0), True, "cpu")[0, 0]
        want = _sink_reference(q[row:row + 1], k[row:row + 1], v[row:row + 1], sink, allowed)
        assert rel_err(got[row:row + 1], want) <= 1e-6


def _context_parallel(rank, world, variant, window_left, seq):
    import torch.distributed as dist

    from megalite.models.attention import _context_parallel_core
    from megalite.models.config import TransformerConfig
    from megalite.parallel import state
    from megalite.parallel.context_parallel import gather_from_context_parallel, split_for_context_parallel

    state.initialize_model_parallel(context_parallel_size=world)
    q, k, v, sink = _inputs(s=seq, seed=3)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    mine = [split_for_context_parallel(t, 2, rank, world).requires_grad_() for t in (q, k, v)]
    sink = sink.requires_grad_()
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               vocab_size=64, cp_comm_type=variant, softmax_type="learnable")
    window = None if window_left is None else (window_left, 0)
    out = _context_parallel_core(*mine, None, config, window, sink)
    out.backward(split_for_context_parallel(grad, 2, rank, world))
    shares = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(shares, out.detach().contiguous())
    grads = []
    for t in mine:
        parts = [torch.empty_like(t.grad) for _ in range(world)]
        dist.all_gather(parts, t.grad.contiguous())
        grads.append(gather_from_context_parallel(parts, 2))
    dist.all_reduce(sink.grad)  # each rank's queries' share, as the gradient reduction sums it
    state.destroy_model_parallel()
    return gather_from_context_parallel(shares, 2), grads + [sink.grad]


@pytest.mark.parametrize("world, variant, window_left", [(2, "p2p", None), (4, "p2p", None), (4, "p2p", 5),
                                                         (2, "a2a", None), (2, "a2a", 5)])
def test_context_parallel_sinks_equal_one_device(world, variant, window_left):
    seq = 32
    q, k, v, sink = _inputs(s=seq, seed=3)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    allowed = band_mask(seq, seq, (-1 if window_left is None else window_left, 0), True, "cpu")
    inputs = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    want = _sink_reference(*inputs, allowed)
    want.backward(grad.double())
    for out, grads in run_ranks(_context_parallel, world, args=(variant, window_left, seq)):
        assert rel_err(out, want) <= 1e-5
        for got, t in zip(grads, inputs):
            assert rel_err(got, t.grad) <= 1e-5


def test_the_sinks_are_one_parameter_a_head_tp_layout_free_and_not_decayed():
    config = preset("llama-tiny", softmax_type="learnable")
    model = GPTModel(config, seed=5, device="cpu")
    sinks = [p for n, p in model.named_parameters() if n.endswith("attention.softmax_offset")]
    assert len(sinks) == config.num_layers and sinks[0].shape == (config.num_attention_heads,)
    assert sinks[0].tensor_model_parallel and sinks[0].partition_dim == 0 and sinks[0].ndim == 1  # ndim 1: no decay
    assert 0.5 * config.init_method_std < sinks[0].std().item() < 2 * config.init_method_std
    [per_rank] = [r for r in run_ranks(_tp_sinks, 2) if r is not None]
    assert torch.equal(per_rank, sinks[0].detach())  # tp 2 draws the same sinks, each rank its heads
    vanilla = GPTModel(preset("llama-tiny"), seed=5, device="cpu").state_dict()
    weights = {k: v for k, v in model.state_dict().items() if not k.endswith("softmax_offset")}
    assert weights.keys() == vanilla.keys() and all(torch.equal(v, vanilla[k]) for k, v in weights.items())
    off = GPTModel(preset("llama-tiny", softmax_type="off-by-one"), seed=5, device="cpu")
    assert "layers.0.attention.softmax_offset" not in off.state_dict()  # a constant, as Megatron-Core's
    assert torch.equal(off.layers[0].attention.softmax_offset, torch.zeros(config.num_attention_heads))


def _tp_sinks(rank, world):
    import torch.distributed as dist

    from megalite.parallel import state

    state.initialize_model_parallel(tensor_model_parallel_size=world)
    model = GPTModel(preset("llama-tiny", softmax_type="learnable"), seed=5, device="cpu")
    mine = model.layers[0].attention.softmax_offset.detach()
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    state.destroy_model_parallel()
    return torch.cat(parts) if rank == 0 else None


@pytest.mark.parametrize("name", ["llama-tiny", "deepseek-tiny", "bert-tiny"])
def test_models_give_the_same_numbers_on_every_backend(name):
    config = preset(name, softmax_type="learnable")
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    cls = BERTModel if name.startswith("bert") else GPTModel
    model = cls(config, seed=3, device="cpu").eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.softmax_offset.normal_(0, 2.0, generator=torch.Generator().manual_seed(1))
    extra = {}
    if cls is BERTModel:  # padding: the second row's last five tokens
        extra = dict(padding_mask=torch.arange(16).view(1, 16) < torch.tensor([16, 11]).view(2, 1))
    outs = {}
    for backend in ("sdpa", "fused", "torch"):
        model.config.attention_backend = backend
        with torch.no_grad():
            out = model(ids, **extra)
            outs[backend] = (out[0] if isinstance(out, tuple) else out)[..., :config.vocab_size]
    assert rel_err(outs["sdpa"], outs["torch"]) <= 1e-5 and rel_err(outs["fused"], outs["torch"]) <= 1e-6
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.softmax_offset.fill_(-1e4)
        out = model(ids, **extra)
    vanilla = cls(config.replace(softmax_type="vanilla"), seed=3, device="cpu").eval()
    vanilla.load_state_dict({k: v for k, v in model.state_dict().items() if "softmax_offset" not in k})
    vanilla.config.attention_backend = "torch"
    with torch.no_grad():
        plain = vanilla(ids, **extra)
    got, plain = ((o[0] if isinstance(o, tuple) else o)[..., :config.vocab_size] for o in (out, plain))
    assert rel_err(got, plain) <= 1e-6  # a sink at -inf is the plain softmax


def test_the_generation_cache_attends_with_the_sinks():
    pytest.importorskip("transformers")
    from test_generate import _model as generation_model, assert_cached_decode_is_the_whole_prefixs

    for family in ("llama", "deepseek"):
        assert_cached_decode_is_the_whole_prefixs(generation_model(family, softmax_type="learnable"), 6)


RUN = ["--model", "llama-tiny", "--num-layers", "4", "--seq-length", "32", "--global-batch-size", "4",
       "--micro-batch-size", "1", "--log-interval", "1", "--eval-iters", "0", "--train-iters", "3",
       "--softmax-type", "learnable"]


@pytest.mark.slow
def test_training_at_tp2_with_sp_cp2_and_pp2_gives_one_ranks_losses():
    [want] = run_ranks(train_losses, 1, args=(RUN,))
    for layout in (["--tp", "2", "--sequence-parallel"], ["--cp", "2"], ["--cp", "2", "--cp-comm-type", "a2a"],
                   ["--pp", "2"]):
        for got in run_ranks(train_losses, 2, args=(RUN + layout,)):
            assert rel_err(torch.tensor(got), torch.tensor(want)) <= 1e-5, (layout, got, want)
    [plain] = run_ranks(train_losses, 1, args=(RUN[:-2],))
    assert plain[0] != want[0]


def test_checkpoints_megatron_lms_args_and_the_planner_carry_the_sinks(tmp_path):
    from megalite.checkpoint.megatron_dist_map import LAYER_KEYS, expected_names, translate_args
    from megalite.testing import RankFailure
    from megalite.tools.plan.command import model_flags
    from megalite.training.checkpoint_shape import shape_fields

    config = built_model(["--model", "llama-tiny", "--softmax-type", "learnable"])
    assert shape_fields(config)["softmax_type"] == "learnable"
    assert built_model(model_flags(config, "llama-tiny") + ["--mock-data"]).softmax_type == "learnable"
    args = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                              vocab_size=128, max_position_embeddings=32, seq_length=32, swiglu=True,
                              position_embedding_type="rope", add_bias_linear=False, softmax_type="learnable")
    rebuilt = built_model(translate_args(args, "ckpt").flags + ["--mock-data"])
    assert rebuilt.softmax_type == "learnable"
    assert "layers.1.attention.softmax_offset" in expected_names(rebuilt)
    assert LAYER_KEYS["attention.softmax_offset"] == ("self_attention.core_attention.softmax_offset",)
    args.softmax_type = "off-by-one"
    assert "attention.softmax_offset" not in " ".join(expected_names(
        built_model(translate_args(args, "ckpt").flags + ["--mock-data"])))
    # A checkpoint keeps its sinks: resumed without the flag it has them, with another type it is refused.
    save = RUN[:-2] + ["--softmax-type", "learnable", "--train-iters", "2", "--save", str(tmp_path / "ck"),
                       "--save-interval", "2"]
    run_ranks(train_losses, 1, args=(save,))
    shapeless = ["--seq-length", "32", "--global-batch-size", "4", "--micro-batch-size", "1", "--log-interval", "1",
                 "--eval-iters", "0", "--train-iters", "3", "--load", str(tmp_path / "ck")]
    [resumed] = run_ranks(train_losses, 1, args=(shapeless,))
    [straight] = run_ranks(train_losses, 1, args=(RUN,))
    assert resumed == straight[2:]
    with pytest.raises(RankFailure, match="softmax_type"):
        run_ranks(train_losses, 1, args=(shapeless + ["--model", "llama-tiny", "--softmax-type", "off-by-one"],))


def test_refusals_and_exports():
    assert "--init-method-xavier-uniform" in refusal(["--model", "llama-tiny", "--softmax-type", "learnable",
                                                      "--init-method-xavier-uniform"], 1)
    pytest.importorskip("transformers")
    from megalite.tools.convert_hf import ConversionError, to_hf

    model = GPTModel(preset("llama-tiny", softmax_type="off-by-one"), seed=1, device="cpu")
    with pytest.raises(ConversionError, match="sinks"):
        to_hf(model.config, model.state_dict())


def test_causal_sinks_keep_the_flash_call_grouped_and_maskless(monkeypatch):
    """The GPU path replayed on the CPU: causal attention without a mask with sinks is one fused-attention
    call with is_causal and no mask (flash's reach: q, k and v of one width, a multiple of 8), key groups
    not expanded; a window's mask gains only the sink's column, the groups expanded for the
    memory-efficient kernel (which takes none in torch 2.13)."""
    import torch.nn.functional as F

    from megalite.models.attention import _sdpa_attention

    calls, real = [], F.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append((tuple(q.shape), tuple(k.shape), tuple(v.shape),
                      None if attn_mask is None else tuple(attn_mask.shape), is_causal, enable_gqa))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)
    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    q, k, v, sink = _inputs(heads=4, groups=2, s=12, d=8)
    _sdpa_attention(q, k, v, None, 0.0, True, sink=sink)
    _sdpa_attention(q, k, v, band_mask(12, 12, (3, 0), True, "cpu"), 0.0, True, sink=sink)
    assert calls == [((2, 4, 13, 16), (2, 2, 13, 16), (2, 2, 13, 16), None, True, True),  # flash's: one width
                     ((2, 4, 12, 16), (2, 4, 13, 16), (2, 4, 13, 16), (1, 1, 12, 13), False, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_on_a_gpu_sinks_run_the_fused_kernels_and_equal_the_explicit_softmax(d):
    """scripts/gpu_checks.sh kernels: in bf16, causal attention with sinks runs on flash alone and a
    windowed one on the memory-efficient kernel alone (no math fallback), within bf16 of the explicit
    form, and the causal path keeps no more than vanilla's memory plus the widened copies."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megalite.models.attention import _explicit_attention, _expand_groups, _sdpa_attention

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, h, 2048, d, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (16, 4, 4))
    sink = torch.randn(16, device="cuda", dtype=torch.bfloat16, generator=gen)
    want = _explicit_attention(q.float(), *_expand_groups(k.float(), v.float(), 16), None, 0.0, True, sink.float())
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        got = _sdpa_attention(q, k, v, None, 0.0, True, sink=sink)
    assert rel_err(got.float(), want) <= 2e-2
    window = band_mask(2048, 2048, (255, 0), True, "cuda")
    want = _explicit_attention(q.float(), *_expand_groups(k.float(), v.float(), 16), window, 0.0, True, sink.float())
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        got = _sdpa_attention(q, k, v, window, 0.0, True, sink=sink)
    assert rel_err(got.float(), want) <= 2e-2
    peaks = []
    for s in (None, sink):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _sdpa_attention(q, k, v, None, 0.0, True, sink=s)
        peaks.append(torch.cuda.max_memory_allocated() - base)
    assert peaks[1] <= 3 * peaks[0] + 4 * q.numel() * q.element_size(), peaks
