"""--qk-clip and --log-max-attention-logit: each head's largest logit against the masked scores written
out (causal, padding, window, packed documents, key groups); the clip by hand on grouped-query,
multi-head and MLA attention, at tp 1 and over two TP and two DP ranks; training with the clip at
tp 2 (and above the key groups), dp 2, pp 2, ZeRO-1 and ZeRO-3 and under Muon equal to one rank and
moved by it; no host sync; the refusals."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from helpers import rel_err
from megalite.models import TransformerConfig
from megalite.models.window import band_mask
from megalite.testing import run_ranks
from training_ranks import refusal, steady_host_syncs, train_losses


def _largest(q, k, allowed):
    """Per head, the largest q.k / sqrt(d) where `allowed` (written out, float64)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("case", ["causal", "padding", "window", "documents"])
def test_each_heads_largest_logit_over_what_its_mask_allows(case):
    from megalite.models.attention import local_core
    from megalite.models.documents import PackedDocuments
    from megalite.models.max_logit import record_max_logits

    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 16, 8) * 3, torch.randn(2, 2, 16, 8) * 3
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2)
    module = SimpleNamespace(config=config, window=None, training=True, max_logits=torch.full((4,), -math.inf))
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    mask, allowed = None, causal
    if case == "padding":  # a given mask is the whole of it (BERT's): row 1's last 5 keys are padding
        mask = torch.ones(2, 1, 1, 16, dtype=torch.bool)
        mask[1, ..., 11:] = False
        allowed = mask
    elif case == "window":
        module.window = (4, 0)
        allowed = band_mask(16, 16, (4, 0), True, "cpu")
    elif case == "documents":
        mask = PackedDocuments(torch.zeros(2, 16, dtype=torch.long), torch.tensor([0, 5, 16, 25, 32]), None)
        pos = torch.arange(16)
        allowed = torch.stack([(d[:, None] == d[None, :]) & causal for d in
                               (torch.bucketize(pos, torch.tensor(c), right=True) for c in ([5, 16], [9, 16]))])[:, None]
    record_max_logits(module, q, k, mask, local_core)
    first = module.max_logits.clone()
    assert rel_err(first, _largest(q, k, allowed).float()) <= 1e-6
    record_max_logits(module, q * 0.5, k, mask, local_core)  # a running max: the smaller pass changes nothing
    assert torch.equal(module.max_logits, first)
    module.training = False
    record_max_logits(module, q * 4, k, mask, local_core)
    assert torch.equal(module.max_logits, first)


ALPHA, THRESHOLD = 0.3, 1.0


def _clip_by_hand(rank, world, kind, tp, logits):
    """Weights (this rank's) before and after QKClip with the heads' maxima `logits` (a row per DP rank)."""
    from megalite import parallel
    from megalite.models.attention import ParallelAttention
    from megalite.models.mla import MultiLatentAttention
    from megalite.training.qk_clip import QKClip

    parallel.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(0)
    common = dict(num_layers=1, hidden_size=32, num_attention_heads=4)
    if kind == "mla":
        config = TransformerConfig(**common, multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=8,
                                   qk_head_dim=4, qk_pos_emb_head_dim=2, v_head_dim=4,
                                   position_embedding_type="rope")
        layer = MultiLatentAttention(config, torch.nn.init.normal_, torch.nn.init.normal_, device="cpu")
        weights = [layer.q.weight, layer.kv_up.weight]
    else:
        config = TransformerConfig(**common, num_query_groups=2 if kind == "gqa" else None)
        layer = ParallelAttention(config, torch.nn.init.normal_, torch.nn.init.normal_, device="cpu")
        weights = [layer.q.weight, layer.kv.weight] if kind == "gqa" else [layer.qkv.weight]
    buffer = SimpleNamespace(param_range=lambda p: (0, p.numel()), device=torch.device("cpu"))
    optimizer = SimpleNamespace(pieces=[SimpleNamespace(param=w, master=w.data, lo=0, hi=w.numel(), buffer=buffer)
                                        for w in weights], buffers=[buffer])
    clip = QKClip([layer], optimizer, ALPHA, THRESHOLD, clip=True)
    dp_rank = parallel.get_data_parallel_rank()
    mine = torch.tensor(logits[dp_rank]).chunk(tp)[parallel.get_tensor_model_parallel_rank()]
    layer.max_logits = mine.clone()
    before = [w.detach().clone() for w in weights]
    clip(torch.tensor(0.0))
    skipped = [w.detach().clone() for w in weights]
    layer.max_logits = mine.clone()
    clip(torch.tensor(1.0))  # a skipped step clips nothing
    assert all(torch.equal(a, b) for a, b in zip(skipped, weights))
    return before, skipped, clip.largest.item()


def _expected(kind, before, logits):
    """The clipped weights (whole), from the heads' maxima over DP."""
    heads = torch.tensor(logits).amax(0)
    if kind == "mla":
        eta = torch.where(heads > THRESHOLD, THRESHOLD / heads, torch.ones(4))[:, None]
        q = before[0].view(4, 6, -1) * torch.cat([eta.expand(-1, 4) ** ALPHA, eta.expand(-1, 2)], 1)[..., None]
        kv = before[1].view(4, 8, -1) * torch.cat([eta.expand(-1, 4) ** (1 - ALPHA), torch.ones(4, 4)], 1)[..., None]
        return [q.view_as(before[0]), kv.view_as(before[1])]
    groups = 2 if kind == "gqa" else 4
    group_max = heads.view(groups, -1).amax(1)
    eta = torch.where(group_max > THRESHOLD, THRESHOLD / group_max, torch.ones(groups))
    per_head = eta.repeat_interleave(4 // groups)
    if kind == "mha":  # rows [heads, (q, k, v), d]
        rows = torch.stack([per_head ** ALPHA, per_head ** (1 - ALPHA), torch.ones(4)], 1)
        return [(before[0].view(4, 3, 8, -1) * rows[..., None, None]).view_as(before[0])]
    q = before[0].view(4, 8, -1) * (per_head ** ALPHA)[:, None, None]
    kv = before[1].view(2, 2, 8, -1) * torch.stack([eta ** (1 - ALPHA), torch.ones(2)], 1)[..., None, None]
    return [q.view_as(before[0]), kv.view_as(before[1])]


@pytest.mark.parametrize("kind", ["gqa", "mha", "mla"])
def test_the_clip_by_hand_at_tp1_and_over_two_tp_and_two_dp_ranks(kind):
    logits = [[0.5, 3.0, 1.0, 0.8], [0.2, 0.1, 0.9, 4.0]]  # a row per DP rank
    [(before, after, largest)] = run_ranks(_clip_by_hand, 1, args=(kind, 1, logits[:1]))
    want = _expected(kind, before, logits[:1])
    assert all(rel_err(a, w) <= 1e-6 for a, w in zip(after, want)) and largest == 3.0
    assert not torch.equal(after[0], before[0])
    for tp in (2, 1):  # tp 2 (heads over two ranks); dp 2 (each rank saw other maxima)
        results = run_ranks(_clip_by_hand, 2, args=(kind, tp, logits[:1] if tp == 2 else logits))
        whole_before = [torch.cat(parts) for parts in zip(*(r[0] for r in results))] if tp == 2 else results[0][0]
        want = _expected(kind, whole_before, logits[:1] if tp == 2 else logits)
        got = [torch.cat(parts) for parts in zip(*(r[1] for r in results))] if tp == 2 else results[0][1]
        assert all(rel_err(a, w) <= 1e-6 for a, w in zip(got, want)), (tp, kind)


RUN = ["--model", "llama-tiny", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
       "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "16",
       "--global-batch-size", "4", "--micro-batch-size", "1", "--log-interval", "1", "--train-iters", "4",
       "--lr", "0.02", "--qk-clip", "--qk-clip-threshold", "0.05", "--qk-clip-alpha", "0.4"]


def _max_logits(rank, world, argv):
    from training_ranks import gpt_run

    return [r["max_attention_logit"] for r in gpt_run(argv).records]


def _losses_and_max_logits(rank, world, argv):
    from training_ranks import gpt_run

    records = gpt_run(argv).records
    return [r["loss"] for r in records] + [r["max_attention_logit"] for r in records]


@pytest.mark.slow
def test_training_with_the_clip_at_tp2_dp2_pp2_zero1_zero3_and_muon_gives_one_ranks_losses():
    [want] = run_ranks(train_losses, 1, args=(RUN,))
    [clipped] = run_ranks(_max_logits, 1, args=(RUN,))
    [free] = run_ranks(_max_logits, 1, args=(RUN[:-5] + ["--log-max-attention-logit"],))
    # the clip holds the largest logit near the threshold (each step's update moves it a little)
    assert free[0] == clipped[0] > 0.1 and all(x < 0.09 for x in clipped[1:]) and all(x > 0.1 for x in free), (
        clipped, free)
    both = want + clipped  # the losses, then the logged largest logits (every head's, every stage's)
    for world, layout in ((2, ["--tp", "2", "--sequence-parallel"]), (4, ["--tp", "4"]), (2, []), (2, ["--pp", "2"]),
                          (2, ["--use-distributed-optimizer"]), (2, ["--zero-stage", "3"])):
        got = run_ranks(_losses_and_max_logits, world, args=(RUN + layout,))[-1]
        assert rel_err(torch.tensor(got), torch.tensor(both)) <= 1e-5, (layout, got, both)
    [bf16] = run_ranks(_max_logits, 1, args=(RUN + ["--bf16"],))  # masters copied into bf16 weights after the clip
    assert bf16[0] > 0.1 and all(x < 0.09 for x in bf16[1:]), bf16
    mla = ["--model", "deepseek-tiny", "--seq-length", "16", "--global-batch-size", "4", "--micro-batch-size", "1",
           "--log-interval", "1", "--train-iters", "3", "--lr", "0.02", "--qk-clip", "--qk-clip-threshold", "0.02"]
    [one] = run_ranks(_losses_and_max_logits, 1, args=(mla,))
    [mla_free] = run_ranks(_max_logits, 1, args=(mla[:-3] + ["--log-max-attention-logit"],))
    assert one[-1] < mla_free[-1], (one, mla_free)
    got = run_ranks(_losses_and_max_logits, 2, args=(mla + ["--tp", "2", "--sequence-parallel"],))[-1]
    assert rel_err(torch.tensor(got), torch.tensor(one)) <= 1e-5, (got, one)
    muon = ["--optimizer", "muon", "--muon-fp32-matmul-prec", "highest", "--muon-tp-mode", "duplicated"]
    [one] = run_ranks(train_losses, 1, args=(RUN + muon,))
    got = run_ranks(train_losses, 2, args=(RUN + muon + ["--tp", "2"],))[-1]
    assert rel_err(torch.tensor(got), torch.tensor(one)) <= 1e-5


def test_no_host_sync_and_the_refusals():
    quiet = RUN + ["--log-interval", "100", "--train-iters", "5"]
    assert run_ranks(steady_host_syncs, 1, args=([quiet],))[0] == [0]
    assert "context parallelism" in refusal(RUN + ["--cp", "2"], 2)
    assert "--torch-compile" in refusal(RUN + ["--torch-compile"], 1)
    assert "--qk-clip" in refusal(RUN[:-5] + ["--qk-clip-alpha", "0.2"], 1)
    assert "normalizes q and k" in refusal(RUN + ["--qk-layernorm"], 1)
    assert "context parallelism" in refusal(RUN[:-5] + ["--log-max-attention-logit", "--cp", "2"], 2)
