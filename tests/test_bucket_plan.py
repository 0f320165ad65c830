"""The gradient buckets' sizes (megalite.optim.bucket_plan): a small first bucket so that the
reduction starts early in backward, growing to --ddp-bucket-size; the same reduced gradients as
equal buckets; and the planner's prediction of the reduction left after backward (tools/plan/overlap.py)."""
import pytest
import torch
import torch.distributed as dist

from helpers import fresh_seed
from megalite import parallel
from megalite.models import GPTModel, TransformerConfig
from megalite.optim import ParamAndGradBuffer
from megalite.optim.bucket_plan import ALIGN_NUMEL, FIRST_BUCKET_NUMEL, first_bucket_target, plan_layout
from megalite.optim.zero import ShardedGradBuffer
from megalite.testing import run_ranks
from megalite.tools.plan.overlap import link_schedule, ready_fractions, ready_times


def _equal_buckets(params, bucket_numel):
    """megalite's rule before the ramp: close a bucket once it holds bucket_numel elements."""
    groups, current, size = [], [], 0
    for k in reversed(range(len(params))):
        numel, deferred = params[k]
        if deferred:
            groups.append(((k,), True))
            continue
        current.append(k)
        size += numel
        if size >= bucket_numel:
            groups.append((tuple(current), False))
            current, size = [], 0
    if current:
        groups.append((tuple(current), False))
    return groups


def test_bucket_sizes_ramp_from_a_quarter_by_doubling_to_the_configured_size():
    params = [(100, False)] * 40  # 4,000 elements
    layout = plan_layout(params, bucket_numel=1000, dp_size=1)
    assert [b.real_numel for b in layout] == [300, 500, 1000, 1000, 1000, 200]  # targets 250, 500, 1000, ...
    assert layout[0].members == (39, 38, 37), "the last-defined parameters first: backward's order"
    assert first_bucket_target(40_000_000) == FIRST_BUCKET_NUMEL == 1 << 18, "PyTorch DDP's 1 MiB of fp32"
    assert first_bucket_target(200_000) == 50_000
    assert first_bucket_target(1000, first_bucket_numel=5000) == 1000


def test_first_bucket_at_or_above_the_bucket_size_is_the_equal_bucket_layout():
    params = [(n, k == 2) for k, n in enumerate([7, 300, 4096, 64, 1, 900, 33, 250, 128] * 3)]
    for bucket_numel in (150, 1000, 5000):
        old = plan_layout(params, bucket_numel, 4, first_bucket_numel=bucket_numel)
        assert [(b.members, b.deferred) for b in old] == _equal_buckets(params, bucket_numel)


@pytest.mark.parametrize("dp", [1, 2, 3, 8])
def test_ramped_buckets_stay_aligned_keep_deferred_alone_and_close_earlier(dp):
    sizes = [5000, 1000, 64] + [640, 64, 1920, 130] * 6 + [2]
    params = [(n, k == 0) for k, n in enumerate(sizes)]  # index 0: a tied embedding, deferred
    ramp = plan_layout(params, bucket_numel=4000, dp_size=dp)
    equal = plan_layout(params, bucket_numel=4000, dp_size=dp, first_bucket_numel=4000)
    assert [b.members for b in ramp if b.deferred] == [(0,)]
    assert sorted(k for b in ramp for k in b.members) == list(range(len(sizes)))
    for b in ramp:
        assert b.start % (ALIGN_NUMEL * dp) == 0 and (b.end - b.start) % (ALIGN_NUMEL * dp) == 0
        assert all(lo % ALIGN_NUMEL == 0 for lo, _ in b.ranges)
    # The first bucket closes after fewer of backward's gradients, the next ones grow.
    assert len(ramp[0].members) < len(equal[0].members)
    assert ramp[0].real_numel < ramp[1].real_numel < ramp[2].real_numel
    # Reverse definition order throughout: the concatenated members are len-1 ... 0.
    assert [k for b in ramp for k in b.members if k] == list(reversed(range(1, len(sizes))))


def _reduce_with(rank, world, seed, first_bucket_numel, bucket_numel, sharded=False):
    """One GPT backward's gradients reduced by a buffer of the given bucket sizes: (the launch log,
    the reduced gradients in definition order, the number of parameters)."""
    parallel.initialize_model_parallel(1)
    config = TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=100,
                               max_position_embeddings=16)
    model = GPTModel(config, seed=seed)
    params = list(model.parameters())
    kind = ShardedGradBuffer if sharded else ParamAndGradBuffer
    buf = kind(params, param_dtype=torch.float32, grad_dtype=torch.float32, bucket_numel=bucket_numel,
               dp_group=parallel.get_data_parallel_group(), dp_size=world, reduce_scatter=sharded,
               first_bucket_numel=first_bucket_numel)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(seed + rank))
    buf.zero_grad()
    buf.enable_sync()
    model(ids, labels=ids).sum().backward()
    launched = list(buf.launch_log)
    buf.finish_grad_sync()
    if sharded:  # every rank's shard, gathered whole: the gradient in layout order
        whole = [torch.empty_like(buf.grad_shard) for _ in range(world)]
        dist.all_gather(whole, buf.grad_shard)
        grads = []
        for b in buf.buckets:
            n = b.numel // world
            grads.append(torch.cat([w[b.start // world:b.start // world + n] for w in whole]))
        full = torch.cat(grads)
        grads = [full[lo:hi].clone() for lo, hi in map(buf.param_range, params)]
    else:
        grads = [p.main_grad.clone() for p in params]
    return launched, grads, len(params), len(buf.buckets)


def _ramp_vs_equal(rank, world, seed, sharded):
    bucket_numel = 8000  # gpt above: ~41,000 elements; ramp 2000, 4000, 8000, ...
    ramp = _reduce_with(rank, world, seed, None, bucket_numel, sharded)
    equal = _reduce_with(rank, world, seed, bucket_numel, bucket_numel, sharded)
    one = _reduce_with(rank, world, seed, None, 10 ** 9, sharded)
    return ramp, equal, one


@pytest.mark.parametrize("sharded", [False, True], ids=["all-reduce", "zero2-reduce-scatter"])
def test_ramped_buckets_launch_earlier_in_backward_with_bitwise_equal_gradients_at_dp_2(sharded):
    for ramp, equal, one in run_ranks(_ramp_vs_equal, 2, args=(fresh_seed(), sharded)):
        (ramp_log, ramp_grads, num_params, ramp_n), (equal_log, equal_grads, _, equal_n) = ramp, equal
        assert ramp_n > equal_n > 1 and one[3] == 1
        # The first reduction starts after fewer of backward's gradients, still during backward.
        assert ramp_log[0][0] == 0 and equal_log[0][0] == 0
        assert ramp_log[0][1] < equal_log[0][1] < num_params, (ramp_log, equal_log)
        assert [i for i, _ in ramp_log] == list(range(ramp_n)), "launched in backward's order"
        # Two ranks: each element is a + b whatever the collective's chunking, so the same bits.
        for a, b, c in zip(ramp_grads, equal_grads, one[1]):
            assert torch.equal(a, b) and torch.equal(a, c)


def _dp_4_all_reduce(rank, world, seed):
    ramp, equal, one = _ramp_vs_equal(rank, world, seed, False)
    return [max((a - b).abs().max().item() / max(b.abs().max().item(), 1e-30) for a, b in zip(x[1], one[1]))
            for x in (ramp, equal)]


def test_bucket_boundaries_change_gloo_sums_at_dp_4_only_by_rounding():
    # gloo's ring all-reduce adds an element's four terms in an order set by which chunk of the
    # bucket it falls in: moving bucket boundaries may reorder the sum (not at dp 2: a + b).
    for errs in run_ranks(_dp_4_all_reduce, 4, args=(fresh_seed(),)):
        assert max(errs) <= 1e-6, errs


# -- the planner: the reduction left after backward, from the bucket plan (tools/plan/overlap.py) --
def test_ready_fractions_weigh_layer_parameters_in_backward_order():
    # definition order: embedding (no layer), layer 0 (two params), layer 1 (two), final norm
    numels = [1000, 300, 100, 300, 100, 10]
    layer_of = [None, 0, 0, 1, 1, None]
    layout = plan_layout([(n, False) for n in numels], bucket_numel=400, dp_size=1)
    assert [b.members for b in layout] == [(5, 4), (3,), (2, 1), (0,)]  # targets 100, 200, 400, 400
    assert ready_fractions(layout, numels, layer_of) == [0.125, 0.5, 1.0, 1.0]


def test_exposed_reduction_of_a_hand_computed_case():
    # Backward 10 ms: 2 ms of output layer, then 8 ms of layers. Buckets ready after 1/4, 1/2 and
    # all of the layers: at 4, 6 and 10 ms. Transfers 3, 3 and 1 ms, each after 0.5 ms of latency.
    at = ready_times([0.25, 0.5, 1.0], begin=0.0, head=2.0, layers=8.0)
    assert at == [4.0, 6.0, 10.0]
    # 4 -> 7.5; 7.5 -> 11 (ready at 6, the stream busy); 11 -> 12.5: 2.5 ms after backward ends.
    assert link_schedule(list(zip(at, [3.0, 3.0, 1.0])), latency=0.5) - 10.0 == pytest.approx(2.5)
    # One bucket of the same bytes, complete at the end: 0.5 + 7 ms exposed.
    assert link_schedule([(10.0, 7.0)], latency=0.5) - 10.0 == pytest.approx(7.5)
    # Ready out of order (a second chunk's buckets): the stream takes them by readiness.
    assert link_schedule([(5.0, 1.0), (1.0, 1.0)], latency=0.0) == pytest.approx(6.0)


def test_planner_predicts_less_exposed_reduction_with_the_ramp_and_counts_latency_per_bucket():
    from dataclasses import replace

    from megalite.models import preset
    from megalite.tools.plan import Cluster, Layout, predict, rank_state_bytes

    config = preset("gpt-1.3b")
    # dp 2 across two one-GPU nodes, slow enough that the reduction cannot all hide behind backward.
    cluster = Cluster(gpus=2, gpus_per_node=1, inter_node_gbps=5.0)
    layout = Layout(dp=2, micro_batch_size=1)
    base = predict(config, layout, cluster, 2, 1024)
    slower = predict(config, layout, replace(cluster, collective_latency_ms=1.05), 2, 1024)
    buckets = sum(1 for chunk in rank_state_bytes(config, dp=2, seq_length=1024).buckets for b in chunk)
    assert base.time.dp_comm > 0 and buckets > 1
    # Bound by the link: each bucket's extra millisecond of start-up shows in the exposed time.
    assert slower.time.dp_comm - base.time.dp_comm == pytest.approx(buckets * 1e-3, rel=1e-6)
    # NVLink, the reduction about as long as backward: the ramp starts it early, one bucket of
    # everything only when backward ends.
    nvlink = Cluster(gpus=2)
    ramp, one = (predict(config, layout, nvlink, 2, 1024, ddp_bucket_size=n).time.dp_comm
                 for n in (40_000_000, 10 ** 10))
    assert 0 < ramp < one
