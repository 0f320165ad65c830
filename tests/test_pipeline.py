"""Pipeline parallelism: every layout trains to the single-device losses; 1F1B bounds the
activations in flight; tied embeddings stay tied; bad layouts are refused clearly."""
import json

import pytest
import torch
from torch import nn

from helpers import rel_err
from megalite import parallel
from megalite.pipeline.schedules import build_program, program_1f1b, program_interleaved, run_schedule
from megalite.pipeline.executor import SENDS_IN_FLIGHT
from megalite.testing import run_ranks
from training_ranks import parse, train_and_check_tied_embeddings, train_losses

COMMON = ["--train-iters", "8", "--log-interval", "1", "--seq-length", "32", "--global-batch-size", "16"]


@pytest.fixture(scope="module")
def reference():
    return run_ranks(train_losses, 1, args=(COMMON + ["--micro-batch-size", "2"],))[0]


# (tp, pp, dp, extra flags): micro-batches per step m = 16 / (mbs * dp), below and above pp.
LAYOUTS = [
    (1, 2, 1, ["--micro-batch-size", "2"]),  # m=8 > p
    (1, 2, 1, ["--micro-batch-size", "16"]),  # m=1 < p
    (1, 4, 1, ["--micro-batch-size", "2"]),  # m=8 > p
    (1, 4, 1, ["--micro-batch-size", "8"]),  # m=2 < p
    (2, 2, 1, ["--micro-batch-size", "4"]),
    (1, 2, 2, ["--micro-batch-size", "2"]),
    (2, 2, 2, ["--micro-batch-size", "2"]),
    (1, 2, 1, ["--micro-batch-size", "2", "--vpp", "2"]),  # interleaved, m=8
    (1, 2, 1, ["--micro-batch-size", "8", "--vpp", "2"]),  # interleaved, m=p
    (1, 2, 1, ["--micro-batch-size", "2", "--pipeline-layers", "1,3"]),  # explicit uneven split
]


@pytest.mark.parametrize("tp,pp,dp,extra", LAYOUTS, ids=lambda v: str(v).replace(" ", ""))
def test_layout_trains_to_single_device_losses(reference, tp, pp, dp, extra):
    argv = COMMON + ["--tp", str(tp), "--pp", str(pp)] + extra
    results = run_ranks(train_and_check_tied_embeddings, tp * pp * dp, args=(argv,))
    for losses, tied in results:
        assert len(losses) == 8
        assert rel_err(torch.tensor(losses), torch.tensor(reference)) <= 1e-5, (losses, reference)
        assert tied in (None, True), "the first and last stage's word embeddings drifted apart"


class _Stage(nn.Module):
    """A toy stage: one linear layer; the last one also sums its output as the 'loss'."""

    def __init__(self, last):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.post_process, self.input_tensor = nn.Linear(4, 4), last, None

    def set_input_tensor(self, t):
        self.input_tensor = t


def _toy_step(model, batch):
    x = batch["x"] if model.input_tensor is None else model.input_tensor
    y = torch.tanh(model.lin(x))
    return y.sum() if model.post_process else y


def in_flight(rank, world, m, kind):
    parallel.initialize_model_parallel(1, world)
    model = _Stage(last=rank == world - 1)
    batches = [{"x": torch.full((2, 3, 4), float(i))} for i in range(m)]
    stats = run_schedule(build_program(world, rank, m, kind=kind), [model], batches, _toy_step,
                         torch.tensor(1.0), (2, 3, 4), torch.float32)
    return stats.peak_in_flight, model.lin.weight.grad.clone()


def test_1f1b_keeps_at_most_p_micro_batches_in_flight_while_gpipe_keeps_m():
    p, m = 4, 8
    one_f_one_b = run_ranks(in_flight, p, args=(m, "1f1b"))
    gpipe = run_ranks(in_flight, p, args=(m, "gpipe"))
    assert one_f_one_b[0][0] == p, "stage 0 under 1F1B holds p micro-batches at most"
    assert [peak for peak, _ in one_f_one_b] == [p - r for r in range(p)]
    assert gpipe[0][0] == m, "GPipe order holds all m"
    for (_, g1), (_, g2) in zip(one_f_one_b, gpipe):
        assert torch.allclose(g1, g2, rtol=1e-6), "the order must not change the gradients"


def test_programs_run_every_forward_and_backward_once():
    for p, m, v in [(2, 4, 2), (4, 8, 2), (4, 4, 3), (3, 6, 2)]:
        for r in range(p):
            ops = [(o.kind, o.chunk, o.micro_batch) for o in program_interleaved(p, r, m, v) if o.kind != "X"]
            want = {(k, c, i) for k in "FB" for c in range(v) for i in range(m)}
            assert sorted(ops) == sorted(want) and len(ops) == len(want)
            done = set()
            for kind, c, i in ops:  # a chunk's backward comes after its forward
                assert kind == "F" or ("F", c, i) in done
                done.add((kind, c, i))
    assert [o.kind for o in program_1f1b(2, 0, 1) if o.kind != "X"] == ["F", "B"]


@pytest.mark.parametrize("argv,world,message", [
    (["--pp", "8"], 8, "--pp 8 is larger than the number of layers (4)"),
    (["--pp", "2", "--vpp", "4"], 2, "--vpp 4 does not divide the layers per pipeline stage (2"),
    (["--pp", "2", "--vpp", "2", "--micro-batch-size", "16"], 2,
     "needs the micro-batches per step (1 = --global-batch-size 16"),
    (["--pp", "3"], 3, "the number of layers (4) is not divisible by --pp (3)"),
    (["--pp", "2", "--pipeline-layers", "1,2"], 2, "must be counts >= 0 summing to the number of layers (4)"),
    (["--vpp", "2"], 1, "--vpp 2 needs pipeline parallelism"),
    (["--pp", "2", "--pipeline-schedule", "interleaved"], 2, "interleaved needs model chunks per rank: give --vpp"),
    (["--pp", "2", "--vpp", "2", "--pipeline-schedule", "zb-h1"], 2, "zb-h1 runs one model chunk per rank"),
    (["--pp", "2", "--pipeline-schedule", "zb-h1", "--torch-compile"], 2,
     "--torch-compile keeps the weight gradients inside them: drop one"),
    (["--pipeline-schedule", "zb-v"], 1, "zb-v places two model chunks per rank in a V over the pipeline"),
    (["--pp", "2", "--vpp", "4", "--num-layers", "8", "--pipeline-schedule", "zb-v"], 2,
     "zb-v runs two model chunks per rank, but --vpp is 4"),
    (["--pp", "2", "--pipeline-schedule", "zb-v", "--pipeline-layers", "2,2"], 2,
     "--pipeline-layers lists 2 stages but the layout has 4"),
    (["--pp", "2", "--pipeline-schedule", "zb-v", "--pipeline-pass-costs", "1,1"], 2,
     "--pipeline-pass-costs '1,1' must be three positive numbers"),
    (["--pp", "2", "--pipeline-schedule", "zb-v", "--num-layers-per-virtual-pipeline-stage", "1"], 2,
     "zb-v places two model chunks per rank itself: drop --num-layers-per-virtual-pipeline-stage"),
    (["--pp", "2", "--pipeline-schedule", "dualpipev", "--global-batch-size", "6", "--micro-batch-size", "2"], 2,
     "dualpipev needs at least 2 x --pp = 4 micro-batches per step (3 = --global-batch-size 6"),
    (["--pp", "2", "--pipeline-schedule", "dualpipev", "--torch-compile"], 2,
     "--pipeline-schedule dualpipev splits each backward"),
])
def test_bad_pipeline_layouts_are_refused_with_one_clear_message(argv, world, message):
    from megalite.arguments import model_config, validate
    from megalite.runtime import UsageError

    with pytest.raises(UsageError) as err:
        args = parse(argv)
        validate(args, world, model_config(args))
    assert message in str(err.value)


def test_timeline_has_a_row_per_rank_with_every_kind_of_span(tmp_path):
    path = tmp_path / "trace.json"
    argv = ["--train-iters", "3", "--seq-length", "16", "--pp", "2", "--timeline", str(path), "--timeline-iters", "2"]
    run_ranks(train_losses, 4, args=(argv,))
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    # the exchanges' posting ("p2p") apart from their waits ("p2p-wait"), and the wait for the
    # gradient norm's reduction, where the stages meet at the step's end ("norm-wait")
    assert {e["cat"] for e in spans} == {"forward", "backward", "p2p", "p2p-wait", "grad-reduce", "optimizer",
                                         "norm-wait"}
    m = 16 // (2 * 2)  # global batch 16, micro-batch 2, dp 2
    for rank in range(4):
        names = [e["name"] for e in spans if e["pid"] == rank and e["args"]["iteration"] == 0]
        assert sorted(n for n in names if n.startswith("F")) == sorted(f"F c0 mb{i}" for i in range(m))
        assert names.count("wait for the gradient norm") == 1 and names.count("send/recv") >= m
        optimizer = next(e for e in spans if e["pid"] == rank and e["args"]["iteration"] == 0 and e["cat"] == "optimizer")
        norm = next(e for e in spans if e["pid"] == rank and e["args"]["iteration"] == 0 and e["cat"] == "norm-wait")
        assert optimizer["ts"] <= norm["ts"] and norm["ts"] + norm["dur"] <= optimizer["ts"] + optimizer["dur"]
        # every rank waits for a send at the step's end (this 1F1B's last batch), never while posting
        waits = [e for e in spans if e["pid"] == rank and e["args"]["iteration"] == 0 and e["cat"] == "p2p-wait"]
        assert "wait for a send" in {e["name"] for e in waits}
    labels = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert labels[2] == "rank 2 (pp 1, dp 0, tp 0)"


@pytest.mark.parametrize("p,m,v", [(2, 1, None), (4, 2, None), (4, 8, None), (4, 16, None), (2, 4, 2), (4, 8, 2),
                                   (4, 4, 2), (4, 8, 3), (3, 9, 3)])
def test_programs_reach_the_theoretical_bubble(p, m, v):
    from megalite.pipeline.schedules import simulate, theoretical_bubble

    idle = simulate(p, m, v).idle
    assert idle == pytest.approx(theoretical_bubble(p, m, v), abs=1e-9)


# (F, B, W): the papers' equal costs, others with W <= min(F, B) (the paper's formula), and W above F or B
COSTS = [(1, 1, 1), (2, 2, 1), (1, 2, 1), (2, 3, 2), (3, 3, 2), (1, 1, 2), (1, 3, 2), (3, 1, 2), (1, 1, 3)]


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_every_stage_idles_exactly_the_papers_bubble(kind, p):
    """1F1B (p-1)(F+B+W), ZB-H1 (p-1)(F+B-W) of idle time on every stage (ZB-H1: while W <=
    min(F, B); (p-1) max(F+B-W, F, B) in general), for m in {p, 2p, 4p}."""
    from megalite.pipeline.schedules import bubble_fraction, bubble_time, simulate

    for m in (p, 2 * p, 4 * p):
        for f, b, w in COSTS:
            t = simulate(p, m, None, kind, f, b, w)
            assert t.idle_time == [bubble_time(kind, p, m, f, b, w)] * p, (m, f, b, w, t.rows)
            if kind == "zb-h1" and w <= min(f, b):
                assert t.idle_time[0] == (p - 1) * (f + b - w)  # the paper's formula
            assert t.idle == pytest.approx(bubble_fraction(kind, p, m, f, b, w), abs=1e-12)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_v_idles_only_the_start_of_the_v(p):
    """ZB-V at F = B = W (the papers' case; also at W = 2F, 3F): each stage idles (p-1) chunk forwards,
    (p-1) F/2 of a whole stage's F, the floor (the last rank's first forward waits for the p-1 before
    it, and every rank has the same work), for m in {p, 2p, 4p}: a sixth of 1F1B's, half of ZB-H1's.
    At other costs (the program ordered for them) it stays below 1F1B's."""
    from megalite.pipeline.schedules import bubble_fraction, bubble_time, simulate

    for m in (p, 2 * p, 4 * p):
        for f, b, w in [(1, 1, 1), (2, 2, 2), (3, 3, 3), (1, 1, 2), (1, 1, 3)]:
            t = simulate(p, m, None, "zb-v", f, b, w)  # a chunk's costs; a stage's are twice
            assert t.idle_time == [bubble_time("zb-v", p, m, 2 * f, 2 * b, 2 * w)] * p == [(p - 1) * f] * p, \
                (m, f, b, w, t.rows)
            assert t.idle == pytest.approx(bubble_fraction("zb-v", p, m, 2 * f, 2 * b, 2 * w), abs=1e-12)
        assert simulate(p, m, None, "zb-v").idle_time[0] * 6 == simulate(p, m, None, "1f1b", 2, 2, 2).idle_time[0]
        for f, b, w in COSTS:
            assert max(simulate(p, m, None, "zb-v", f, b, w).idle_time) < \
                simulate(p, m, None, "1f1b", 2 * f, 2 * b, 2 * w).idle_time[0], (m, f, b, w)


def test_zb_v_orders_exist_for_any_pass_costs_and_keep_nccl_order():
    """Where the 2p cap would stop every rank (at pp 2, B well above F and a small W), a forward of
    the second chunk goes past it: every cost set gets an order, which the replay accepts."""
    from megalite.pipeline.replay import check_schedule
    from megalite.pipeline.schedules import build_program, exchange_plans, peak_in_flight

    costs = [(1, b, w) for b in (0.25, 0.5, 1, 1.25, 1.5, 2, 3) for w in (0.2, 0.25, 0.5, 1, 2)]
    for p in (2, 3, 4):
        for m in range(1, 4 * p + 1):
            for c in costs:
                exchange_plans(p, m, None, "zb-v", c)  # raises on a wrong match or a deadlock
                peaks = [peak_in_flight(build_program(p, r, m, None, "zb-v", c)) for r in range(p)]
                assert max(peaks) <= 2 * p + 1, (p, m, c, peaks)
    assert exchange_plans(2, 8, None, "zb-v", (1, 2, 0.25))  # the case that stopped every rank
    assert check_schedule(8, 32, None, "zb-v") == 32 * (2 * 8 - 2) * 2


@pytest.mark.parametrize("p", [2, 4, 8])
def test_dualpipev_idles_the_published_bubble(p):
    """DualPipeV (DualPipe's README: (PP/2-1)(F&B+B-3W), here with p ranks of two chunks, B a whole
    backward and the pair F&B run one pass after the other) on every stage at equal costs, for m in
    {2p, 4p} (it needs m >= 2p; m = p is refused); no more while W <= min(F, B); 2p+1 chunks in flight
    on every rank (the README's PP+1)."""
    from megalite.pipeline.schedules import bubble_time, build_program, peak_in_flight, simulate

    for m in (2 * p, 4 * p):
        for c in (1, 2, 3):
            t = simulate(p, m, None, "dualpipev", c, c, c)
            want = (p - 1) * ((c + c + c) + (c + c) - 3 * c)  # a chunk's F&B + B + W - 3W
            assert t.idle_time == [bubble_time("dualpipev", p, m, 2 * c, 2 * c, 2 * c)] * p == [want] * p, t.rows
        for f, b, w in COSTS:
            if w <= min(f, b):
                assert max(simulate(p, m, None, "dualpipev", f, b, w).idle_time) <= \
                    bubble_time("dualpipev", p, m, 2 * f, 2 * b, 2 * w), (m, f, b, w)
        assert [peak_in_flight(build_program(p, r, m, None, "dualpipev")) for r in range(p)] == [2 * p + 1] * p
    with pytest.raises(ValueError, match="dualpipev schedule needs at least 2 x pp"):
        build_program(p, 0, 2 * p - 1, None, "dualpipev")


def test_zb_v_keeps_1f1bs_activations_on_every_rank():
    """At most 2p chunks (p micro-batches of a whole stage) forwarded and not yet through W, on
    every rank: 1F1B's first-stage peak, which 1F1B's other stages stay below."""
    from megalite.pipeline.schedules import build_program, peak_in_flight

    for p in (2, 3, 4, 8):
        for m in (1, p - 1, p, 2 * p + 1, 4 * p):
            if m:
                assert [peak_in_flight(build_program(p, r, m, None, "zb-v")) for r in range(p)] == \
                    [2 * min(p, m)] * p, (p, m)


def test_zb_h1_idles_a_third_of_1f1b_at_equal_costs():
    from megalite.pipeline.schedules import simulate

    assert simulate(4, 8, None, "zb-h1").idle_time == [3] * 4  # (p-1)(F+B-W)
    assert simulate(4, 8, None, "1f1b").idle_time == [9] * 4  # (p-1)(F+B+W)


def _residual_step(model, batch):
    """Like _toy_step, but the output comes from an add, which autograd does not save."""
    x = batch["x"] if model.input_tensor is None else model.input_tensor
    y = x + torch.tanh(model.lin(x))
    return y.sum() if model.post_process else y


def live_activations(rank, world, m, v, free, kind="1f1b"):
    """Train one step of toy stages; before each forward, count the bytes of this rank's earlier
    outputs whose storage is still alive (held by anyone: the executor, autograd, a send)."""
    import weakref

    parallel.initialize_model_parallel(1, world)
    chunks = [_Stage(last=c * world + rank == world * (v or 1) - 1) for c in range(v or 1)]
    outputs = []  # (weak reference to the storage, bytes) of every output made here
    peak = 0

    def step(model, batch):
        nonlocal peak
        peak = max(peak, sum(n for ref, n in outputs if ref() is not None))
        out = _residual_step(model, batch)
        if out.dim():
            outputs.append((weakref.ref(out.untyped_storage()), out.untyped_storage().nbytes()))
        return out

    batches = [{"x": torch.full((2, 3, 4), float(i))} for i in range(m)]
    stats = run_schedule(build_program(world, rank, m, v, kind), chunks, batches, step, torch.tensor(1.0), (2, 3, 4),
                         torch.float32, free_sent_outputs=free)
    return peak, stats.peak_stash_bytes, [c.lin.weight.grad.clone() for c in chunks], stats.loss_sum


@pytest.mark.parametrize("p,m,v", [(4, 8, None), (2, 4, 2)], ids=["1f1b", "interleaved"])
def test_sent_activations_are_freed_and_gradients_stay_bitwise_equal(p, m, v):
    kept = run_ranks(live_activations, p, args=(m, v, False))
    freed = run_ranks(live_activations, p, args=(m, v, True))
    activation = 2 * 3 * 4 * 4  # bytes of one (2, 3, 4) fp32 output
    # Without freeing, stage 0 holds the outputs of every micro-batch in flight (1F1B: p - 1 before
    # its p-th forward); freed, only those whose sends may still be draining survive (a batch's
    # sends are waited for SENDS_IN_FLIGHT exchange points later), and the last stage sends none.
    if v is None:
        assert kept[0][0] == (p - 1) * activation and SENDS_IN_FLIGHT < p - 1
    assert all(peak > 0 for peak, *_ in kept[:-1])
    assert all(peak <= SENDS_IN_FLIGHT * activation for peak, *_ in freed) and (v is not None or freed[-1][0] == 0)
    for (_, held_kept, grads_kept, loss_kept), (_, held_freed, grads_freed, loss_freed) in zip(kept, freed):
        assert held_freed <= held_kept
        assert all(torch.equal(a, b) for a, b in zip(grads_kept, grads_freed)), "freeing must not change gradients"
        assert torch.equal(loss_kept, loss_freed)
    assert freed[0][1] < kept[0][1], "the executor's own count of held bytes must fall too"


def test_zb_h1_holds_a_sent_activation_for_sends_in_flight_exchange_intervals_at_most():
    """ZB-H1 waits for a receive only where a pass reads it and for a batch's sends SENDS_IN_FLIGHT
    exchange points later: at most that many sent outputs per stage survive into the next forward;
    the numbers equal 1F1B's."""
    p, m = 4, 8
    freed = run_ranks(live_activations, p, args=(m, None, True, "zb-h1"))
    one_f_one_b = run_ranks(live_activations, p, args=(m, None, True))
    activation = 2 * 3 * 4 * 4
    assert all(peak <= SENDS_IN_FLIGHT * activation for peak, *_ in freed)
    for (_, _, grads, loss), (_, _, grads_1f1b, loss_1f1b) in zip(freed, one_f_one_b):
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_1f1b)) and torch.equal(loss, loss_1f1b)
