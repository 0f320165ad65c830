"""Documents packed into a sequence (Megatron-LM's --reset-attention-mask, --reset-position-ids,
--eod-mask-loss): a packed batch gives what the same documents give run one by one, at every layout,
and the loss is normalized as Megatron-LM normalizes it."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from helpers import assert_rel_close, full_tensors, rel_err
from megalite import parallel
from megalite.data.documents import DocumentFlags, document_bounds, document_starts, with_documents
from megalite.data.synthetic import SyntheticTokens
from megalite.models import GPTModel
from megalite.models.documents import PackedDocuments
from megalite.models.presets import preset
from megalite.parallel.context_parallel import gather_from_context_parallel
from megalite.testing import run_ranks
from megalite.training.batches import context_parallel_share
from training_ranks import parse

EOD, VOCAB, SEQ = 5, 64, 32


def test_documents_follow_megatron_lms_rule_an_eod_ends_its_document():
    # Row 0: EOD at 2 and 5; row 1: EOD at the last position only (nothing follows it).
    tokens = torch.tensor([[9, 8, EOD, 7, 6, EOD, 9, 9], [7, 7, 7, 7, 7, 7, 7, EOD]])
    starts = document_starts(tokens, EOD)
    assert starts.tolist() == [[0, 0, 0, 3, 3, 3, 6, 6], [0] * 8]
    assert document_bounds(starts).tolist() == [0, 3, 6, 8, 16]
    batch = with_documents({"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(2, 8)},
                           DocumentFlags(EOD, reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True))
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 0, 1], list(range(8))]
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 1, 1, 0, 1, 1], [1] * 7 + [0]]
    only_loss = with_documents({"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(2, 8)},
                               DocumentFlags(EOD, eod_mask_loss=True))
    assert set(only_loss) == {"tokens", "labels", "loss_mask"}  # nothing for attention or positions


def packed_batch(batch_size: int = 2, seed: int = 3) -> dict:
    """Documents of 1 to 13 tokens packed into SEQ-token rows (one row a single document)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(EOD + 1, VOCAB, (batch_size, SEQ), generator=gen)
    for row in range(batch_size - 1):
        at = 0
        while True:
            at += int(torch.randint(1, 14, (1,), generator=gen))
            if at >= SEQ:
                break
            tokens[row, at - 1] = EOD
    labels = torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen)
    return with_documents({"tokens": tokens, "labels": labels, "loss_mask": torch.ones(batch_size, SEQ)},
                          DocumentFlags(EOD, True, True, True))


def one_by_one(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token losses [b, s], masked sum) of every document run alone, positions from 0."""
    s = batch["tokens"].shape[1]
    bounds = batch["document_bounds"].tolist()
    rows = [[] for _ in range(batch["tokens"].shape[0])]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        row = lo // s
        cut = slice(lo - row * s, hi - row * s)
        rows[row].append(model(batch["tokens"][row:row + 1, cut], labels=batch["labels"][row:row + 1, cut]))
    losses = torch.cat([torch.cat(r, 1) for r in rows], 0)
    return losses, (losses * batch["loss_mask"]).sum()


MODELS = {"gpt-tiny": {}, "llama-tiny": {}, "deepseek-tiny": {"moe_router_topk": 2}}


def reference_runs(rank, world, backends):
    """For each model and attention backend: the packed batch's per-token losses and gradients, and
    the same documents' one by one."""
    parallel.initialize_model_parallel(1, 1)
    out = {}
    for name, extra in MODELS.items():
        for backend in backends:
            config = preset(name, vocab_size=VOCAB, attention_backend=backend, **extra)
            model = GPTModel(config, seed=7).eval()
            batch = packed_batch()
            runs = []
            for packed in (True, False):
                model.zero_grad()
                if packed:
                    losses = model(batch["tokens"], attention_mask=PackedDocuments.of_batch(batch),
                                   labels=batch["labels"])
                    total = (losses * batch["loss_mask"]).sum()
                else:
                    losses, total = one_by_one(model, batch)
                total.backward()
                params = {n: p for n, p in model.named_parameters() if p.grad is not None}
                runs.append((losses.detach(), full_tensors({n: p.grad for n, p in params.items()}, params, VOCAB)))
            out[name, backend] = runs
    return out


@pytest.fixture(scope="module")
def references():
    return run_ranks(reference_runs, 1, args=(("sdpa", "torch", "fused"),))[0]


def test_a_packed_batch_equals_its_documents_one_by_one(references):
    # GPT-2 (learned positions), Llama (rope, grouped keys), DeepSeek-V3 (MLA, MoE); every backend.
    for (name, backend), (packed, alone) in references.items():
        what = f"{name} {backend}"
        assert_rel_close(packed[0], alone[0], what=f"per-token losses {what}")
        assert packed[1].keys() == alone[1].keys()
        for n, g in alone[1].items():
            assert_rel_close(packed[1][n], g, what=f"grad of {n} {what}")


def packed_at_layout(rank, world, layouts):
    """llama-tiny's packed per-token losses and full gradients at each (tp, cp, sp, cp_comm_type)."""
    out = []
    for tp, cp, sp, comm in layouts:
        parallel.initialize_model_parallel(tp, 1, context_parallel_size=cp)
        config = preset("llama-tiny", vocab_size=VOCAB, sequence_parallel=sp, cp_comm_type=comm)
        model = GPTModel(config, seed=7).eval()
        batch = packed_batch()
        if cp > 1:
            batch = context_parallel_share(batch, SEQ, parallel.get_context_parallel_rank(), cp)
        losses = model(batch["tokens"], attention_mask=PackedDocuments.of_batch(batch), labels=batch["labels"])
        (losses * batch["loss_mask"]).sum().backward()
        if cp > 1:
            shares = [torch.empty_like(losses) for _ in range(cp)]
            dist.all_gather(shares, losses.detach().contiguous(), group=parallel.get_context_parallel_group())
            losses = gather_from_context_parallel(shares, dim=1)
        params = dict(model.named_parameters())
        for p in params.values():
            if cp > 1:  # each CP rank's tokens' part
                dist.all_reduce(p.grad, group=parallel.get_context_parallel_group())
            if tp > 1 and (getattr(p, "sequence_parallel", False) or getattr(p, "partial_over_tp", False)):
                dist.all_reduce(p.grad, group=parallel.get_tensor_model_parallel_group())
        out.append((losses.detach(), full_tensors({n: p.grad for n, p in params.items()}, params, VOCAB)))
        parallel.destroy_model_parallel()
    return out


def test_packed_documents_at_tp_2_with_sp_and_at_cp_2_ring_and_all_to_all(references):
    layouts = [(2, 1, True, "p2p"), (1, 2, False, "p2p"), (1, 2, False, "a2a")]
    runs = run_ranks(packed_at_layout, 2, args=(layouts,))[0]
    _, alone = references["llama-tiny", "sdpa"]
    for layout, (losses, grads) in zip(layouts, runs):
        assert_rel_close(losses, alone[0], what=f"per-token losses at {layout}")
        for n, g in alone[1].items():
            assert_rel_close(grads[n], g, what=f"grad of {n} at {layout}")


class WithEODs:
    """The synthetic stream with an EOD every few tokens (a fixed pattern per sample), so its rows
    hold several documents."""

    def __init__(self, stream: SyntheticTokens):
        self.stream = stream

    def batch(self, indices) -> dict:
        tokens = self.stream._tokens(list(indices))
        for row, index in enumerate(indices):
            tokens[row, (torch.arange(tokens.shape[1]) * 5 + index) % 7 == 0] = VOCAB - 1
        return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                "loss_mask": torch.ones(len(indices), tokens.shape[1] - 1)}


def train_packed(rank, world, argv):
    """Train on packed documents; returns the records, and on one rank the first step's loss
    computed by hand from the initial weights (--lr tiny: the weights do not move)."""
    import pretrain_gpt
    from megalite.training import pretrain
    from megalite.training.datasets import document_flags, with_document_flags

    base = pretrain_gpt.task()

    def build_data(config, cfg):
        streams = (WithEODs(SyntheticTokens(config.vocab_size, cfg.model.seq_length, seed))
                   for seed in (cfg.training.seed, cfg.training.seed + 1))
        return with_document_flags(tuple(streams), document_flags(cfg, config.vocab_size))

    cfg = parse(argv)
    run = pretrain(cfg, dataclasses.replace(base, build_data=build_data))
    losses = [r["loss"] for r in run.records]
    if world > 1:
        return losses, None
    model, (train, _) = run.model_chunks[0].eval(), build_data(run.model_chunks[0].config, cfg)
    means, sums, counts = [], 0.0, 0.0
    with torch.no_grad():
        for start in range(0, cfg.training.global_batch_size, cfg.training.micro_batch_size):
            batch = train.batch(range(start, start + cfg.training.micro_batch_size))
            per_token = model(batch["tokens"], attention_mask=PackedDocuments.of_batch(batch), labels=batch["labels"])
            masked = (per_token * batch["loss_mask"]).sum()
            means.append(masked / batch["loss_mask"].sum())
            sums, counts = sums + masked, counts + batch["loss_mask"].sum()
    return losses, {"megatron": torch.stack(means).mean().item(), "per_token": (sums / counts).item()}


BASE = ["--model", "llama-tiny", "--vocab-size", str(VOCAB), "--seq-length", str(SEQ), "--global-batch-size", "8",
        "--micro-batch-size", "2", "--log-interval", "1", "--train-iters", "3", "--eval-iters", "0",
        "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]


def test_the_loss_is_megatron_lms_mean_of_micro_batch_means_or_per_token_when_asked():
    def first_loss(extra):
        [(losses, by_hand)] = run_ranks(train_packed, 1, args=(BASE + ["--lr", "1e-30", "--min-lr", "0", "--train-iters", "1"]
                                                                      + extra,))
        return losses[0], by_hand

    loss, by_hand = first_loss([])
    assert abs(loss - by_hand["megatron"]) <= 1e-6 * by_hand["megatron"], (loss, by_hand)
    assert abs(by_hand["megatron"] - by_hand["per_token"]) > 1e-4  # the masks differ: the two differ too
    loss, by_hand = first_loss(["--calculate-per-token-loss"])
    assert abs(loss - by_hand["per_token"]) <= 1e-6 * by_hand["per_token"], (loss, by_hand)


@pytest.mark.slow
def test_training_on_packed_documents_equals_one_device_at_tp_sp_cp_pp():
    [(want, _)] = run_ranks(train_packed, 1, args=(BASE,))
    layout = ["--tp", "2", "--sequence-parallel", "--cp", "2", "--pp", "2"]
    for got, _ in run_ranks(train_packed, 8, args=(BASE + layout,), timeout=600):
        assert rel_err(torch.tensor(got), torch.tensor(want)) <= 1e-5, (got, want)


def test_document_flags_are_refused_for_bert_in_one_line():
    import pretrain_bert
    from megalite import arguments
    from megalite.errors import UsageError
    from megalite.training.task import check_task_flags

    args = arguments.build_parser("bert", default_model="bert-tiny").parse_args(["--mock-data", "--eod-mask-loss"])
    with pytest.raises(UsageError, match="--eod-mask-loss is for GPT's packed documents"):
        check_task_flags(args, pretrain_bert.task())


def _documents_for(bounds: list[int]) -> PackedDocuments:
    return PackedDocuments(starts=torch.zeros(1, 1, dtype=torch.int64), bounds=torch.tensor(bounds), position_ids=None)


def _qkv(b, heads, groups, s, d, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(11)
    return [torch.randn(b, n, s, d, generator=gen).to(device, dtype) for n in (heads, groups, groups)]


def test_the_gpu_varlen_call_packs_the_documents_as_the_flash_kernel_reads_them(monkeypatch):
    # A CPU stand-in for torch.nn.attention.varlen.varlen_attn with its documented contract: packed
    # [tokens, heads, d] operands, int32 cumulative bounds, the longest document, a causal window.
    from megalite.models import documents as docs
    from megalite.models.attention import _sdpa_attention

    calls = []

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size, enable_gqa):
        assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and window_size == (-1, 0)
        lengths = (cu_q[1:] - cu_q[:-1]).tolist()
        assert max_q == max_k == max(lengths)
        calls.append(enable_gqa)
        out = []
        for lo, hi in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            part = [t[lo:hi].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
            out.append(torch.nn.functional.scaled_dot_product_attention(*part, is_causal=True,
                                                                        enable_gqa=enable_gqa)[0].transpose(0, 1))
        return torch.cat(out)

    q, k, v = _qkv(2, 4, 2, 16, 8)
    documents = _documents_for([0, 5, 12, 16, 23, 32])  # row 0: 5 + 7 + 4 tokens; row 1: 7 + 9
    loop = docs.varlen_attention(q, k, v, documents, _sdpa_attention, 0.0)
    monkeypatch.setattr(docs, "flash_varlen_applies", lambda q, v, p: True)
    monkeypatch.setattr(docs, "_varlen_attn", lambda: varlen_attn)
    flash = docs.varlen_attention(q, k, v, documents, _sdpa_attention, 0.0)
    assert calls == [True]  # one call for the whole micro-batch, grouped keys as they are
    assert torch.allclose(flash, loop, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_a_gpu_the_flash_varlen_kernel_equals_attention_a_document_at_a_time(dtype):
    from megalite.models import documents as docs
    from megalite.models.attention import _sdpa_attention

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q, k, v = _qkv(2, 8, 2, 256, 64, "cuda", dtype)
    documents = _documents_for([0, 40, 41, 200, 256, 300, 512])
    assert docs.flash_varlen_applies(q, v, 0.0), "PyTorch's varlen flash attention is not available here"
    flash = docs.varlen_attention(q, k, v, documents, _sdpa_attention, 0.0)
    reference = docs.varlen_attention(q.float(), k.float(), v.float(), documents, _sdpa_attention, 0.0)
    assert rel_err(flash.float(), reference) <= 2e-2


def _host_syncs_of_packed_attention(rank, world):
    from megalite.testing import count_host_syncs

    parallel.initialize_model_parallel(1, 1)
    model = GPTModel(preset("llama-tiny", vocab_size=VOCAB), seed=7)
    batch = packed_batch()
    with count_host_syncs() as seen:
        losses = model(batch["tokens"], attention_mask=PackedDocuments.of_batch(batch), labels=batch["labels"])
        (losses * batch["loss_mask"]).sum().backward()
    return seen.calls


def test_attention_over_packed_documents_reads_nothing_back_from_the_device():
    # The documents' bounds are read on the host, where the batch made them: no .tolist() of a device tensor.
    assert run_ranks(_host_syncs_of_packed_attention, 1)[0] == []
