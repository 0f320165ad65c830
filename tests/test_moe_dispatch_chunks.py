"""--moe-dispatch-chunks N (issue #50): the all-to-all dispatcher's exchanges a group of local experts at
a time (megalite.models.moe.chunked), so one group's experts compute while the next group's rows
travel, forward and backward. Claims: groups are whole experts; one spawn of ranks shows each
exchange in flight beside the other group's GEMMs, one on the link at a time; training is bitwise the
unchunked run (losses, gradient norms, bytes counted, every weight) at EP 2 with dropout, uneven
groups with padded capacity, overlapped pairs, full recomputation, DeepSeek-V3 (MLA, sigmoid routing),
FP8, ZeRO-3, TP 2 x ETP 2 with SP, and PP 2 x EP 2 under DualPipeV's pairs and ZB-H1 (weight
gradients deferred);
no host sync is added; what it cannot do is refused in one line; posts a failed pass left are dropped."""
import pytest
import torch

from helpers import fresh_seed
from megalite.models.moe.chunked import expert_groups
from megalite.testing import run_ranks
from test_moe_training import MOE  # the tiny MoE GPT: 8 experts, a dense first layer, shared expert, aux and z-losses
from training_ranks import paired_runs, refusal, steady_host_syncs, train_params

BASE = ["--train-iters", "2", "--log-interval", "1", "--seq-length", "32", "--micro-batch-size", "2",
        "--eval-interval", "0", "--hidden-dropout", "0.1", *MOE]
EP2 = BASE + ["--ep", "2", "--global-batch-size", "8"]


def chunks(n: int) -> list[str]:
    return ["--moe-dispatch-chunks", str(n)]


def test_the_groups_are_whole_experts_as_even_as_integers_allow():
    assert expert_groups(4, 2) == [(0, 2), (2, 4)]
    assert expert_groups(4, 3) == [(0, 1), (1, 3), (3, 4)]
    assert expert_groups(5, 5) == [(i, i + 1) for i in range(5)]
    for local in range(1, 9):
        for n in range(1, local + 1):
            groups = expert_groups(local, n)
            assert groups[0][0] == 0 and groups[-1][1] == local and all(hi > lo for lo, hi in groups)
            assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))


def _events(rank, world, argv):
    """The order of the experts' all-to-all launches (L), waits (W) and grouped GEMMs (E, forward or
    backward; consecutive ones as one) over a training run."""
    import torch.distributed as dist

    from megalite.models.moe import experts

    events = []

    class Work:
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append("W")
            return self.work.wait()

    real_a2a, real_multiply, real_input_gradient = dist.all_to_all_single, experts._multiply, experts._input_gradient

    def a2a(*args, async_op=False, **kwargs):
        events.append("L")
        return Work(real_a2a(*args, async_op=True, **kwargs)) if async_op else real_a2a(*args, **kwargs)

    def gemm(real):
        def run(*args):
            if events[-1:] != ["E"]:
                events.append("E")
            return real(*args)
        return run

    dist.all_to_all_single = a2a
    experts._multiply, experts._input_gradient = gemm(real_multiply), gemm(real_input_gradient)
    try:
        train_params(rank, world, argv)
    finally:
        dist.all_to_all_single = real_a2a
        experts._multiply, experts._input_gradient = real_multiply, real_input_gradient
    return "".join(events)


def test_each_group_computes_while_the_next_groups_rows_travel():
    argv = EP2 + chunks(2) + ["--train-iters", "1"]
    for events in run_ranks(_events, 2, args=(argv,)):
        # Per MoE layer and pass (3 layers, 2 micro-batches, forward and backward), the same pattern:
        # group 0's rows out and in; group 1's rows launched, then group 0's GEMMs while they travel;
        # group 0's outputs launched once group 1's rows are in (one exchange on the link at a time),
        # group 1's GEMMs while they travel; group 1's outputs. Backward the same, the last group first.
        layer = "LWL" + "EWL" + "EWL" + "W"
        assert events == layer * (3 * 2 * 2), events


def test_inside_an_overlapped_pair_the_exchanges_are_whole():
    # 2 micro-batches a rank: the first forward alone, one pair (the second forward beside the first
    # backward), the last backward alone. A forward run alone sends each of 3 MoE layers' rows and
    # outputs in 2 groups (4 exchanges a layer), and its micro-batch's backward does the same (its
    # graph was built so); a forward in a pair sends them whole (2 a layer), the other lane hiding
    # them (there the groups cost more than they hide: docs/communication.md), and so does its
    # backward, alone at the end, in place (no wait of its own).
    argv = EP2 + chunks(2) + ["--train-iters", "1", "--overlap-moe-expert-parallel-comm"]
    for events in run_ranks(_events, 2, args=(argv,)):
        assert events.count("L") == 3 * (4 + 4 + 2 + 2), events
        assert events.count("W") == 3 * (4 + 4 + 2), events


def _trainings(rank, world, runs, seed):
    return [train_params(rank, world, argv + ["--seed", str(seed)]) for argv in runs]


def _assert_same(plain, chunked, etp_padding=False):
    """etp_padding: the ETP all-gather pads each group's rows to its largest peer's, not the layer's,
    so the bytes of kind "ep" differ; every other kind's are the same."""
    assert len(plain["records"]) == len(chunked["records"]) > 0
    for a, b in zip(plain["records"], chunked["records"]):
        for key in ("loss", "grad_norm", "comm_bytes"):
            x, y = a[key], b[key]
            if key == "comm_bytes" and etp_padding:
                x, y = {k: v for k, v in x.items() if k != "ep"}, {k: v for k, v in y.items() if k != "ep"}
            assert x == y, (key, a[key], b[key])
    assert [n for n, p in plain["params"].items() if not torch.equal(p, chunked["params"][n])] == []


CAPACITY = ["--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity"]
DEEPSEEK = ["--train-iters", "2", "--log-interval", "1", "--seq-length", "32", "--micro-batch-size", "2",
            "--eval-interval", "0", "--model", "deepseek-tiny", "--ep", "2", "--global-batch-size", "8"]
TWO_RANKS = {  # name: (the unchunked run, the chunked one)
    "ep2": (EP2, EP2 + chunks(2)),
    "ep2-uneven-padded": (EP2 + CAPACITY, EP2 + CAPACITY + chunks(3)),
    "ep2-pairs": (EP2 + ["--overlap-moe-expert-parallel-comm"], EP2 + ["--overlap-moe-expert-parallel-comm"] + chunks(2)),
    "ep2-recompute": (EP2 + ["--recompute", "full"], EP2 + ["--recompute", "full"] + chunks(4)),
    "deepseek-ep2": (DEEPSEEK, DEEPSEEK + chunks(2)),
    "ep2-fp8": (EP2 + ["--fp8-format", "hybrid"], EP2 + ["--fp8-format", "hybrid"] + chunks(2)),
    "ep2-zero3": (EP2 + ["--zero-stage", "3"], EP2 + ["--zero-stage", "3"] + chunks(2)),
}


@pytest.fixture(scope="module")
def two_rank_runs():
    return paired_runs(_trainings, 2, TWO_RANKS, fresh_seed())


@pytest.mark.parametrize("name", TWO_RANKS)
def test_chunked_dispatch_trains_bitwise_like_one_exchange(two_rank_runs, name):
    for plain, chunked in two_rank_runs[name]:
        _assert_same(plain, chunked)


FOUR_RANKS = {
    "tp2-sp-etp2-ep2": ["--tp", "2", "--sequence-parallel", "--ep", "2", "--global-batch-size", "8"],
    "pp2-ep2-dualpipev-pairs": ["--pp", "2", "--pipeline-schedule", "dualpipev", "--ep", "2", "--global-batch-size",
                                "16", "--overlap-moe-expert-parallel-comm"],
    "pp2-ep2-zb-h1": ["--pp", "2", "--pipeline-schedule", "zb-h1", "--ep", "2", "--global-batch-size", "16"],
}


@pytest.mark.slow
def test_chunked_dispatch_trains_bitwise_like_one_exchange_on_four_ranks():
    runs = [argv for layout in FOUR_RANKS.values() for argv in (BASE + layout, BASE + layout + chunks(2))]
    for by_rank in run_ranks(_trainings, 4, args=(runs, fresh_seed()), timeout=600):
        for i, name in enumerate(FOUR_RANKS):
            _assert_same(by_rank[2 * i], by_rank[2 * i + 1], etp_padding="etp2" in name)


def test_chunks_add_no_host_sync():
    # dropless routing's one host copy of the counts per MoE layer stays the only one
    argv = EP2 + ["--train-iters", "3", "--log-interval", "3"]
    for plain, chunked in run_ranks(steady_host_syncs, 2, args=([argv, argv + chunks(2)],)):
        assert chunked == plain > 0


@pytest.mark.parametrize("argv,named", [
    (BASE + ["--global-batch-size", "8"] + chunks(2), "--ep > 1"),
    (EP2 + chunks(5), "give at most 4"),
    (EP2 + ["--moe-token-dispatcher-type", "allgather"] + chunks(2), "--moe-token-dispatcher-type alltoall"),
    (EP2 + ["--torch-compile"] + chunks(2), "drop --torch-compile"),
    (["--model", "gpt-tiny", "--ep", "1"] + chunks(2), "mixture-of-experts models only"),
])
def test_what_cannot_be_chunked_is_refused_in_one_line(argv, named):
    message = refusal(argv, 2)
    assert "--moe-dispatch-chunks" in message and named in message, message


def test_posts_a_failed_pass_left_are_dropped_never_launched():
    from megalite.parallel import lanes

    launched = []

    class Work:
        def wait(self):
            pass

    def exchange(name, async_op=False):
        launched.append(name)
        return Work()

    lanes.post(exchange, "first", kind="ep")
    lanes.post(exchange, "left behind", kind="ep")  # queued behind the first, which is never waited for
    lanes.drop_posts()  # (run_schedule does, as each schedule begins)
    lanes.post(exchange, "next", kind="ep").wait()
    assert launched == ["first", "next"]
