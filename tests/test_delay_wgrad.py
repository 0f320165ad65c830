"""--delay-wgrad-compute (issue #50): a backward's weight-gradient work done while exchanges are in
flight (megalite.parallel.weight_grad's `fill_one`, run by megalite.parallel.lanes' waits). Claims:
an item goes early only where its parameter has no other item in the backward, and the gradients
are the whole W's bit for bit; a wait runs items until its exchange is done, and work that tries to
launch a collective raises; training is bitwise the run without the flag (losses, gradient norms,
bytes, every weight) at EP 2 with and without overlapped pairs, with a layer's experts in groups,
full recomputation, DeepSeek-V3, FP8, TP 2 with SP, CP 2's ring, the distributed optimizer, and
(slow) PP 2 under 1F1B, ZB-H1 and DualPipeV's pairs; the waits are lent the work, and run it; no
host sync is added; what it cannot do is refused in one line."""
import pytest
import torch

from helpers import fresh_seed
from megalite.parallel import host_heap, lanes, weight_grad
from megalite.testing import run_ranks
from test_moe_dispatch_chunks import DEEPSEEK, EP2, _assert_same, chunks
from training_ranks import paired_runs, parse, refusal, steady_host_syncs, train_params

DELAY = ["--delay-wgrad-compute"]


def _two_uses():
    """A model whose first weight has one use and whose second has two (as a tied embedding has)."""
    torch.manual_seed(0)
    w1, w2 = torch.nn.Parameter(torch.randn(6, 5)), torch.nn.Parameter(torch.randn(6, 6))
    x = torch.randn(7, 5)

    def loss():
        y = weight_grad.linear(x, w1)
        return weight_grad.linear(weight_grad.linear(y, w2).tanh(), w2).square().sum()
    return (w1, w2), loss


def test_an_item_goes_early_only_where_its_parameter_has_no_other_and_the_gradients_are_ws():
    params, loss = _two_uses()
    key = torch.nn.Module()  # the model chunk the uses are learned for
    for _ in range(2):  # plain autograd, twice (accumulating)
        loss().backward()
    expected = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    ran_early = []
    with weight_grad.split_ops(True, cheap=False):
        for step in range(2):
            with weight_grad.deferred(key, fill=True) as work:
                loss().backward()
                while weight_grad.fill_one():  # what a wait for an exchange does
                    ran_early.append(step)
            work.run()
    # the first backward learns the uses (nothing early); the second runs w1's item early, not w2's two
    assert ran_early == [1]
    assert [torch.equal(p.grad, e) for p, e in zip(params, expected)] == [True, True]
    assert not weight_grad.can_fill()


def test_a_parameter_that_ran_early_and_then_had_another_item_is_an_error():
    params, loss = _two_uses()
    key = torch.nn.Module()
    weight_grad._uses[key] = {id(params[0]): 1, id(params[1]): 1}  # as if w2 had one use
    with weight_grad.split_ops(True, cheap=False):
        with weight_grad.deferred(key, fill=True) as work:
            loss().backward()
            while weight_grad.fill_one():
                pass
        with pytest.raises(RuntimeError, match="received another in the same backward"):
            work.run()


class _Exchange:
    """A collective in flight for `polls` checks."""

    def __init__(self, polls):
        self.polls, self.waited = polls, False

    def is_completed(self):
        self.polls -= 1
        return self.polls < 0

    def wait(self):
        self.waited = True


def test_a_wait_runs_lent_work_until_its_exchange_is_done_and_never_a_collective():
    ran, saved = [], lanes._filler
    try:
        lanes.set_filler(lambda: True, lambda: ran.append(1) or len(ran) < 10)
        work = _Exchange(polls=3)
        lanes.wait(work, "ep")
        assert len(ran) == 3 and work.waited  # three items while it was in flight, then the wait
        lanes.set_filler(lambda: True, lambda: ran.append(1) or len(ran) < 5)
        lanes.wait(_Exchange(polls=100), "ep")
        assert len(ran) == 5  # the work ran out first

        def launches():
            lanes.collective(lambda async_op=False: _Exchange(0), kind="ep")
            return True
        lanes.set_filler(lambda: True, launches)
        with pytest.raises(RuntimeError, match="launched a collective"):
            lanes.wait(_Exchange(polls=3), "ep")
    finally:
        lanes._filler = saved


def _trainings(rank, world, runs, seed):
    """Each run trained, with how many waits found weight-gradient work lent (set by the passes
    alone) and how many items the waits ran (as many as their exchanges were in flight for)."""
    out = []
    ready, run_one = lanes._filler
    for argv in runs:
        lent, filled = [0], [0]

        def counting_ready():
            now = ready()
            lent[0] += now
            return now

        def counting():
            done = run_one()
            filled[0] += done
            return done
        lanes._filler = (counting_ready, counting)
        try:
            result = train_params(rank, world, argv + ["--seed", str(seed)])
        finally:
            lanes._filler = (ready, run_one)
        result["lent"], result["filled"] = lent[0], filled[0]
        out.append(result)
    return out


PAIRS = ["--overlap-moe-expert-parallel-comm"]
TWO_RANKS = {  # name: the run without the flag (with it: + DELAY)
    "ep2": EP2,
    "ep2-pairs": EP2 + PAIRS,
    "ep2-pairs-groups": EP2 + PAIRS + chunks(2),
    "ep2-recompute": EP2 + ["--recompute", "full"],
    "deepseek-ep2": DEEPSEEK,
    "ep2-fp8": EP2 + ["--fp8-format", "hybrid"],
    "ep2-distributed-optimizer": EP2 + ["--use-distributed-optimizer"],
    "tp2-sp": EP2[:EP2.index("--ep")] + ["--tp", "2", "--sequence-parallel", "--global-batch-size", "8"],
    "cp2-ring": EP2[:EP2.index("--ep")] + ["--cp", "2", "--global-batch-size", "8"],
}


@pytest.fixture(scope="module")
def two_rank_runs():
    return paired_runs(_trainings, 2, {name: (base, base + DELAY) for name, base in TWO_RANKS.items()}, fresh_seed())


@pytest.mark.parametrize("name", TWO_RANKS)
def test_delayed_weight_gradients_train_bitwise_like_autograds_and_lend_the_waits_work(two_rank_runs, name):
    for plain, delayed in two_rank_runs[name]:
        _assert_same(plain, delayed)
        assert plain["lent"] == plain["filled"] == 0 and delayed["lent"] > 0, (plain["lent"], delayed["lent"])


def test_the_waits_ran_weight_gradients(two_rank_runs):
    # how many depends on how long each exchange was in flight when polled: over every layout, some
    assert sum(delayed["filled"] for runs in two_rank_runs.values() for _, delayed in runs) > 0


FOUR_RANKS = {
    "pp2-ep2-1f1b": ["--pp", "2", "--ep", "2", "--global-batch-size", "16"],
    "pp2-ep2-zb-h1": ["--pp", "2", "--pipeline-schedule", "zb-h1", "--ep", "2", "--global-batch-size", "16"],
    "pp2-ep2-dualpipev-pairs": ["--pp", "2", "--pipeline-schedule", "dualpipev", "--ep", "2", "--global-batch-size",
                                "16"] + PAIRS,
}


@pytest.mark.slow
def test_delayed_weight_gradients_train_bitwise_on_four_ranks():
    base = EP2[:EP2.index("--ep")]
    runs = [argv for layout in FOUR_RANKS.values() for argv in (base + layout, base + layout + DELAY)]
    for by_rank in run_ranks(_trainings, 4, args=(runs, fresh_seed()), timeout=600):
        for i, name in enumerate(FOUR_RANKS):
            _assert_same(by_rank[2 * i], by_rank[2 * i + 1])


def test_delayed_weight_gradients_add_no_host_sync():
    argv = EP2 + PAIRS + ["--train-iters", "3", "--log-interval", "3"]
    for plain, delayed in run_ranks(steady_host_syncs, 2, args=([argv, argv + DELAY],)):
        assert delayed == plain > 0


@pytest.mark.parametrize("argv,named", [
    (EP2 + DELAY + ["--zero-stage", "2"], "--zero-stage 2 reduce-scatters"),
    (EP2 + DELAY + ["--zero-stage", "3"], "use --zero-stage 0 or 1"),
    (EP2 + DELAY + ["--torch-compile"], "drop --torch-compile"),
])
def test_what_cannot_delay_its_weight_gradients_is_refused_in_one_line(argv, named):
    message = refusal(argv, 2)
    assert "--delay-wgrad-compute" in message and named in message, message


def test_megatron_lms_flag_is_honoured_not_noted():
    from megalite import arguments
    from megalite.config.megatron import kind_of

    parser = arguments.build_parser("test", default_model="gpt-tiny")
    assert kind_of("--delay-wgrad-compute", parser) == ("honoured", "parallel.delay_wgrad_compute")
    assert parse(EP2 + DELAY).parallel.delay_wgrad_compute


_KEEP_PROBE = """
import sys
import torch
from megalite.parallel import host_heap
if sys.argv[1] == "keep":
    assert host_heap.keep_freed_memory()
block = torch.ones(1 << 20)  # 4 MiB
at = block.data_ptr()
for line in open("/proc/self/maps"):
    span, *rest = line.split()
    lo, hi = (int(x, 16) for x in span.split("-"))
    if lo <= at < hi:
        print(rest[-1] if len(rest) == 5 else "anonymous")
"""


def test_kept_freed_memory_comes_from_the_heap_not_a_mapping_of_its_own():
    """By default glibc gives a 4 MiB block a mapping of its own, unmapped when it is freed, so the
    next one faults every page in again; with `keep_freed_memory` it comes from the heap, which is
    never trimmed, and freed blocks are reused (measured: 8,002 page faults to allocate eight again
    by default, 1,024 with it; page faults vary too much on a loaded machine to assert on)."""
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's (test_a_wait_runs_lent_work... covers the filling everywhere)")
    where = {how: subprocess.run([sys.executable, "-c", _KEEP_PROBE, how], capture_output=True, text=True,
                                 check=True).stdout.strip() for how in ("default", "keep")}
    assert where == {"default": "anonymous", "keep": "[heap]"}, where
    assert host_heap.MMAP_THRESHOLD_MAX == 32 << 20
