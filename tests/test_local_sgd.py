"""Local SGD / DiLoCo (--local-sgd-interval H): at H=1 with a plain outer step it is data
parallelism; replicas agree right after each outer step and differ between; no data-parallel
collective during inner steps and one all-reduce of the parameters' bytes at each outer step;
async rounds applied one round late and streaming fragments by hand computation; exact resume
mid-round and at a round boundary; --overlap-grad-reduce false reduces only after backward."""
import pytest
import torch
import torch.distributed as dist

from helpers import rel_err
from megalite import arguments
from megalite.optim import ParamAndGradBuffer
from megalite.optim.local_sgd import LocalSGD, split_fragments
from megalite.runtime import UsageError
from megalite.testing import RankFailure, counting_collectives, ring_bytes, run_ranks
from training_ranks import gpt_run, parse, several, train_losses

BASE = ["--seq-length", "32", "--global-batch-size", "8", "--micro-batch-size", "2", "--log-interval", "1"]
# Plain SGD with a constant lr and no clipping: the inner optimizer is then a linear map of the
# gradient, so averaging the replicas' deltas is averaging their gradients (see docs/local-sgd.md).
SGD = ["--optimizer", "sgd", "--lr", "0.05", "--min-lr", "0.05", "--lr-warmup-iters", "0", "--lr-decay-style",
       "constant", "--clip-grad", "0"]
PLAIN_OUTER = ["--local-sgd-interval", "1", "--outer-lr", "1", "--outer-momentum", "0"]


def final_params(run) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for c in run.model_chunks for p in c.parameters()])


def losses_and_params(rank, world, argv):
    run = gpt_run(argv)
    return [r["loss"] for r in run.records], final_params(run)


def by_world(fn, cases: dict) -> dict:
    """name -> each rank's results of fn over the case's argvs: (world, argvs) by name, every case of
    one world size in one spawn."""
    out = {}
    for world in sorted({w for w, _ in cases.values()}):
        names = [n for n, (w, _) in cases.items() if w == world]
        flat = [argv for n in names for argv in cases[n][1]]
        per_rank = run_ranks(several, world, args=(fn, flat), timeout=600)
        at = 0
        for n in names:
            k = len(cases[n][1])
            out[n] = [runs[at:at + k] for runs in per_rank]
            at += k
    return out


INSIDE = {"dp2": [], "tp2xdp2": ["--tp", "2"], "cp2xdp2": ["--cp", "2"]}


@pytest.fixture(scope="module")
def h1_runs():
    # 3 steps: the last two losses and the final weights follow averaged updates, more repeat them.
    argvs = {n: BASE + SGD + ["--train-iters", "3", *inside] for n, inside in INSIDE.items()}
    return by_world(losses_and_params, {n: (4 if INSIDE[n] else 2, [a, a + PLAIN_OUTER]) for n, a in argvs.items()})


@pytest.mark.parametrize("inside", list(INSIDE))
def test_h1_with_a_plain_outer_step_equals_data_parallelism(h1_runs, inside):
    (dp_losses, dp_params), (ls_losses, ls_params) = h1_runs[inside][0]
    assert rel_err(torch.tensor(ls_losses), torch.tensor(dp_losses)) <= 1e-5, (ls_losses, dp_losses)
    assert rel_err(ls_params, dp_params) <= 1e-5


def replica_trace(rank, world, argv):
    """Losses, and after every step this rank's masters and which fragments synchronized."""
    trace = []
    original = LocalSGD.after_inner_step

    def traced(self):
        due = original(self)
        trace.append((due, torch.cat([m.detach().reshape(-1).float() for m in self.masters])))
        return due

    LocalSGD.after_inner_step = traced
    try:
        run = gpt_run(argv)
    finally:
        LocalSGD.after_inner_step = original
    return [r["loss"] for r in run.records], trace


REPLICAS = {"fp32": (2, []), "bf16": (2, ["--bf16"]), "pp2xdp2": (4, ["--pp", "2"])}
H = 2  # rounds of 2 inner steps, 2 rounds: apart after each round's first step, together after its last


@pytest.fixture(scope="module")
def replica_traces():
    argv = BASE + ["--train-iters", str(2 * H), "--lr", "3e-3", "--local-sgd-interval", str(H)]
    return by_world(replica_trace, {n: (world, [argv + extra]) for n, (world, extra) in REPLICAS.items()})


@pytest.mark.parametrize("name", list(REPLICAS))
def test_replicas_agree_right_after_each_outer_step_and_differ_between(replica_traces, name):
    world = REPLICAS[name][0]
    traces = [runs[0] for runs in replica_traces[name]]
    (losses, a), (_, b) = traces[0], traces[1]  # dp ranks 0 and 1 of pipeline stage 0
    if world == 4:  # and of the last stage
        assert [due for due, _ in traces[2][1]] == [due for due, _ in a]
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(traces[2][1][H - 1::H], traces[3][1][H - 1::H]))
    for step, ((due, pa), (_, pb)) in enumerate(zip(a, b), start=1):
        if step % H == 0:
            assert due == [0] and torch.equal(pa, pb), f"step {step}: replicas must hold the outer parameters"
        else:
            assert due == [] and not torch.equal(pa, pb), f"step {step}: replicas train apart between outer steps"
    assert losses[-1] < losses[0], losses


def _outer_delta(rank, world, argv):
    """Per step: the bytes sent by collectives over >1 rank in inner steps and in the outer step."""
    events, phase = [], ["inner"]
    original = LocalSGD.after_inner_step

    def marked(self):
        phase[0] = "outer"
        try:
            return original(self)
        finally:
            phase[0] = "inner"
            events.append(("step", self.steps, sum(m.numel() for m in self.masters)))

    def record(kind, nbytes, n):
        if n > 1:
            events.append((phase[0], kind, nbytes, n))

    LocalSGD.after_inner_step = marked
    try:
        with counting_collectives(record):
            gpt_run(argv)
    finally:
        LocalSGD.after_inner_step = original
    return events


@pytest.fixture(scope="module")
def outer_events():
    """dtype -> each rank's events (tp 2 x dp 2), both dtypes in one spawn. 4 steps in rounds of 2:
    two outer steps, and inner steps before and between them. The log line (an all-reduce of the
    loss over DP) only after the last step: --log-interval 4."""
    argv = BASE + ["--train-iters", "4", "--log-interval", "4", "--local-sgd-interval", "2", "--tp", "2"]
    return by_world(_outer_delta, {d: (4, [argv + ["--outer-grad-dtype", d]]) for d in ("fp32", "bf16")})


@pytest.mark.parametrize("dtype,size", [("fp32", 4), ("bf16", 2)])
def test_inner_steps_send_nothing_across_replicas_and_the_outer_step_one_all_reduce(outer_events, dtype, size):
    for (events,) in outer_events[dtype]:
        steps = [e for e in events if e[0] == "step"]
        numel = steps[0][2]
        assert [s[1] for s in steps] == [1, 2, 3, 4]
        sent_before_last_step = events[:events.index(steps[-1])]
        inner = [e for e in sent_before_last_step if e[0] == "inner"]
        # TP collectives run inside a replica (group of 2 TP ranks); none of them is data parallel:
        # nothing the size of the gradients goes anywhere.
        assert all(e[2] < numel for e in inner), inner
        outer = [e for e in events if e[0] == "outer"]
        assert [(k, b, n) for _, k, b, n in outer] == [("all_reduce", numel * size, 2)] * 2
        assert ring_bytes("all_reduce", numel * size, 2) == numel * size  # 2 (n - 1) / n = 1 at n = 2


def _traced_resume(rank, world, argv):
    return [r["loss"] for r in gpt_run(argv).records]


RESUMES = {"sync": [], "async-streaming-bf16": ["--local-sgd-async", "--local-sgd-fragments", "2",
                                               "--outer-grad-dtype", "bf16"]}
# Rounds of 2 over 6 steps: a stop at 3 (mid-round, after one outer step; streaming: fragment 1
# mid-round) and at 4 (right after an outer step); each resumed run meets another outer step.
STOPS = (3, 4)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """case -> rank 0's losses: the unbroken run, then per stop the saving run and the resumed one;
    both cases in one spawn."""
    cases = {}
    for name, extra in RESUMES.items():
        tmp = tmp_path_factory.mktemp(name)
        argv = BASE + ["--train-iters", "6", "--local-sgd-interval", "2"] + extra
        cases[name] = (2, [argv] + [a for stop in STOPS for a in (
            argv + ["--save", str(tmp / str(stop)), "--exit-interval", str(stop)],
            argv + ["--load", str(tmp / str(stop))])])
    return {name: runs[0] for name, runs in by_world(_traced_resume, cases).items()}


@pytest.mark.parametrize("extra", list(RESUMES))
def test_resume_is_bitwise_exact_mid_round_and_at_a_round_boundary(resumed, extra):
    whole, *parts = resumed[extra]
    for stop, first, second in zip(STOPS, parts[::2], parts[1::2]):
        assert first + second == whole, f"stopped at {stop}: resumed losses must equal the unbroken run's bit for bit"


# -- the outer loop by hand ----------------------------------------------------------------------

def _drive(rank, world, asynchronous, momentum, steps, fragments=1, dtype=torch.float32):
    """Replica r subtracts (r + 1) from every element each inner step: its pseudo-gradient over a
    round of 2 steps is 2 (r + 1), the average over 2 replicas 3. Returns the outer parameters
    and the bytes handed to the all-reduce after each step."""
    masters = [torch.zeros(3), torch.zeros(5)]
    local = LocalSGD(masters, interval=2, outer_lr=0.5, outer_momentum=momentum, group=dist.group.WORLD,
                     asynchronous=asynchronous, fragments=fragments, comm_dtype=dtype)
    out = []
    for _ in range(steps):
        for m in masters:
            m.sub_(rank + 1)
        sent = local.sent_bytes
        due = local.after_inner_step()
        out.append((due, local.outer.clone(), local.sent_bytes - sent, [m.clone() for m in masters]))
    return out


def _hand(asynchronous, momentum, rounds):
    """The outer parameter after each round, by hand: g = 3 each round (one round late if async)."""
    theta, b, out, pending = 0.0, 0.0, [], None
    for _ in range(rounds):
        g = pending if asynchronous else 3.0
        pending = 3.0
        if g is not None:
            b = momentum * b + g
            theta -= 0.5 * (g + momentum * b)
        out.append(theta)
    return out


def _drives(rank, world, calls):
    return [_drive(rank, world, *args) for args in calls]


# (asynchronous, momentum, steps[, fragments, dtype]) of each hand-driven run below.
DRIVES = [(a, m, 8) for m in (0.0, 0.9) for a in (False, True)] + [(False, 0.0, 4, 2), (False, 0.0, 2, 1, torch.bfloat16)]


@pytest.fixture(scope="module")
def driven():
    """DRIVES' entry -> each rank's trace, every run in one spawn."""
    per_rank = run_ranks(_drives, 2, args=(DRIVES,))
    return {args: [runs[i] for runs in per_rank] for i, args in enumerate(DRIVES)}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_outer_nesterov_steps_match_a_hand_computation(driven, asynchronous, momentum):
    trace = driven[(asynchronous, momentum, 8)]
    expected = _hand(asynchronous, momentum, 4)
    for rank_trace in trace:
        outer_after_rounds = [t[1] for t in rank_trace[1::2]]
        for k, (got, want) in enumerate(zip(outer_after_rounds, expected)):
            assert torch.allclose(got, torch.full((8,), want)), (k, got, want)
        for due, outer, _, masters in rank_trace[1::2]:  # every replica restarts from the outer parameters
            assert torch.equal(torch.cat(masters), outer)
    if asynchronous:  # the first round's average is applied only at the second round's end
        assert expected[0] == 0.0 and trace[0][1][1].abs().max() == 0


def test_streaming_fragments_synchronize_in_turn_with_a_fraction_of_the_bytes(driven):
    trace = driven[(False, 0.0, 4, 2)][0]
    # Fragment 0 (3 elements) at odd steps, fragment 1 (5 elements) at even steps: H / F = 1 apart.
    assert [t[0] for t in trace] == [[0], [1], [0], [1]]
    assert [t[2] for t in trace] == [3 * 4, 5 * 4, 3 * 4, 5 * 4]
    # Fragment 0's first round is one step long: pseudo-gradients 1, 2 (mean 1.5); then 2 steps.
    assert torch.allclose(trace[0][1][:3], torch.full((3,), -0.75))
    assert torch.allclose(trace[2][1][:3], torch.full((3,), -0.75 - 1.5))
    assert torch.allclose(trace[1][1][3:], torch.full((5,), -1.5))


def test_bf16_pseudo_gradients_halve_the_bytes(driven):
    trace = driven[(False, 0.0, 2, 1, torch.bfloat16)][0]
    assert trace[1][2] == 8 * 2 and torch.allclose(trace[1][1], torch.full((8,), -1.5))


def test_split_fragments_cuts_sizes_evenly_without_splitting_a_tensor():
    assert split_fragments([4, 4, 4, 4], 2) == [(0, 2), (2, 4)]
    assert split_fragments([10, 1, 1, 1], 2) == [(0, 1), (1, 4)]
    assert split_fragments([5], 2) == [(0, 1), (1, 1)]


# -- flags -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--local-sgd-interval", "4", "--local-sgd-fragments", "3"], "--local-sgd-fragments 3 must divide"),
    (["--local-sgd-interval", "4", "--use-distributed-optimizer"], "drop --use-distributed-optimizer"),
    (["--local-sgd-interval", "4", "--zero-stage", "2"], "drop --use-distributed-optimizer / --zero-stage"),
    (["--local-sgd-async"], "add --local-sgd-interval H"),
    (["--outer-grad-dtype", "bf16"], "add --local-sgd-interval H"),
    (["--local-sgd-warmup-iters", "8"], "add --local-sgd-interval H"),
    (["--local-sgd-interval", "4", "--local-sgd-warmup-iters", "-1"], "--local-sgd-warmup-iters must be an integer"),
    (["--local-sgd-interval", "-1"], "--local-sgd-interval must be an integer >= 0"),
    (["--local-sgd-interval", "4", "--outer-momentum", "1"], "--outer-momentum must be in [0, 1)"),
    (["--local-sgd-interval", "4", "--outer-lr", "0"], "--outer-lr must be > 0"),
    (["--overlap-grad-reduce", "false", "--zero-stage", "2"], "applies to ZeRO stages 0-1"),
])
def test_bad_local_sgd_flags_end_with_one_line(argv, message):
    args = parse(BASE + argv)
    with pytest.raises(UsageError) as e:
        arguments.validate(args, 2, arguments.model_config(args))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


# -- --overlap-grad-reduce ---------------------------------------------------------------------------

def _launches(rank, world, argv):
    """Losses, and per step and buffer: the gradients ready at each bucket launch, and in all."""
    seen = []
    original = ParamAndGradBuffer.zero_grad

    def snapshot(self):
        seen.append(([hooks for _, hooks in self.launch_log], self._hooks_seen))
        original(self)

    ParamAndGradBuffer.zero_grad = snapshot
    try:
        losses = [r["loss"] for r in gpt_run(argv).records]
    finally:
        ParamAndGradBuffer.zero_grad = original
    return losses, seen


def test_overlap_grad_reduce_false_reduces_every_bucket_after_backward_with_the_same_losses():
    argv = BASE + ["--train-iters", "3", "--ddp-bucket-size", "20000"]
    (on, on_seen), (off, off_seen) = run_ranks(
        several, 2, args=(_launches, [argv, argv + ["--overlap-grad-reduce", "false"]]))[0]
    assert on == off
    assert all(len(launches) > 1 for launches, _ in off_seen)  # several buckets
    assert all(all(h == total for h in launches) for launches, total in off_seen)
    assert any(h < total for launches, total in on_seen for h in launches)  # overlapped: some launched early


def test_local_sgd_h_gt_1_differs_from_data_parallelism_and_adam_h1_is_not_dp():
    """What the equivalence needs: at H=1 AdamW averages per-replica Adam updates, not gradients."""
    argv = BASE + ["--train-iters", "3"]
    dp, adam_h1 = run_ranks(several, 2, args=(train_losses, [argv, argv + PLAIN_OUTER]))[0]
    assert abs(dp[0] - adam_h1[0]) <= 1e-5 * dp[0]  # the same start
    assert max(abs(a - b) for a, b in zip(dp[1:], adam_h1[1:])) > 1e-4


def test_a_local_sgd_checkpoint_refuses_another_layout_unless_its_optimizer_state_is_dropped(tmp_path):
    argv = BASE + ["--train-iters", "3", "--local-sgd-interval", "2"]
    run_ranks(train_losses, 2, args=(argv + ["--save", str(tmp_path), "--exit-interval", "1"],))
    with pytest.raises(RankFailure, match="its replicas' own states resume at that layout only"):
        run_ranks(train_losses, 1, args=(argv + ["--load", str(tmp_path)],))
    assert len(run_ranks(train_losses, 1, args=(argv + ["--load", str(tmp_path), "--no-load-optim"],))[0]) == 2


def test_warmup_steps_are_data_parallel_then_rounds_of_h_follow():
    # AdamW (not a linear map): the warmup steps average gradients, so they are data parallelism's
    # steps; after them the replicas part, and meet every H steps counted from the warmup's end.
    # 2 warmup steps, then two rounds of 2 (apart after each round's first step), in one spawn with
    # the data-parallel run (no local SGD: its trace is empty).
    argv = BASE + ["--train-iters", "6", "--lr", "3e-3"]
    warmup = 2
    traces = run_ranks(several, 2, args=(replica_trace, [argv, argv + ["--local-sgd-interval", "2",
                                                                        "--local-sgd-warmup-iters", str(warmup)]]))
    (dp_losses, _), (losses, a) = traces[0]
    (_, b) = traces[1][1]
    assert rel_err(torch.tensor(losses[:warmup + 1]), torch.tensor(dp_losses[:warmup + 1])) <= 1e-5, (losses, dp_losses)
    assert losses[warmup + 1:] != dp_losses[warmup + 1:]
    for step, ((due, pa), (_, pb)) in enumerate(zip(a, b), start=1):
        together = step <= warmup or (step - warmup) % 2 == 0
        assert due == ([0] if step > warmup and together else []), step
        assert torch.equal(pa, pb) == together, f"step {step}"


def _resume_notes(rank, world, argvs):
    """The resume's notes (megalite.training.resume's say) for each argv, run in turn."""
    from megalite.training import resume as R

    out = []
    for argv in argvs:
        lines, original = [], R.say
        R.say = lines.append
        try:
            gpt_run(argv)
        finally:
            R.say = original
        out.append([line for line in lines if "note:" in line])
    return out


@pytest.mark.slow
def test_resuming_local_sgd_state_under_other_settings_says_what_it_drops(tmp_path):
    """Issue #34: without local SGD, without --local-sgd-async, or with another interval, a resume of an
    async local-SGD checkpoint (a round's average pending) says in one line what it drops or changes."""
    # Saved at step 3: mid-round, the first round's average pending (async: applied at step 4).
    argv = BASE + ["--train-iters", "4", "--local-sgd-interval", "2", "--local-sgd-async"]
    resume = BASE + ["--train-iters", "4", "--load", str(tmp_path)]
    notes = run_ranks(_resume_notes, 2, args=([argv + ["--save", str(tmp_path), "--exit-interval", "3"],
                                               resume, resume + ["--local-sgd-interval", "2"],
                                               resume + ["--local-sgd-interval", "4", "--local-sgd-async"],
                                               argv + ["--load", str(tmp_path)]],))[0]
    saved, plain, sync, longer, same = notes
    assert saved == [] and same == []
    assert len(plain) == 1 and plain[0].endswith(
        "is a local-SGD checkpoint and this run has no --local-sgd-interval: it goes on from replica 0's weights "
        "and optimizer state, dropping the outer parameters and momentum, the pending averaged pseudo-gradient and "
        "the other replicas' own weights and optimizer states"), plain
    assert len(sync) == 1 and "was saved with --local-sgd-async: its pending averaged pseudo-gradient of " \
                               "fragment(s) [0] is dropped" in sync[0], sync
    assert len(longer) == 1 and "ran outer rounds of 2 inner steps, this run 4: the outer state carries over" \
                                in longer[0], longer
    assert all("\n" not in line for line in plain + sync + longer)
