"""Sliding-window attention (Megatron-LM's --window-size and --window-attn-skip-freq). The band is
Megatron-Core's mask and Hugging Face's, written out from their formulas; the layer pattern is
Megatron-Core's rule; every backend and path (explicit, fused softmax, PyTorch's fused attention,
packed documents, flash's variable-length kernel through a CPU stand-in, ring and all-to-all context
parallelism, the generation cache, MLA) gives the band's numbers; Hugging Face's Mistral and Qwen2
windows import and export with the same logits; tp 2 with SP, cp 2 and pp 2 train as one rank; the
setting travels through checkpoints and Megatron-LM's args, and bad settings are refused."""
from __future__ import annotations

import argparse

import pytest
import torch

from helpers import rel_err
from megalite.models import GPTModel
from megalite.models.presets import preset
from megalite.models.window import band, band_mask, window_pattern
from megalite.testing import run_ranks
from training_ranks import built_model as _built, train_losses as losses


def _megatron_band(sq: int, sk: int, window) -> torch.Tensor:
    """Megatron-Core's get_sliding_window_causal_mask, from its formula: ones, upper triangle from
    diagonal sk - sq - left, lower from sk - sq + right; True there = attend (Megatron inverts it)."""
    ones = torch.ones(sq, sk, dtype=torch.bool)
    return torch.tril(torch.triu(ones, diagonal=sk - sq - window[0]), diagonal=sk - sq + window[1])


@pytest.mark.parametrize("window", [(3, 0), (0, 0), (5, 2), (2, 7)])
def test_the_band_is_megatron_cores_and_hugging_faces(window):
    # bidirectional: Megatron-Core's mask as it is, queries aligned to the last of the keys
    for sq, sk in ((12, 12), (4, 12)):
        assert torch.equal(band_mask(sq, sk, window, False, "cpu")[0, 0], _megatron_band(sq, sk, window))
    # causal: Transformer Engine's right side 0; Hugging Face's sliding_window W = left + 1 (kv > q - W)
    q, k = torch.arange(12)[:, None], torch.arange(12)[None, :]
    hugging_face = (k <= q) & (k > q - (window[0] + 1))
    assert torch.equal(band_mask(12, 12, window, True, "cpu")[0, 0], hugging_face)
    assert torch.equal(band(torch.arange(12), torch.arange(12), (-1, -1), True), (k <= q))


def test_which_layers_are_windowed_is_megatron_cores_rule():
    # is_layer_window_attention: 1-based layer_number % N != 0, or the list's entry
    assert window_pattern(None, 4) == [1, 1, 1, 1]
    assert window_pattern(2, 5) == [1, 0, 1, 0, 1]
    assert window_pattern(4, 8) == [1, 1, 1, 0, 1, 1, 1, 0]
    assert window_pattern("[1,1,1,0]*2", 8) == window_pattern(4, 8)
    assert window_pattern("([1]*2+[0]*1)", 3) == [1, 1, 0]
    config = _built(["--model", "llama-tiny", "--window-size", "4096,0", "--window-attn-skip-freq", "2"])
    assert [config.window_of(n) for n in range(4)] == [(4096, 0), None, (4096, 0), None]
    assert _built(["--model", "llama-tiny", "--window-size", "(8, 0)"]).window_attn_skip_freq is None
    assert _built(["--model", "llama-tiny", "--window-size", "8"]).window_size == (8, 0)


def _model(config, seed=3):
    model = GPTModel(config, seed=seed, device="cpu").eval()
    with torch.no_grad():
        for p in model.parameters():  # off the init: every weight matters
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    return model


@torch.no_grad()
def _reference_logits(model, ids, window):
    """The model's logits with every layer's attention computed by hand in float64: softmax of
    q k^T / sqrt(d) over Megatron-Core's band of `window` (written out above, causal too) where the
    layer is windowed (it passes a mask: the model has none of its own), else over the causal mask;
    and how many layers were windowed."""
    from megalite.models import attention as attention_module

    windowed = []

    def by_hand(q, k, v, allowed, dropout_p, causal):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        scores = (q.double() @ k.double().transpose(-1, -2)) / q.shape[-1] ** 0.5
        s = q.shape[2]
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        if allowed is not None:
            windowed.append(True)
            mask = mask & _megatron_band(s, s, window)
        return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v.double()).to(q.dtype)

    saved = dict(attention_module.ATTENTION_BACKENDS)
    attention_module.ATTENTION_BACKENDS.update(torch=by_hand)
    try:
        model.config.attention_backend = "torch"
        return model(ids), len(windowed)
    finally:
        attention_module.ATTENTION_BACKENDS.clear()
        attention_module.ATTENTION_BACKENDS.update(saved)


@pytest.mark.parametrize("name, window, skip", [("llama-tiny", (3, 0), None), ("llama-tiny", (2, 0), [1, 0, 1, 1]),
                                                ("deepseek-tiny", (4, 0), None), ("gpt-tiny", (3, 5), None)])
def test_every_backend_gives_the_bands_numbers(name, window, skip):
    config = preset(name, window_size=window, window_attn_skip_freq=skip)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    model = _model(config)
    want, windowed = _reference_logits(_model(config.replace(attention_backend="torch")), ids, window)
    assert windowed == (sum(skip) if skip else config.num_layers)
    for backend in ("sdpa", "fused", "torch"):
        model.config.attention_backend = backend
        with torch.no_grad():
            assert rel_err(model(ids), want) <= 1e-5, backend
    full = _model(config.replace(window_size=None, window_attn_skip_freq=None))
    with torch.no_grad():
        got, unwindowed = model(ids), full(ids)
    assert rel_err(got, unwindowed) > 1e-3  # the window changes what far tokens see
    # and nothing of what the first left + 1 tokens see (a causal model's right side is 0)
    assert rel_err(got[:, :window[0] + 1], unwindowed[:, :window[0] + 1]) <= 1e-6


def test_a_masked_grouped_call_reaches_the_kernels_with_the_groups_expanded(monkeypatch):
    """The GPU path replayed on the CPU: with a mask (a window, generation's cache) PyTorch's fused
    attention runs the memory-efficient kernel, which takes no key groups in torch 2.13 (math would
    keep heads x s x s scores): one call, the groups expanded, the numbers unchanged; without a mask the
    groups stay (flash takes them)."""
    import torch.nn.functional as F

    from megalite.models.attention import _sdpa_attention

    calls, real = [], F.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append((k.shape[1], attn_mask is not None, enable_gqa))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, 16, 8, generator=gen) for h in (4, 2, 2))
    mask = band_mask(16, 16, (3, 0), True, "cpu")
    want = real(q, k, v, attn_mask=mask, enable_gqa=True)
    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    got = _sdpa_attention(q, k, v, mask, 0.0, True)
    _sdpa_attention(q, k, v, None, 0.0, True)
    assert calls == [(4, True, False), (2, False, True)]
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", ["sdpa", "fused", "torch"])
def test_a_bidirectional_window_bounds_both_sides(backend):
    from megalite.models.attention import local_core

    config = preset("bert-tiny", attention_backend=backend, causal=False)
    assert not config.causal
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 12, 8, generator=gen) for _ in range(3))
    padding = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    padding[1, ..., 9:] = False  # the second row's last 3 tokens are padding
    got = local_core(q, k, v, padding, config, 0.0, (2, 3))
    allowed = _megatron_band(12, 12, (2, 3)) & padding | torch.eye(12, dtype=torch.bool)  # padding sees itself
    assert got.isfinite().all()
    assert rel_err(got, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)) <= 1e-6


def test_packed_documents_attend_within_their_document_and_the_window():
    from megalite.models.attention import _sdpa_attention
    from megalite.models.documents import PackedDocuments, varlen_attention

    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=gen) for _ in range(3))
    bounds = torch.tensor([0, 5, 12, 16, 23, 32])  # row 0: 5 + 7 + 4 tokens; row 1: 7 + 9
    documents = PackedDocuments(starts=torch.zeros(2, 16, dtype=torch.long), bounds=bounds, position_ids=None)
    got = varlen_attention(q, k, v, documents, _sdpa_attention, 0.0, window=(2, 0))
    position = torch.arange(32)
    document = torch.bucketize(position, bounds[1:], right=True)
    allowed = band(position, position, (2, 0), True) & (document[:, None] == document[None, :])
    flat = [t.permute(1, 0, 2, 3).reshape(4, 32, 8) for t in (q, k, v)]  # rows one after the other
    want = torch.nn.functional.scaled_dot_product_attention(*flat, attn_mask=allowed)
    assert rel_err(got.permute(1, 0, 2, 3).reshape(4, 32, 8), want) <= 1e-6


def test_flash_varlen_kernel_gets_the_window_one_sequence_per_row(monkeypatch):
    """On a GPU in half precision the window goes to flash's variable-length kernel, rows as its
    sequences, no mask made: replayed here with a CPU stand-in that honours window_size."""
    from megalite.models import attention as attention_module
    from megalite.models import documents as docs

    calls = []

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size, enable_gqa):
        assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
        calls.append((cu_q.tolist(), max_q, window_size, enable_gqa))
        out = []
        for lo, hi in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            part = [t[lo:hi].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
            n = hi - lo
            mask = band(torch.arange(n), torch.arange(n), window_size, True)
            out.append(torch.nn.functional.scaled_dot_product_attention(*part, attn_mask=mask,
                                                                        enable_gqa=enable_gqa)[0].transpose(0, 1))
        return torch.cat(out)

    config = preset("llama-tiny", window_size=(3, 0))
    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 8, 16, 8, generator=gen), torch.randn(2, 4, 16, 8, generator=gen), \
        torch.randn(2, 4, 16, 8, generator=gen)
    want = attention_module.local_core(q, k, v, None, config, 0.0, (3, 0))
    monkeypatch.setattr(attention_module, "flash_varlen_applies", lambda q, v, p: True)
    monkeypatch.setattr(docs, "_varlen_attn", lambda: varlen_attn)
    got = attention_module.local_core(q, k, v, None, config, 0.0, (3, 0))
    assert calls == [([0, 16, 32], 16, (3, 0), True)]
    assert rel_err(got, want) <= 1e-6


def _ring(rank, world, window_left, seq, variant):
    import torch.distributed as dist

    from megalite.parallel.context_parallel import (context_parallel_positions, gather_from_context_parallel,
                                                    ring_attention, split_for_context_parallel)
    from megalite.parallel.context_parallel_a2a import a2a_attention

    gen = torch.Generator().manual_seed(5)
    q, k, v, grad = (torch.randn(2, h, seq, 8, generator=gen) for h in (4, 2, 2, 4))
    mine = [split_for_context_parallel(t, 2, rank, world).requires_grad_() for t in (q, k, v)]
    ranks = list(range(world))
    window = (window_left, 0)
    if variant == "ring":
        out = ring_attention(*mine, dist.group.WORLD, ranks, window_left=window_left)
    else:
        from megalite.models.attention import _sdpa_attention

        def attend(q, k, v):
            return _sdpa_attention(q, k, v, band_mask(seq, seq, window, True, "cpu"), 0.0, True)
        out = a2a_attention(*mine, dist.group.WORLD, ranks, attend=attend)
    out.backward(split_for_context_parallel(grad, 2, rank, world))
    shares = [torch.empty_like(out) for _ in ranks]
    dist.all_gather(shares, out.detach().contiguous())
    grads = []
    for t in mine:
        parts = [torch.empty_like(t.grad) for _ in ranks]
        dist.all_gather(parts, t.grad.contiguous())
        grads.append(gather_from_context_parallel(parts, 2))
    assert context_parallel_positions(seq, rank, world).numel() == seq // world
    return gather_from_context_parallel(shares, 2), grads


@pytest.mark.parametrize("world, window_left, variant", [(2, 3, "ring"), (4, 2, "ring"), (4, 9, "ring"),
                                                         (2, 3, "a2a")])
def test_context_parallel_attention_within_a_window_equals_one_device(world, window_left, variant):
    seq = 32
    gen = torch.Generator().manual_seed(5)
    q, k, v, grad = (torch.randn(2, h, seq, 8, generator=gen) for h in (4, 2, 2, 4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=band_mask(seq, seq, (window_left, 0), True, "cpu"), enable_gqa=True)
    want.backward(grad)
    for out, grads in run_ranks(_ring, world, args=(window_left, seq, variant)):
        assert rel_err(out, want.detach()) <= 1e-5
        for got, t in zip(grads, (q, k, v)):
            assert rel_err(got, t.grad) <= 1e-5


def test_ring_blocks_wholly_outside_the_window_are_skipped():
    from megalite.parallel.context_parallel import _block_plan, context_parallel_positions, window_live_blocks

    for world, local, left in ((2, 8, 1), (4, 8, 2), (4, 8, 5), (4, 8, 30), (8, 4, 3)):
        whole = world * local
        for rank in range(world):
            q_pos = context_parallel_positions(whole, rank, world)
            want = []
            for step in range(world):
                owner = (rank - step) % world
                rows, keys, _ = _block_plan(rank, owner, local, True)
                k_pos = context_parallel_positions(whole, owner, world)[keys]
                back = q_pos[rows][:, None] - k_pos[None, :]
                want.append(bool(((back >= 0) & (back <= left)).any()))
            assert list(window_live_blocks(rank, world, local, left)) == want, (world, local, left, rank)
    # rank 0 holds 0-3 and 28-31; at steps 1, 2, 3 the blocks of ranks 3 (12-15, 16-19), 2 (8-11, 20-23)
    # and 1 (4-7, 24-27): later ranks', seen by 28-31 alone, only 24-27 within 2 positions
    assert list(window_live_blocks(0, 4, 8, 2)) == [True, False, False, True]


def test_the_generation_cache_attends_within_the_window():
    pytest.importorskip("transformers")
    from test_generate import _model as generation_model, assert_cached_decode_is_the_whole_prefixs

    for family in ("llama", "deepseek"):
        assert_cached_decode_is_the_whole_prefixs(generation_model(family, window_size=(3, 0)), 6)


def _hf(tf, arch, **extra):
    cls = getattr(tf, arch + "Config")
    config = cls(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False,
                 bos_token_id=0, eos_token_id=1, pad_token_id=None, **extra)
    torch.manual_seed(0)
    return getattr(tf, arch + "ForCausalLM")(config).eval()


@pytest.mark.parametrize("arch, extra, window, pattern", [
    ("Mistral", dict(sliding_window=6), (5, 0), None),
    ("Mixtral", dict(sliding_window=6, num_local_experts=4), (5, 0), None),
    ("Qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=2), (5, 0), [0, 0, 1, 1])])
def test_hugging_face_windows_import_and_export_with_the_same_logits(arch, extra, window, pattern):
    tf = pytest.importorskip("transformers")
    from megalite.tools.convert_hf import from_hf, to_hf

    hf = _hf(tf, arch, **extra)
    config, state = from_hf(hf)
    assert (config.window_size, config.window_attn_skip_freq, config.max_position_embeddings) == (window, pattern, 64)
    model = GPTModel(config, seed=0, device="cpu").eval()
    model.load_state_dict(state)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))  # 4 windows long
    with torch.no_grad():
        want = hf(ids).logits
        assert rel_err(model(ids)[..., :128], want) <= 1e-5
        back = to_hf(config, model.state_dict())
        assert type(back).__name__ == f"{arch}ForCausalLM" and back.config.sliding_window == 6
        if pattern is not None:  # older readers go by max_window_layers: the first windowed layer
            assert back.config.max_window_layers == 2
        assert rel_err(back(ids).logits, want) <= 1e-5


def test_an_export_the_architecture_cannot_hold_is_refused():
    pytest.importorskip("transformers")
    from megalite.tools.convert_hf import ConversionError, llama, moe, to_hf

    for name in ("gpt-tiny", "deepseek-tiny"):  # GPT-2 and DeepSeek-V3 have no window: not dropped silently
        config = preset(name, window_size=(3, 0))
        with pytest.raises(ConversionError, match="sliding window"):
            to_hf(config, GPTModel(config, seed=0, device="cpu").state_dict())
    experts = preset("moe-tiny", window_size=(5, 0), window_attn_skip_freq=2)
    assert any("Qwen2MoeForCausalLM" in p for p in moe.export_problems(experts, moe.MIXTRAL))
    # a skip frequency of 1 leaves no layer windowed: nothing to export, Llama holds it
    nowhere = preset("llama-tiny", window_size=(5, 0), window_attn_skip_freq=1)
    assert llama.hf_window(nowhere) is None and not llama.export_problems(nowhere, llama.LLAMA)

    both_sides = preset("llama-tiny", window_size=(5, 0))
    assert any("sliding window" in p for p in llama.export_problems(both_sides, llama.LLAMA))
    assert not llama.export_problems(both_sides, llama.MISTRAL)
    skipping = preset("llama-tiny", window_size=(5, 0), window_attn_skip_freq=2)
    assert any("window_attn_skip_freq" in p for p in llama.export_problems(skipping, llama.MISTRAL))
    assert llama.default_architecture(both_sides) == llama.MISTRAL


RUN = ["--model", "llama-tiny", "--num-layers", "4", "--seq-length", "32", "--global-batch-size", "4",
       "--micro-batch-size", "1", "--log-interval", "1", "--eval-iters", "0", "--train-iters", "3",
       "--window-size", "5,0", "--window-attn-skip-freq", "[1,0,1,1]"]


@pytest.mark.slow
def test_training_at_tp2_with_sp_cp2_and_pp2_gives_one_ranks_losses():
    [want] = run_ranks(losses, 1, args=(RUN,))
    for layout in (["--tp", "2", "--sequence-parallel"], ["--cp", "2"], ["--cp", "2", "--cp-comm-type", "a2a"],
                   ["--pp", "2"]):
        for got in run_ranks(losses, 2, args=(RUN + layout,)):
            assert rel_err(torch.tensor(got), torch.tensor(want)) <= 1e-5, (layout, got, want)
    [full] = run_ranks(losses, 1, args=(RUN[:-4],))
    assert full[0] != want[0]


def test_checkpoints_and_megatron_lms_args_carry_the_window(tmp_path):
    from megalite.checkpoint.megatron_dist_map import translate_args
    from megalite.training.checkpoint_shape import shape_fields

    config = _built(["--model", "llama-tiny", "--window-size", "5,0", "--window-attn-skip-freq", "2"])
    fields = shape_fields(config)
    assert (fields["window_size"], fields["window_attn_skip_freq"]) == ("5,0", "[1,0,1,0]")
    assert "window_size" not in shape_fields(_built(["--model", "llama-tiny"]))
    from megalite.tools.plan.command import model_flags  # the planner's command for the model builds it back

    assert _built(model_flags(config, "llama-tiny") + ["--mock-data"]).window_of(1) is None
    args = argparse.Namespace(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                              vocab_size=128, max_position_embeddings=32, seq_length=32, swiglu=True,
                              position_embedding_type="rope", add_bias_linear=False, window_size=(5, 0),
                              window_attn_skip_freq=[1, 1, 1, 0])
    rebuilt = _built(translate_args(args, "ckpt").flags + ["--mock-data"])
    assert (rebuilt.window_size, rebuilt.window_attn_skip_freq) == ((5, 0), [1, 1, 1, 0])
    args.window_attn_skip_freq = 2
    assert _built(translate_args(args, "ckpt").flags + ["--mock-data"]).window_attn_skip_freq == [1, 0, 1, 0]
    # A checkpoint keeps its window: resumed without the flags it has it, with another it is refused.
    save = RUN[:-2] + ["--train-iters", "2", "--save", str(tmp_path / "ck"), "--save-interval", "2"]
    run_ranks(losses, 1, args=(save,))
    shapeless = ["--seq-length", "32", "--global-batch-size", "4", "--micro-batch-size", "1", "--log-interval", "1",
                 "--eval-iters", "0", "--train-iters", "3", "--load", str(tmp_path / "ck")]
    [resumed] = run_ranks(losses, 1, args=(shapeless,))
    [straight] = run_ranks(losses, 1, args=(RUN[:-2] + ["--train-iters", "3"],))
    assert resumed == straight[2:]
    from megalite.testing import RankFailure

    with pytest.raises(RankFailure, match="window_size"):
        run_ranks(losses, 1, args=(shapeless + ["--model", "llama-tiny", "--window-size", "7,0"],))


@pytest.mark.parametrize("argv, message", [
    (["--window-attn-skip-freq", "2"], "add --window-size"),
    (["--window-size", "a,b"], "is not a window"),
    (["--window-size", "4,-2"], "integers >= -1"),
    (["--window-size", "4,0", "--window-attn-skip-freq", "[1,0]"], "lists 2 entries"),
    (["--window-size", "4,0", "--window-attn-skip-freq", "0"], "must be >= 1")])
def test_bad_windows_are_refused_in_one_line(argv, message):
    from megalite.errors import UsageError

    with pytest.raises(UsageError, match=message):
        _built(["--model", "llama-tiny"] + argv)
    with pytest.raises(UsageError, match="prediction layers have no entry"):
        _built(["--model", "deepseek-tiny", "--window-size", "4,0", "--window-attn-skip-freq", "2",
                "--mtp-num-layers", "1"])
