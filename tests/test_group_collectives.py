"""Process groups and the autograd collectives over them. The collectives act within the group
they are given alone (forward and backward), so other parallelisms (context, experts) can reuse
them over their own ranks; each sends its gradient back through its conjugate collective."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from megalite import parallel
from megalite.parallel import mappings, state
from megalite.testing import run_ranks

COLLECTIVES = [
    parallel.copy_to_tensor_model_parallel_region,
    parallel.reduce_from_tensor_model_parallel_region,
    parallel.scatter_to_tensor_model_parallel_region,
    parallel.gather_from_tensor_model_parallel_region,
    parallel.scatter_to_sequence_parallel_region,
    parallel.gather_from_sequence_parallel_region,
    parallel.reduce_scatter_to_sequence_parallel_region,
]


def within_pairs(rank, world):
    from megalite import parallel

    parallel.initialize_model_parallel(world)  # the TP group is all four ranks
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    x = torch.full((4, 2), float(rank + 1), requires_grad=True)
    summed = parallel.reduce_from_tensor_model_parallel_region(x.clone(), group=pair)
    gathered = parallel.gather_from_tensor_model_parallel_region(x, group=pair)
    gathered.backward(torch.ones_like(gathered))
    over_tp = parallel.reduce_from_tensor_model_parallel_region(x.detach().clone())
    sequence = parallel.gather_from_sequence_parallel_region(x.detach(), group=pair)
    return summed[0, 0].item(), gathered.shape, x.grad.shape, over_tp[0, 0].item(), sequence[:, 0].tolist()


def test_collectives_stay_within_the_group_they_are_given():
    results = run_ranks(within_pairs, 4)
    for rank, (summed, gathered, grad, over_tp, sequence) in enumerate(results):
        first = 2 * (rank // 2) + 1  # the pair's ranks hold first and first + 1
        assert summed == first + first + 1, "summed over the pair only"
        assert tuple(gathered) == (4, 4) and tuple(grad) == (4, 2)
        assert over_tp == 1 + 2 + 3 + 4, "no group: the tensor-parallel group"
        assert sequence == [first] * 4 + [first + 1] * 4


def _forward_and_gradient(collective, x, grad_out, **kwargs):
    x = x.clone().requires_grad_()
    y = collective(x.clone(), **kwargs)  # a clone: the all-reduce sums in place
    y.backward(grad_out.clone())  # a clone: the all-reduce of a gradient sums in place too
    return y.detach(), x.grad


def conjugate_pairs(rank, world):
    parallel.initialize_model_parallel(world)
    x = torch.arange(8.0).view(4, 2) + 10 * rank  # [sequence 4, hidden 2], different on each rank
    g2, g4 = torch.full((2, 2), rank + 1.0), torch.full((4, 2), rank + 1.0)
    g8, g44 = torch.full((8, 2), rank + 1.0), torch.full((4, 4), rank + 1.0)
    return {
        "copy": _forward_and_gradient(mappings.copy_to_tensor_model_parallel_region, x, g4),
        "reduce": _forward_and_gradient(mappings.reduce_from_tensor_model_parallel_region, x, g4),
        "scatter": _forward_and_gradient(mappings.scatter_to_tensor_model_parallel_region, x, torch.ones(4, 1) * rank),
        "gather": _forward_and_gradient(mappings.gather_from_tensor_model_parallel_region, x, g44),
        "scatter_seq": _forward_and_gradient(mappings.scatter_to_sequence_parallel_region, x, g2),
        "gather_seq": _forward_and_gradient(mappings.gather_from_sequence_parallel_region, x, g8),
        "gather_seq_full": _forward_and_gradient(mappings.gather_from_sequence_parallel_region, x, g8,
                                                 output_grad_is_parallel=False),
        "reduce_scatter_seq": _forward_and_gradient(mappings.reduce_scatter_to_sequence_parallel_region, x, g2),
    }


def test_every_collective_sends_its_gradient_back_through_the_conjugate_collective():
    out = run_ranks(conjugate_pairs, 2)
    xs = [torch.arange(8.0).view(4, 2) + 10 * r for r in range(2)]
    total = xs[0] + xs[1]
    for rank, r in enumerate(out):
        y, g = r["copy"]
        assert torch.equal(y, xs[rank]) and torch.equal(g, torch.full((4, 2), 3.0)), "copy: identity, all-reduce"
        y, g = r["reduce"]
        assert torch.equal(y, total) and torch.equal(g, torch.full((4, 2), rank + 1.0)), "reduce: all-reduce, identity"
        y, g = r["scatter"]
        assert torch.equal(y, xs[rank][:, rank:rank + 1])
        assert torch.equal(g, torch.tensor([[0.0, 1.0]] * 4)), "scatter: split, all-gather of the gradient"
        y, g = r["gather"]
        assert torch.equal(y, torch.cat(xs, dim=-1))
        assert torch.equal(g, torch.full((4, 2), rank + 1.0)), "gather: all-gather, this rank's slice"
        y, g = r["scatter_seq"]
        assert torch.equal(y, xs[rank][2 * rank:2 * rank + 2])
        expected = torch.cat([torch.full((2, 2), 1.0), torch.full((2, 2), 2.0)])
        assert torch.equal(g, expected), "sequence scatter: split, all-gather"
        y, g = r["gather_seq"]
        assert torch.equal(y, torch.cat(xs, dim=0))
        assert torch.equal(g, torch.full((4, 2), 3.0)), "sequence gather: reduce-scatter of a partial gradient"
        y, g = r["gather_seq_full"]
        assert torch.equal(y, torch.cat(xs, dim=0))
        assert torch.equal(g, torch.full((4, 2), rank + 1.0)), "sequence gather: this rank's slice of a full gradient"
        y, g = r["reduce_scatter_seq"]
        assert torch.equal(y, total[2 * rank:2 * rank + 2])
        assert torch.equal(g, torch.cat([torch.full((2, 2), 1.0), torch.full((2, 2), 2.0)])), "then all-gather"


@pytest.mark.parametrize("collective", COLLECTIVES, ids=lambda f: f.__name__)
def test_over_one_rank_every_collective_returns_its_input_without_an_autograd_node(collective):
    x = torch.randn(4, 2, requires_grad=True)
    assert collective(x) is x, "no torch.distributed: the group is one rank"
    assert collective.__name__ in parallel.__all__, "the public name is the function's own"


def _old_loops(tp, dp, pp):
    """The explicit loops initialize_model_parallel used before its groups were table-driven."""
    def rank_of(p, d, t):
        return p * dp * tp + d * tp + t
    return {
        "tensor": [[rank_of(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "data": [[rank_of(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "model": [[rank_of(p, d, t) for p in range(pp) for t in range(tp)] for d in range(dp)],
        "pipeline": [[rank_of(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }


def test_group_table_builds_the_groups_in_rank_order_and_a_new_dimension_of_size_one_moves_no_rank():
    for tp, dp, pp in itertools.product((1, 2, 3), (1, 2), (1, 2, 4)):
        sizes = {"tensor": tp, "context": 1, "data": dp, "pipeline": pp}
        built = {name: state.rank_groups(sizes, spanned) for name, spanned in state.GROUPS.items()}
        old = _old_loops(tp, dp, pp)
        assert {name: built[name] for name in old} == old, "cp=1 leaves today's ranks unchanged"
        assert built["data_context"] == built["data"]
        assert built["context"] == [[r] for r in range(tp * dp * pp)]
    # Megatron-Core's order with a context dimension: tensor fastest, then context, data, pipeline.
    sizes = {"tensor": 2, "context": 2, "data": 2, "pipeline": 2}
    assert state.rank_groups(sizes, ("context",))[:3] == [[0, 2], [1, 3], [4, 6]]
    assert state.rank_groups(sizes, ("data",))[:2] == [[0, 4], [1, 5]]
    assert state.rank_groups(sizes, ("pipeline",))[0] == [0, 8]


def four_d_groups(rank, world, tp, cp, pp):
    parallel.initialize_model_parallel(tp, pp, context_parallel_size=cp)
    ranks = dist.get_process_group_ranks
    return {
        "cp": ranks(parallel.get_context_parallel_group()), "cp_rank": parallel.get_context_parallel_rank(),
        "cp_size": parallel.get_context_parallel_world_size(), "tp": ranks(parallel.get_tensor_model_parallel_group()),
        "dp": ranks(parallel.get_data_parallel_group()), "dp_size": parallel.get_data_parallel_world_size(),
        "dp_cp": ranks(parallel.get_data_parallel_group(with_context_parallel=True)),
        "dp_cp_size": parallel.get_data_parallel_world_size(with_context_parallel=True),
        "dp_cp_rank": parallel.get_data_parallel_rank(with_context_parallel=True),
        "pp": ranks(parallel.get_pipeline_model_parallel_group()),
    }


@pytest.mark.parametrize("tp,cp,pp", [(2, 2, 2), (1, 2, 2), (2, 4, 1)])
def test_context_parallel_ranks_sit_between_tensor_and_data_as_in_megatron_core(tp, cp, pp):
    world = 8
    dp = world // (tp * cp * pp)
    for rank, g in enumerate(run_ranks(four_d_groups, world, args=(tp, cp, pp))):
        t, c, d, p = rank % tp, (rank // tp) % cp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp)

        def at(t=t, c=c, d=d, p=p):
            return p * (dp * cp * tp) + d * (cp * tp) + c * tp + t
        assert g["tp"] == [at(t=i) for i in range(tp)]
        assert g["cp"] == [at(c=i) for i in range(cp)] and (g["cp_rank"], g["cp_size"]) == (c, cp)
        assert g["dp"] == [at(d=i) for i in range(dp)] and g["dp_size"] == dp
        assert g["dp_cp"] == sorted(at(c=i, d=j) for i in range(cp) for j in range(dp))
        assert (g["dp_cp_size"], g["dp_cp_rank"]) == (dp * cp, g["dp_cp"].index(rank))
        assert g["pp"] == [at(p=i) for i in range(pp)]


def groups_before_and_after_initialization(rank, world):
    refusals = []
    for getter in (parallel.get_tensor_model_parallel_group, parallel.get_data_parallel_rank,
                   parallel.get_pipeline_model_parallel_world_size, parallel.get_model_parallel_group):
        try:
            getter()
        except RuntimeError as e:
            refusals.append(str(e))
    parallel.initialize_model_parallel(2, 2)  # dp = 1
    return {
        "refusals": refusals,
        "sizes": (parallel.get_tensor_model_parallel_world_size(), parallel.get_data_parallel_world_size(),
                  parallel.get_pipeline_model_parallel_world_size()),
        "ranks": (parallel.get_tensor_model_parallel_rank(), parallel.get_data_parallel_rank(),
                  parallel.get_pipeline_model_parallel_rank()),
        "model": dist.get_process_group_ranks(parallel.get_model_parallel_group()),
        "pipeline": parallel.get_pipeline_model_parallel_ranks(),
        "embedding": parallel.get_embedding_group() is not None and parallel.is_rank_in_embedding_group(),
    }


def test_groups_are_refused_before_initialization_and_answer_after_it():
    for rank, r in enumerate(run_ranks(groups_before_and_after_initialization, 4)):
        assert len(r["refusals"]) == 4 and all("initialize_model_parallel()" in m for m in r["refusals"])
        assert r["sizes"] == (2, 1, 2) and r["ranks"] == (rank % 2, 0, rank // 2)
        assert r["model"] == [0, 1, 2, 3], "tensor x pipeline: the whole model"
        assert r["pipeline"] == [rank % 2, rank % 2 + 2] and r["embedding"], "pp=2: both stages hold the embedding"


def layouts_one_after_another(rank, world):
    """Three runs' worth of initialize_model_parallel in one process: tp2 pp2, tp2 pp2 again, tp4."""
    import os

    def held():  # this process's threads and open descriptors: what each gloo group holds
        return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))

    def tp_sum():
        x = torch.full((2,), float(rank + 1))
        dist.all_reduce(x, group=parallel.get_tensor_model_parallel_group())
        return x[0].item()

    parallel.initialize_model_parallel(2, 2)
    first = {name: g for name, g in state._STATE.groups.items()}
    sums, after = [tp_sum()], [held()]
    parallel.initialize_model_parallel(2, 2)
    again = state._STATE.groups
    sums.append(tp_sum())
    after.append(held())
    parallel.initialize_model_parallel(4)
    sums.append(tp_sum())
    after.append(held())
    parallel.initialize_model_parallel(2, 2)  # both layouts' groups exist now
    after.append(held())
    return {"same": all(again[n] is g for n, g in first.items()),
            "distinct": len({id(g) for g in first.values()}) == len(first), "sums": sums, "held": after}


def test_a_second_layout_in_one_process_takes_the_groups_built_for_the_first():
    """The runs of one test spawn (or a notebook's) build each group once: the same ranks and purpose
    give the same group back, nothing more is held, and groups of other purposes over the same ranks
    stay apart."""
    for rank, r in enumerate(run_ranks(layouts_one_after_another, 4)):
        pair = 4 * (rank // 2) + 3  # ranks 2k and 2k+1 add k' + 1 and k' + 2 (k' = 2k)
        assert r["sums"] == [pair, pair, 10.0], r["sums"]
        assert r["same"] and r["distinct"]
        assert r["held"][1] == r["held"][0], f"the second tp2 pp2 built more: {r['held']}"
        assert r["held"][3] == r["held"][2], f"tp2 pp2 after tp4 built more: {r['held']}"


def port_after_a_run(rank, world):
    """One run on a fixed port, torn down as megalite's runtime does (destroy_model_parallel, then the
    default group): the groups kept for a next run must not keep its store alive, so another process
    can listen on the port (a `pretrain_gpt.py` started from this one inherits MASTER_PORT)."""
    import socket

    dist.destroy_process_group()  # run_ranks' own file-store group
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel.initialize_model_parallel(1)
    x = torch.ones(1)
    dist.all_reduce(x, group=parallel.get_tensor_model_parallel_group())
    parallel.destroy_model_parallel()
    dist.destroy_process_group()
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
            free = True
        except OSError:
            free = False
    return x.item(), free


def test_groups_kept_for_the_next_run_do_not_hold_the_torn_down_runs_port():
    assert run_ranks(port_after_a_run, 1) == [(1.0, True)]
