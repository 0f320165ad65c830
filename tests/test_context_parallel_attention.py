"""Context-parallel attention (ring and all-to-all) equals single-device attention on the whole
sequence, forward and backward, on gloo; the ring sends exactly its analytical bytes."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.parallel import context_parallel as cp_attn
from megalite.parallel.context_parallel import (
    context_parallel_positions,
    gather_from_context_parallel,
    ring_attention,
    ring_bytes_per_layer,
    split_for_context_parallel,
)
from megalite.parallel.context_parallel_a2a import a2a_attention
from megalite.testing import run_ranks

B, D = 2, 8


def _inputs(heads, groups, seq):
    torch.manual_seed(1234)  # the same whole-sequence tensors on every rank
    q, k, v = torch.randn(B, heads, seq, D), torch.randn(B, groups, seq, D), torch.randn(B, groups, seq, D)
    return q, k, v, torch.randn(B, heads, seq, D)


def _reference(q, k, v, d_out, causal):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)
    out.backward(d_out)
    return [out.detach(), q.grad, k.grad, v.grad]


def _gathered(t, group, cp):
    shares = [torch.empty_like(t) for _ in range(cp)]
    dist.all_gather(shares, t.contiguous(), group=group)
    return gather_from_context_parallel(shares, dim=2)


def _compare_with_one_device(rank, world, variant, heads, groups, seq, causal):
    """Max relative error of (out, dq, dk, dv) gathered to global order against SDPA on one device."""
    group = dist.new_group(list(range(world)))
    q, k, v, d_out = _inputs(heads, groups, seq)
    expected = _reference(q, k, v, d_out, causal)
    local = [split_for_context_parallel(t, 2, rank, world).requires_grad_() for t in (q, k, v)]
    attend = ring_attention if variant == "ring" else a2a_attention
    out = attend(*local, group, list(range(world)), causal=causal)
    out.backward(split_for_context_parallel(d_out, 2, rank, world))
    got = [_gathered(t, group, world) for t in (out.detach(), *(x.grad for x in local))]
    return [((g - e).abs().max() / e.abs().max()).item() for g, e in zip(got, expected)]


CASES = [  # (variant, cp, heads, groups, seq, causal)
    ("ring", 2, 4, 4, 24, True),
    ("ring", 2, 4, 4, 24, False),
    ("ring", 2, 4, 2, 24, True),  # GQA: only the 2 KV groups travel
    ("ring", 4, 4, 1, 40, True),
    ("ring", 4, 4, 4, 40, False),
    ("a2a", 2, 4, 2, 24, True),
    ("a2a", 4, 4, 4, 40, True),
]


@pytest.mark.parametrize("variant, cp, heads, groups, seq, causal", CASES)
def test_context_parallel_attention_equals_one_device_forward_and_backward(variant, cp, heads, groups, seq, causal):
    for rank_errors in run_ranks(_compare_with_one_device, cp, (variant, heads, groups, seq, causal)):
        assert max(rank_errors) < 1e-5, rank_errors


def _ring_in_strided_groups(rank, world):
    """cp groups {0, 2} and {1, 3}: the ring's neighbours are global ranks, not CP ranks."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ranks = [rank % 2, rank % 2 + 2]
    group, cp_rank = groups[rank % 2], rank // 2
    q, k, v, d_out = _inputs(2, 2, 16)
    expected = _reference(q, k, v, d_out, True)
    local = [split_for_context_parallel(t, 2, cp_rank, 2).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group, ranks)
    out.backward(split_for_context_parallel(d_out, 2, cp_rank, 2))
    got = [_gathered(t, group, 2) for t in (out.detach(), *(x.grad for x in local))]
    return [((g - e).abs().max() / e.abs().max()).item() for g, e in zip(got, expected)]


def test_ring_follows_the_global_ranks_of_a_strided_group():
    for rank_errors in run_ranks(_ring_in_strided_groups, 4):
        assert max(rank_errors) < 1e-5, rank_errors


def _count_ring_bytes(rank, world, heads, groups, seq):
    sent = {"n": 0}
    start = cp_attn._start_exchange

    def counting(send, *args):
        sent["n"] += send.numel() * send.element_size()
        return start(send, *args)

    cp_attn._start_exchange = counting
    group = dist.new_group(list(range(world)))
    q, k, v, d_out = _inputs(heads, groups, seq)
    local = [split_for_context_parallel(t, 2, rank, world).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group, list(range(world)))
    forward = sent["n"]
    out.backward(split_for_context_parallel(d_out, 2, rank, world))
    return forward, sent["n"] - forward


@pytest.mark.parametrize("cp", [2, 4])
def test_bytes_the_ring_sends_equal_the_analytical_volume(cp):
    heads, groups, seq = 4, 2, 8 * cp
    expected = ring_bytes_per_layer(B, groups, seq // cp, D, cp)
    for forward, backward in run_ranks(_count_ring_bytes, cp, (heads, groups, seq)):
        assert (forward, backward) == (expected["forward"], expected["backward"])
    assert expected["forward"] == (cp - 1) * 2 * B * groups * (seq // cp) * D * 4


def _backward_order(rank, world):
    """The ring backward's events in order: ("start", kind, n) when transfer n starts, ("wait", n)
    when it is waited for, ("block", rows) for each block of attention computed."""
    events, started = [], []
    start, wait, block = cp_attn._start_exchange, cp_attn._wait, cp_attn._block_backward

    def starting(send, recv, next_rank, prev_rank, group, tag):
        requests = start(send, recv, next_rank, prev_rank, group, tag)
        started.append(requests)
        events.append(("start", "kv" if tag < cp_attn._GRAD_TAG else "grad", len(started) - 1))
        return requests

    def waiting(requests):
        wait(requests)
        if requests:
            events.append(("wait", next(i for i, r in enumerate(started) if r is requests)))

    def computing(q, *args, **kwargs):
        events.append(("block", q.shape[3]))
        return block(q, *args, **kwargs)

    group = dist.new_group(list(range(world)))
    q, k, v, d_out = _inputs(4, 2, 8 * world)
    local = [split_for_context_parallel(t, 2, rank, world).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group, list(range(world)))
    cp_attn._start_exchange, cp_attn._wait, cp_attn._block_backward = starting, waiting, computing
    try:
        out.backward(split_for_context_parallel(d_out, 2, rank, world))
    finally:
        cp_attn._start_exchange, cp_attn._wait, cp_attn._block_backward = start, wait, block
    return events


@pytest.mark.parametrize("cp", [2, 4])
def test_every_transfer_of_the_ring_backward_has_a_block_of_attention_to_hide_behind(cp):
    """Each K/V and dK/dV transfer of the backward has a block computed between its start and its
    wait, the last dK/dV too: the own block runs in two halves of its rows, the second after the
    last dK/dV leaves. Both halves together are the own block's rows."""
    local = 8 * cp // cp
    for events in run_ranks(_backward_order, cp):
        starts = {e[2]: i for i, e in enumerate(events) if e[0] == "start"}
        waits = {e[1]: i for i, e in enumerate(events) if e[0] == "wait"}
        assert sorted(starts) == sorted(waits) and len(starts) == 2 * (cp - 1), events
        for n, at in starts.items():
            assert any(e[0] == "block" for e in events[at:waits[n]]), (n, events)
        assert [e[1] for e in events if e[0] == "start"].count("grad") == cp - 1
        blocks = [e[1] for e in events if e[0] == "block"]
        assert len(blocks) == cp + 1 and blocks[0] + blocks[-1] == local, events  # the own block's two halves
        assert events[-1][0] == "wait" and events[-2] == ("block", local // 2), events


def test_cp_size_one_is_plain_attention():
    q, k, v, d_out = _inputs(4, 2, 12)
    expected = _reference(q, k, v, d_out, True)
    local = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, None, [0])
    out.backward(d_out)
    for got, want in zip([out.detach(), *(x.grad for x in local)], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_inputs_come_back_bf16_close_to_fp32():
    q, k, v, _ = _inputs(2, 2, 16)
    out = ring_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, [0])
    assert out.dtype == torch.bfloat16
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (out.float() - want).abs().max() < 3e-2


def test_each_rank_holds_chunks_i_and_2n_minus_1_minus_i():
    assert context_parallel_positions(16, 1, 4).tolist() == [2, 3, 12, 13]
    x = torch.arange(16).view(1, 16)
    shares = [split_for_context_parallel(x, 1, r, 4) for r in range(4)]
    assert shares[0].tolist() == [[0, 1, 14, 15]]
    assert torch.equal(gather_from_context_parallel(shares, 1), x)


def test_sequence_not_divisible_by_twice_cp_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"sequence length 18 is not divisible by 8") as info:
        split_for_context_parallel(torch.zeros(1, 18), 1, 0, 4)
    assert "\n" not in str(info.value) and "multiple of 8" in str(info.value)


def test_a2a_with_heads_not_divisible_by_cp_names_p2p():
    q = torch.zeros(1, 3, 4, 8)
    with pytest.raises(ValueError, match=r"--cp-comm-type p2p") as info:
        a2a_attention(q, q, q, None, [0, 1])
    assert "\n" not in str(info.value)


def _score_elements_per_rank(rank, world, seq):
    computed = {"n": 0}
    block_forward = cp_attn._block_forward

    def counting(q, k, *args):
        computed["n"] += q.shape[-2] * k.shape[-2]
        return block_forward(q, k, *args)

    cp_attn._block_forward = counting
    q, k, v, _ = _inputs(2, 2, seq)
    local = [split_for_context_parallel(t, 2, rank, world) for t in (q, k, v)]
    ring_attention(*local, dist.new_group(list(range(world))), list(range(world)))
    return computed["n"]


def test_causal_ring_gives_every_rank_the_same_work_and_skips_future_blocks():
    seq, cp = 32, 4
    per_rank = run_ranks(_score_elements_per_rank, cp, (seq,))
    local = seq // cp
    # the diagonal block (s_local^2) plus N-1 half blocks: a quarter less than all N full blocks
    assert per_rank == [local * local + (cp - 1) * local * local // 2] * cp


def test_nothing_of_size_s_by_s_is_kept_for_backward():
    q, k, v, _ = _inputs(2, 1, 64)
    local = [t.clone().requires_grad_() for t in (q, k, v)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        ring_attention(*local, None, [0])
    assert saved and max(saved) <= q.numel()  # q, k, v, output and the log-sum-exp; no [s, s] scores


def _outside_the_ring(rank, world):
    try:
        ring_attention(*[torch.zeros(1, 1, 4, 8)] * 3, dist.group.WORLD, [5, 6])
    except ValueError as e:
        return str(e)
    return None


def test_a_rank_outside_the_ring_is_refused():
    (message,) = run_ranks(_outside_the_ring, 1)
    assert message and "not in the context-parallel ranks" in message and "\n" not in message
