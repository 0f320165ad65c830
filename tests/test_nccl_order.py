"""Pipeline exchanges under NCCL's rules (no tags, per-pair FIFO matching, blocking batches): every
schedule's receives get the message meant for them and no rank waits forever; the replay catches
programs that break the rules; the executor posts exactly the plan the replay checks."""
import pytest
import torch

from megalite import parallel
from megalite.pipeline import p2p
from megalite.pipeline.replay import (Exchange, Message, ScheduleError, check_nccl_order, check_schedule, exchange_plan,
                                      posts_receives_early)
from megalite.pipeline.partition import stage_rank, virtual_stage
from megalite.pipeline.schedules import build_program, exchange_plans, is_v_shaped, run_schedule
from megalite.testing import run_ranks


def _cases():
    for p in range(2, 9):
        for v in (None, 2, 3, 4):
            # Below, at and above p; the interleaved schedule needs multiples of p.
            ms = (p, 2 * p, 3 * p) if v else (1, p - 1, p, p + 1, 2 * p + 1)
            kinds = ("1f1b", "forward-only") if v else ("1f1b", "gpipe", "forward-only", "zb-h1", "zb-v",
                                                         "forward-only-v", "dualpipev")
            for m in sorted(set(ms) | ({4 * p} if not v else set())):
                for kind in kinds:
                    if kind != "dualpipev" or m >= 2 * p:  # it needs 2p micro-batches
                        yield p, m, v, kind


def test_every_schedule_matches_each_receive_to_its_send_under_nccl_order():
    checked = 0
    for p, m, v, kind in _cases():
        messages = check_schedule(p, m, v, kind)
        # Each micro-batch crosses every boundary between consecutive virtual stages once per
        # direction (forward-only: activations only); in a V one boundary is inside rank p-1.
        boundaries = 2 * p - 2 if kind.endswith("-v") or kind == "dualpipev" else p * (v or 1) - 1
        assert messages == m * boundaries * (1 if kind.startswith("forward-only") else 2), (p, m, v, kind)
        checked += 1
    assert checked > 300
    assert check_schedule(1, 4) == 0  # no pipelining: nothing to exchange


def test_replay_refuses_receives_posted_in_another_order_than_the_sends():
    a, b = Message("F", 0, 1, 0), Message("F", 0, 1, 1)
    plans = [[Exchange(0, [a, b], [])], [Exchange(0, [], [b, a])]]
    with pytest.raises(ScheduleError, match="expects .*micro_batch=1.* but gets .*micro_batch=0"):
        check_nccl_order(plans, 2)


def test_replay_refuses_a_forward_and_a_backward_crossing_in_the_wrong_order_on_one_pair():
    # pp=2: rank 0 sends rank 1 both activations (vs 0 -> 1) and gradients (vs 2 -> 1); tags
    # would tell them apart under gloo, NCCL goes by order only.
    act, grad = Message("F", 0, 1, 1), Message("B", 2, 1, 0)
    plans = [[Exchange(0, [act], []), Exchange(1, [grad], [])], [Exchange(0, [], [grad, act])]]
    with pytest.raises(ScheduleError, match="expects"):
        check_nccl_order(plans, 2)


def test_replay_refuses_ranks_that_wait_on_each_other():
    to_1, to_0 = Message("F", 0, 1, 0), Message("B", 1, 0, 0)
    plans = [[Exchange(0, [], [to_0]), Exchange(1, [to_1], [])],
             [Exchange(0, [], [to_1]), Exchange(1, [to_0], [])]]
    with pytest.raises(ScheduleError, match="deadlock"):
        check_nccl_order(plans, 2)


class _Stage(torch.nn.Module):
    def __init__(self, last):
        super().__init__()
        self.lin, self.post_process, self.input_tensor = torch.nn.Linear(4, 4), last, None

    def set_input_tensor(self, t):
        self.input_tensor = t


def _step(model, batch):
    x = batch["x"] if model.input_tensor is None else model.input_tensor
    y = x + torch.tanh(model.lin(x))
    return y.sum() if model.post_process else y


def posted_exchanges(rank, world, m, v, kind="1f1b", extra_warmup=0):
    """What run_schedule hands to p2p.exchange, next to the plan the replay checks."""
    parallel.initialize_model_parallel(1, world)
    posted = []
    real_exchange = p2p.exchange

    def recording(sends, recvs, *rest, **kwargs):
        posted.append(([s.peer for s in sends], [(r.key, r.peer) for r in recvs]))
        return real_exchange(sends, recvs, *rest, **kwargs)

    p2p.exchange = recording
    v_shape = is_v_shaped(kind)
    chunks = [_Stage(last=virtual_stage(world, rank, c, v_shape) == world * v - 1) for c in range(v)]
    batches = [{"x": torch.full((2, 3, 4), float(i))} for i in range(m)]
    program = build_program(world, rank, m, v if v > 1 else None, kind, extra_warmup=extra_warmup)
    plan = exchange_plans(world, m, v if v > 1 else None, kind, extra_warmup=extra_warmup)[rank]
    early = posts_receives_early(world, v, kind)  # as TrainStep.exchange_plan hands it over
    with torch.set_grad_enabled(not kind.startswith("forward-only")):  # evaluation keeps nothing for backward
        run_schedule(program, chunks, batches, _step, torch.tensor(1.0), (2, 3, 4), torch.float32, v_shape=v_shape,
                     plan=plan if early else None)
    planned = [([stage_rank(world, s.dst, v_shape) for s in x.sends], [(r, stage_rank(world, r.src, v_shape))
                                                                      for r in x.recvs])
               for x in plan if x.sends or x.recvs]
    if not early:  # what the executor derives from the program alone
        assert list(plan) == exchange_plan(program, world, rank, v)
    return posted, planned


@pytest.mark.parametrize("world,m,v,kind,extra", [
    (2, 4, 2, "1f1b", 0), (3, 2, 1, "1f1b", 0), (3, 5, 1, "1f1b", 1), (3, 5, 1, "zb-h1", 0), (3, 5, 1, "zb-h1", 1),
    (3, 7, 2, "zb-v", 0), (2, 3, 2, "forward-only-v", 0), (3, 7, 2, "dualpipev", 0), (2, 3, 1, "forward-only", 0)],
    ids=["interleaved-pp2", "1f1b-pp3-m-below-p", "1f1b-pp3-one-forward-ahead", "zb-h1-pp3", "zb-h1-pp3-ahead",
         "zb-v-pp3", "forward-only-v-pp2", "dualpipev-pp3", "forward-only-pp2"])
def test_executor_posts_exactly_the_plan_the_replay_checks(world, m, v, kind, extra):
    for posted, planned in run_ranks(posted_exchanges, world, args=(m, v, kind, extra)):
        assert posted == planned


def test_one_chunk_programs_post_their_receives_before_the_pass_before_the_one_that_reads_them():
    # 1F1B at pp 2, one forward ahead: stage 1 posts micro-batch 1's activation before its first
    # backward, not after it (gloo moves a message's bytes once the receive is posted), and stage 0
    # each gradient but the first before the forward that precedes its backward
    stage1 = exchange_plans(2, 4, None, "1f1b", extra_warmup=1)[1]
    assert [(x.index, [(m.kind, m.micro_batch) for m in x.recvs]) for x in stage1][:3] == \
        [(0, [("F", 0)]), (2, [("F", 1)]), (4, [("F", 2)])]
    late = exchange_plan(build_program(2, 1, 4, extra_warmup=1), 2, 1, 1)
    assert [(x.index, [(m.kind, m.micro_batch) for m in x.recvs]) for x in late][:3] == \
        [(0, [("F", 0)]), (2, []), (4, [("F", 1)])]
    stage0 = exchange_plans(2, 4, None, "1f1b", extra_warmup=1)[0]  # X F0 X F1 X F2 X B0 X F3 X B1 X B2 X B3 X
    assert [(x.index, [(m.kind, m.micro_batch) for m in x.recvs]) for x in stage0 if x.recvs] == \
        [(6, [("B", 0)]), (8, [("B", 1)]), (12, [("B", 2)]), (14, [("B", 3)])]
    assert not posts_receives_early(2, 2, "1f1b") and not posts_receives_early(2, 1, "1f1b", paired=True)
    assert posts_receives_early(2, 1, "zb-h1") and not posts_receives_early(1, 1, "1f1b")
