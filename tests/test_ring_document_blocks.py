"""Ring attention over packed documents skips the key/value blocks no query may attend (found on the
host from the documents' bounds): outputs and gradients bitwise those of computing every block, with
fewer blocks computed."""
from __future__ import annotations

import torch

from megalite.data.documents import document_bounds
from megalite.parallel import context_parallel as cp
from megalite.testing import run_ranks

SEQ, CP = 16, 2  # chunks of 4: rank 0 holds positions 0-3 and 12-15, rank 1 positions 4-11


def _starts(lengths_per_row: list[list[int]]) -> torch.Tensor:
    rows = []
    for lengths in lengths_per_row:
        row, at = [], 0
        for n in lengths:
            row += [at] * n
            at += n
        rows.append(row)
    return torch.tensor(rows)


def test_live_blocks_are_the_blocks_some_query_may_attend():
    aligned = document_bounds(_starts([[4, 4, 4, 4]]))  # every document inside one chunk
    assert cp.live_blocks(aligned, 0, CP, SEQ // CP) == [True, False]
    assert cp.live_blocks(aligned, 1, CP, SEQ // CP) == [True, False]
    crossing = document_bounds(_starts([[4, 4, 4, 4], [6, 10]]))  # the second row's documents cross chunks
    assert cp.live_blocks(crossing, 0, CP, SEQ // CP) == [True, True]  # 12-15 see 6-11 of rank 1
    assert cp.live_blocks(crossing, 1, CP, SEQ // CP) == [True, True]  # 4-5 see 0-3 of rank 0
    # Against every (query, key) pair written out: a block is live iff one pair is allowed.
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        lengths = [[], []]
        for row in lengths:
            while sum(row) < SEQ:
                row.append(min(int(torch.randint(1, 9, (), generator=gen)), SEQ - sum(row)))
        starts = _starts(lengths)
        for rank in range(CP):
            q_pos = cp.context_parallel_positions(SEQ, rank, CP)
            want = []
            for step in range(CP):
                owner = (rank - step) % CP
                rows, keys, _ = cp._block_plan(rank, owner, SEQ // CP, True)
                k_pos = cp.context_parallel_positions(SEQ, owner, CP)[keys]
                p, s = q_pos[rows], starts[:, q_pos][:, rows]
                want.append(bool(((k_pos[None, None, :] <= p[None, :, None])
                                  & (k_pos[None, None, :] >= s[:, :, None])).any()))
            assert cp.live_blocks(document_bounds(starts), rank, CP, SEQ // CP) == want, (lengths, rank)


def _ring(rank, world, lengths_per_row, skip):
    from megalite import parallel

    parallel.initialize_model_parallel(context_parallel_size=world)
    starts = _starts(lengths_per_row)
    bounds = document_bounds(starts)
    gen = torch.Generator().manual_seed(11)
    b, heads, groups, d = len(lengths_per_row), 4, 2, 8
    q, k, v = (torch.randn(b, n, SEQ, d, generator=gen) for n in (heads, groups, groups))
    d_out = torch.randn(b, heads, SEQ, d, generator=gen)
    share = [cp.split_for_context_parallel(t, 2, rank, world).clone().requires_grad_(t is not d_out)
             for t in (q, k, v, d_out)]
    mine = cp.split_for_context_parallel(starts, 1, rank, world)
    computed = []
    real = cp._block_forward
    cp._block_forward = lambda *a, **kw: computed.append(1) or real(*a, **kw)
    try:
        out = cp.ring_attention(*share[:3], parallel.get_context_parallel_group(),
                                parallel.get_context_parallel_ranks(), causal=True, query_starts=mine,
                                document_bounds=bounds if skip else None)
    finally:
        cp._block_forward = real
    out.backward(share[3])
    return out.detach(), [t.grad for t in share[:3]], len(computed)


def test_skipping_masked_blocks_changes_no_bit_and_computes_fewer():
    aligned, crossing = [[4, 4, 4, 4], [2, 2, 4, 1, 3, 4]], [[4, 4, 4, 4], [6, 10]]
    for lengths, blocks in ((aligned, 1), (crossing, 2)):
        skipped = run_ranks(_ring, CP, args=(lengths, True))
        every = run_ranks(_ring, CP, args=(lengths, False))
        for (out, grads, n), (out_all, grads_all, n_all) in zip(skipped, every):
            assert n == blocks and n_all == CP  # per rank: the blocks computed in forward
            assert torch.equal(out, out_all)
            assert all(torch.equal(g, h) for g, h in zip(grads, grads_all))
