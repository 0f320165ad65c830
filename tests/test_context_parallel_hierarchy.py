"""Hierarchical context parallelism (--cp-comm-type a2a+p2p, --hierarchical-context-parallel-sizes):
the all-to-all inside groups of consecutive CP ranks, the ring across them, gives the ring's
attention (forward and backward, packed documents, windows and sinks included) and one device's
training; the flags are refused in one line where they do not fit."""
from __future__ import annotations

import pytest
import torch

from megalite.data.documents import document_bounds
from megalite.parallel import context_parallel as cp
from megalite.parallel.context_parallel_hierarchy import position_order
from megalite.testing import run_ranks
from test_ring_document_blocks import _starts
from training_ranks import refusal, several, train_losses

SEQ, CP = 32, 4


def test_the_gathered_tokens_in_position_order_are_the_rings_layout_at_the_outer_size():
    """After the all-to-all in inner group o, the rank's tokens (inner rank j's two chunks, in turn)
    put in `position_order` are super-chunks o and 2P-1-o: what the ring holds at size P."""
    for inner, outer in ((2, 2), (4, 1), (2, 3), (1, 4)):
        size = inner * outer
        for o in range(outer):
            gathered = torch.cat([cp.context_parallel_positions(SEQ * 3, o * inner + j, size) for j in range(inner)])
            local = SEQ * 3 // size
            assert torch.equal(gathered[position_order(inner, local)],
                               cp.context_parallel_positions(SEQ * 3, o, outer)), (inner, outer, o)


def _attention(rank, world, inner, case):
    """(out, dq, dk, dv) of this rank's share by the hierarchy, and by the ring over all CP ranks."""
    from megalite import parallel
    from megalite.parallel.context_parallel_hierarchy import hierarchical_attention, initialize_hierarchy

    parallel.initialize_model_parallel(context_parallel_size=world)
    h = initialize_hierarchy(inner)
    gen = torch.Generator().manual_seed(5)
    heads, groups = (8, 4) if case != "mha" else (4, 4)  # KV groups divisible by every inner size tested
    b, d = 2, 8
    q, k, v = (torch.randn(b, n, SEQ, d, generator=gen) for n in (heads, groups, groups))
    d_out = torch.randn(b, heads, SEQ, d, generator=gen)
    kw = {}
    if case == "documents":
        starts = _starts([[5, 11, 3, 13], [16, 16]])
        kw = dict(query_starts=cp.split_for_context_parallel(starts, 1, rank, world),
                  document_bounds=document_bounds(starts))
    if case == "window":
        kw = dict(window_left=6)
    if case == "sink":
        kw = dict(sink=torch.randn(heads, generator=gen).requires_grad_())
    results = []
    for attend in ("hierarchy", "ring"):
        share = [cp.split_for_context_parallel(t, 2, rank, world).clone().requires_grad_() for t in (q, k, v)]
        if "sink" in kw:
            kw["sink"].grad = None
        if attend == "hierarchy":
            out = hierarchical_attention(*share, h, causal=case != "non-causal", **kw)
        else:
            out = cp.ring_attention(*share, parallel.get_context_parallel_group(),
                                    parallel.get_context_parallel_ranks(), causal=case != "non-causal", **kw)
        out.backward(cp.split_for_context_parallel(d_out, 2, rank, world))
        results.append([out.detach(), *(t.grad for t in share)] + ([kw["sink"].grad.clone()] if "sink" in kw else []))
    return results


CASES = ["gqa", "mha", "non-causal", "documents", "window", "sink"]


def _cases(rank, world, inner):
    return [_attention(rank, world, inner, case) for case in CASES]


@pytest.mark.parametrize("inner", [2, 4, 1])
def test_the_hierarchy_gives_the_rings_attention_forward_and_backward(inner):
    per_rank = run_ranks(_cases, CP, args=(inner,))

    def close(got, want, what):
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 1e-5, (inner, what, err)

    for rank, results in enumerate(per_rank):
        for case, (hierarchy, ring) in zip(CASES, results):
            for i, (got, want) in enumerate(zip(hierarchy[:4], ring[:4])):  # out, dq, dk, dv
                close(got, want, (case, rank, i))
    # The sinks' gradient: each rank's share differs (its heads x its inner group's queries, against all
    # heads x its own queries); the CP group's sum, which training reduces, is the same.
    sink = CASES.index("sink")
    close(sum(results[sink][0][4] for results in per_rank), sum(results[sink][1][4] for results in per_rank),
          "sink gradient")


BASE = ["--seq-length", "32", "--global-batch-size", "8", "--micro-batch-size", "2", "--log-interval", "1",
        "--train-iters", "4", "--eval-iters", "0", "--model", "llama-tiny"]


@pytest.mark.slow
def test_training_at_cp4_as_two_by_two_gives_one_devices_losses():
    gpt = [a if a != "llama-tiny" else "gpt-tiny" for a in BASE]  # MHA: 2 KV groups per TP rank at tp 2
    one, one_gpt = run_ranks(several, 1, args=(train_losses, [BASE, gpt]))[0]
    hierarchical = ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes"]
    runs = [BASE + ["--cp", "4", *hierarchical, "2", "2"],  # a2a pairs, a ring of 2 across them
            BASE + ["--cp", "4", *hierarchical, "1", "4"],  # the ring alone
            BASE + ["--cp", "2", *hierarchical, "2", "1"],  # the all-to-all alone, dp 2
            gpt + ["--tp", "2", "--sequence-parallel", "--cp", "2", *hierarchical, "2", "1"]]  # CP groups strided
    for per_rank in run_ranks(several, 4, args=(train_losses, runs)):
        for argv, losses in zip(runs, per_rank):
            want = one_gpt if argv[0:len(gpt)] == gpt else one
            assert len(losses) == 4
            assert max(abs(a - b) / abs(b) for a, b in zip(losses, want)) <= 1e-5, (argv, losses, want)


def test_traffic_is_not_counted_while_a_graph_compiles(monkeypatch):
    """A compiled graph's sizes may be symbolic (x.nbytes fails there): the counting steps aside."""
    from megalite.parallel import context_parallel_a2a, traffic

    counted = []
    monkeypatch.setattr(traffic, "gather_or_scatter", lambda *a: counted.append(a))
    monkeypatch.setattr(context_parallel_a2a.lanes, "collective", lambda fn, received, pieces, **k: None)
    monkeypatch.setattr(context_parallel_a2a.dist, "get_world_size", lambda group: 2)
    context_parallel_a2a._all_to_all(torch.zeros(2, 4), 1, 0, None)
    assert counted == [("cp", 32, 2)]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    context_parallel_a2a._all_to_all(torch.zeros(2, 4), 1, 0, None)
    assert counted == [("cp", 32, 2)]


def test_a_hierarchy_of_another_layout_is_not_handed_out():
    from megalite.parallel import context_parallel_hierarchy as hcp

    hcp._HIERARCHY[2] = hcp.Hierarchy(None, (0, 1), None, (0, 2), (0, 1, 2, 3))
    try:
        with pytest.raises(RuntimeError, match="is not set up"):
            hcp.get_hierarchy(2)  # one process: the CP group is [0]
    finally:
        hcp._HIERARCHY.clear()


@pytest.mark.parametrize("argv, world, says", [
    (["--cp", "4", "--cp-comm-type", "a2a+p2p"], 4, "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes"),
    (["--cp", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "3"], 4,
     "--hierarchical-context-parallel-sizes 2 3: the product must be --cp 4"),
    (["--config", "SIZES"], 4, "--hierarchical-context-parallel-sizes takes two sizes, the all-to-all's and the ring's, "
                               "not 3"),
    (["--cp", "2", "--hierarchical-context-parallel-sizes", "2", "1"], 2,
     "--hierarchical-context-parallel-sizes 2 1 splits --cp for --cp-comm-type a2a+p2p"),
    (["--cp", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "4", "1",
      "--model", "llama-tiny"], 4, "--cp-comm-type a2a+p2p exchanges heads for sequence: this rank's"),
])
def test_hierarchical_sizes_that_do_not_fit_are_refused_in_one_line(argv, world, says, tmp_path):
    if argv == ["--config", "SIZES"]:  # a file's list has no fixed length
        (tmp_path / "c.toml").write_text('[parallel]\ncp = 4\ncp_comm_type = "a2a+p2p"\n'
                                         'hierarchical_context_parallel_sizes = [2, 2, 1]\n')
        argv = ["--config", str(tmp_path / "c.toml")]
    assert refusal(argv, world).startswith(says), refusal(argv, world)
