"""The planner's per-exchange latency and its exposed communication per dimension
(megalite.tools.plan.exposed): exchange counts and exposed seconds of hand-computed cases, the
pipeline played with transfers, the calibration the slow-links suite uses, and the CLI's section."""
from dataclasses import replace

import pytest

from megalite.models import preset
from megalite.tools import plan as P
from megalite.tools.plan.calibrate import MeasuredLink, Reference, predicted_link_cost
from megalite.tools.plan.exposed import dp_exchanges, format_exposed, pair_items, pass_counts
from megalite.tools.plan.ring_items import ring_pair_items
from megalite.tools.plan.pair_play import alone_exposed, pair_exposed, played_pair
from megalite.pipeline.programs import Op, build_program
from megalite.tools.plan.pipeline_play import exposed_transfers, played_step, receives_posted
from megalite.tools.plan.tp_linears import linear_shares

TINY = preset("gpt-tiny")  # 4 layers, hidden 128, 4 heads, vocabulary 1024
LAT = 1e-3  # 1 ms a exchange
BW = 1e9  # bytes/s: every group across nodes
# one GPU a node: every group spans the 1 GB/s link; 1 TFLOP/s sustained
SLOW = P.Cluster(gpus=2, gpus_per_node=1, inter_node_gbps=1, peak_tflops=1, efficiency=1, collective_latency_ms=1)


def _predict(layout, gbs, seq=64, **run):
    return P.predict(TINY, layout, SLOW, run=P.Run(gbs, seq, "fp32", 200_000, **run))


def test_a_pipeline_step_played_with_transfers_exposes_those_on_its_path():
    # 1F1B, pp 2, 4 micro-batches, forward 1, backward 2: (m + p - 1) x 3 without transfers
    assert played_step(2, 4, None, "1f1b", 1.0, 2.0, 0.0, 0.0) == 15.0
    # each transfer 0.1: the first activation and gradient (the fill), one round trip for every
    # two micro-batches of the steady state, and the last activation, whose receive rank 1 posts only
    # after its backward before (a message moves once its receive is posted: receives_posted):
    # 5 transfers, not the 8 messages sent
    assert exposed_transfers(2, 4, None, "1f1b", 1.0, 2.0, 0.0, 0.1) == pytest.approx(0.5)
    # transfers as long as a pass: rank 1 waits for every activation
    assert exposed_transfers(2, 4, None, "1f1b", 1.0, 2.0, 0.0, 1.0) == pytest.approx(5.0)
    assert exposed_transfers(1, 4, None, "1f1b", 1.0, 2.0, 0.0, 1.0) == 0.0
    # the V's two chunks meet on rank p-1 at no cost: of its 16 messages between the ranks, 9 lie on the path
    v = exposed_transfers(2, 4, 2, "zb-v", 0.5, 0.5, 0.5, 0.1)
    assert v == pytest.approx(0.9)


def test_a_message_moves_only_once_its_receive_is_posted():
    # gloo moves a message's bytes only to a posted receive: the executor's plan posts rank 1's
    # activations of micro-batches 2 and 3 at its exchange point before their forwards, so where rank
    # 0 is faster (forward 1, backward 2 against 2 and 4) each waits out its whole transfer there
    # however early it was sent: the fill's activation, the drain's gradient, and those two
    posted = receives_posted(2, 4, None, "1f1b")
    assert posted[("F", 0, 2)] == 8 and build_program(2, 1, 4)[9] == Op("F", 0, 2)
    assert posted[("F", 0, 1)] == 2  # (micro-batch 1's, after the first forward: ahead of its read)
    assert exposed_transfers(2, 4, None, "1f1b", [1.0, 2.0], [2.0, 4.0], [0.0, 0.0], 0.5) == pytest.approx(2.0)


def test_a_ranks_messages_leave_one_at_a_time_in_the_order_it_made_them():
    # pp 3, 3 micro-batches, f = b = 1, a transfer of 2: rank 0 runs its forwards back to back, and
    # each activation leaves once the one before has arrived: 23 against 10 with free transfers
    # (22 if every message left as its pass ended)
    assert played_step(3, 3, None, "1f1b", 1.0, 1.0, 0.0, 2.0) == pytest.approx(23.0)
    assert exposed_transfers(3, 3, None, "1f1b", 1.0, 1.0, 0.0, 2.0) == pytest.approx(13.0)
    # at pp 2 the receive holds it later still: F1's activation would leave at 4, once F0's has
    # arrived, but rank 1 posts its receive after its F0 [4, 5], so it arrives at 8. Played: rank 1
    # F1 [8, 9] B1 [9, 10] (arrives at 13); rank 0 B0 [9, 10], B1 [13, 14]: 14 against 6
    assert played_step(2, 2, None, "1f1b", 1.0, 1.0, 0.0, 3.0) == pytest.approx(14.0)
    assert exposed_transfers(2, 2, None, "1f1b", 1.0, 1.0, 0.0, 3.0) == pytest.approx(8.0)
    # transfers shorter than the passes between a rank's sends never queue
    assert exposed_transfers(2, 2, None, "1f1b", 1.0, 1.0, 0.0, 0.5) == pytest.approx(1.0)


def test_a_slower_last_stage_gives_the_others_slack_that_hides_the_steady_states_transfers():
    # the last stage also runs the output layer: per micro-batch 3 more than rank 0's 3, which
    # covers a round trip of 2 x 0.5, so of the round trips only the fill's activation and the
    # drain's gradient lie on the path, with the activations rank 1 receives where it reads them
    # (test_a_message_moves_only_once_its_receive_is_posted); with one forward ahead, the fill and
    # the drain alone
    assert exposed_transfers(2, 4, None, "1f1b", [1.0, 2.0], [2.0, 4.0], [0.0, 0.0], 0.5) == pytest.approx(2.0)
    assert exposed_transfers(2, 4, None, "1f1b", [1.0, 2.0], [2.0, 4.0], [0.0, 0.0], 0.5,
                             extra_warmup=1) == pytest.approx(1.0)
    # the same stages with a uniform pipeline's costs (the slowest everywhere): a round trip per two
    assert exposed_transfers(2, 4, None, "1f1b", 2.0, 4.0, 0.0, 0.5) == pytest.approx(2.5)
    # one cost a virtual stage, or the play refuses
    with pytest.raises(ValueError, match="virtual stages"):
        played_step(2, 4, None, "1f1b", [1.0], [2.0], [0.0], 0.0)


def _tp_layer(rest, gemms):
    """One layer's exposed TP exchanges, each behind its own linear's shard GEMM (gemms: QKV, output,
    fc1, fc2): forward all four; backward the row linears', and the column linears' beside their
    weight GEMM (2 shard GEMMs at tp 2). `rest(g)`: what an exchange behind g leaves."""
    return (sum(max(0.0, rest(g)) for g in gemms) + sum(max(0.0, rest(g)) for g in gemms[1::2])
            + sum(max(0.0, rest(g) - 2 * g) for g in gemms[0::2]))


def test_tp_exchanges_are_sps_gathers_and_scatters_each_with_its_latency():
    layout = P.Layout(tp=2, dp=1, micro_batch_size=8, sequence_parallel=True)
    pred = _predict(layout, 16)  # 2 micro-batches
    costs = pred.costs
    # per micro-batch 4 layers x 4 collectives + embedding + output layer = 18, each a gather and a scatter
    x = pred.exposed["tp"]
    assert x.exchanges == 2 * 18 * 2
    full = 64 * 8 * 128 * 4  # s x b x h fp32
    assert x.bytes == 2 * 18 * full  # each collective: 2 (t-1)/t of it
    assert costs.ar_time == pytest.approx(2 * LAT + full / BW)
    assert x.comm == x.exposed == pytest.approx(36 * (2 * LAT + full / BW))  # nothing overlapped
    assert pred.time.tp_comm == pytest.approx(x.exposed)
    # --tp-comm-overlap: a layer exchange is one ring step of half the tensor, behind half a linear's
    # GEMM; of the 32 a micro-batch, the 8 column layers' backward reduce-scatters (QKV and fc1) also
    # behind the layer's weight GEMM (2 shard GEMMs)
    # Each exchange is behind its own linear's GEMM: QKV 3/12 of the layer's projections, the output
    # 1/12, each MLP projection 4/12 (tp_linears.linear_shares), not behind the average linear
    over = _predict(layout, 16, tp_comm_overlap=True)
    assert linear_shares(pred.config) == pytest.approx((3 / 12, 1 / 12, 4 / 12, 4 / 12))
    gemms = [share * (costs.fwd - costs.core) / 4 / 1e12 for share in linear_shares(pred.config)]
    step = LAT + full / 2 / BW
    edges = 2 * (2 * LAT + full / BW)

    def layer(rest):
        return _tp_layer(rest, gemms)
    want = 2 * (4 * layer(lambda g: step - g) + edges)
    assert over.exposed["tp"].exposed == pytest.approx(want) and over.time.tp_comm == pytest.approx(want)
    assert over.exposed["tp"].exposed < x.exposed and "--tp-comm-overlap" in over.command()
    # --tp-comm-overlap-splits 4: each half travels and is multiplied in 4 pieces (4 latencies), the
    # remote half's GEMMs beside its transfer's tail: max(0, T + G/4 - 2G) a layer exchange
    split = _predict(layout, 16, tp_comm_overlap=True, tp_comm_overlap_splits=4)
    step4 = 4 * LAT + full / 2 / BW
    want4 = 2 * (4 * layer(lambda g: step4 + g / 4 - 2 * g) + edges)
    assert split.exposed["tp"].exposed == pytest.approx(want4)
    assert split.exposed["tp"].exchanges == 2 * (16 * 2 * 4 + 2 * 2)
    assert "--tp-comm-overlap --tp-comm-overlap-splits 4" in split.command()


def test_tp_pieces_hide_a_shard_transfer_behind_up_to_both_shard_gemms():
    # tp 2, no latency, a shard transfer T and a shard GEMM G. One piece: T - G exposed; k pieces:
    # T + G/k - 2G (the column layers' backward reduce-scatters 2G less: their weight GEMMs)
    fast = P.Cluster(gpus=2, gpus_per_node=1, inter_node_gbps=1, peak_tflops=1, efficiency=1, collective_latency_ms=0)
    layout = P.Layout(tp=2, dp=1, micro_batch_size=8, sequence_parallel=True)

    def exposed(k):
        run = P.Run(16, 64, "fp32", 200_000, tp_comm_overlap=True, tp_comm_overlap_splits=k)
        return P.predict(TINY, layout, fast, run=run)
    one, four = exposed(1), exposed(4)
    costs = one.costs
    g, t = (costs.fwd - costs.core) / 16 / 1e12, 64 * 8 * 128 * 4 / 2 / 1e9
    gemms = [4 * share * g for share in linear_shares(TINY)]  # each linear's shard GEMM (g: their mean)
    edge = 2 * 2 * costs.ar_time  # the embedding's and output layer's collectives, not pipelined
    assert t > 3 * max(gemms)  # every exchange exposes something
    assert one.exposed["tp"].exposed - edge == pytest.approx(2 * 4 * _tp_layer(lambda x: t - x, gemms))
    assert four.exposed["tp"].exposed - edge == pytest.approx(2 * 4 * _tp_layer(lambda x: t + x / 4 - 2 * x, gemms))
    assert four.exposed["tp"].exposed < one.exposed["tp"].exposed
    # a zero-bubble schedule defers the weight GEMMs to W passes: no such cover
    pp2 = dict(tp=2, pp=2, dp=1, micro_batch_size=8, sequence_parallel=True)
    zb, plain = (P.predict(TINY, P.Layout(**pp2, schedule=s), replace(fast, gpus=4),
                           run=P.Run(16, 64, "fp32", 200_000, tp_comm_overlap=True)).exposed["tp"].exposed
                 for s in ("zb-h1", "1f1b"))
    assert zb > plain


def test_cp_ring_steps_hide_behind_one_attention_block_each():
    pred = _predict(P.Layout(cp=2, micro_batch_size=4), 4, seq=256)
    costs, x = pred.costs, pred.exposed["cp"]
    # 4 layers: one forward step (a K/V transfer), one backward step (K/V, then dK/dV) (cp - 1 each)
    assert x.exchanges == 4 * (1 + 2)
    fwd, bwd = costs.ring_step_bytes
    assert fwd == 2 * 4 * 4 * 128 * 32 * 4 and bwd == 2 * fwd  # K/V of 4 heads x 32 dims, 128 tokens; + dK/dV
    block = 4 * 4 * 256 * 256 * 128 / 4 / 1e12  # the attention core over cp^2 blocks
    # each transfer behind one block (backward: one block's backward, half of it the own block's halves)
    want = 4 * (2 * max(0, LAT + fwd / BW - block) + max(0, LAT + (bwd - fwd) / BW - block))
    assert x.exposed == pytest.approx(want) and pred.time.cp_comm == pytest.approx(want)
    assert x.comm == pytest.approx(4 * (3 * LAT + (fwd + bwd) / BW))


def test_cp_blocks_take_their_flops_at_the_attention_speeds():
    # the attention core at half the layer's average rate forward, 0.8 backward: each block takes
    # 2x (1.25x) its FLOPs' time; the layer's compute is unchanged (the core takes more of it)
    layout, seq = P.Layout(cp=2, micro_batch_size=4), 256
    slow_core = replace(SLOW, attention_speed=0.5, attention_backward_speed=0.8)
    pred = P.predict(TINY, layout, slow_core, run=P.Run(4, seq, "fp32", 200_000))
    base = _predict(layout, 4, seq=seq)
    fwd, bwd = pred.costs.ring_step_bytes
    block = 4 * 4 * 256 * 256 * 128 / 4 / 1e12
    want = 4 * (max(0, LAT + fwd / BW - block / 0.5) + max(0, LAT + fwd / BW - block / 0.8)
                + max(0, LAT + (bwd - fwd) / BW - block / 0.8))
    assert pred.exposed["cp"].exposed == pytest.approx(want)
    assert pred.exposed["cp"].exposed < base.exposed["cp"].exposed
    assert pred.time.compute == base.time.compute
    assert "(0.067 ms forward, 0.042 backward)" in pred.exposed["cp"].behind  # 0.0336 ms / 0.5, / 0.8
    # in pairs: the backward's pieces at their own speed, the rest of the layer shorter by as much
    paired = P.predict(TINY, P.Layout(cp=2, micro_batch_size=1), slow_core,
                       run=P.Run(4, seq, "fp32", 200_000, overlap_moe_ep_comm=True))
    stage, f_step = paired.stages[paired.slow_stage], LAT + fwd / 4 / BW
    forward, backward = ring_pair_items(paired.costs, stage, (block / 4 / 0.5, block / 4 / 0.8), f_step,
                                        (f_step, LAT + (bwd - fwd) / 4 / BW))
    assert backward[1][0] == pytest.approx(block / 4 / 0.8)
    assert sum(c for c, _ in forward + backward) == pytest.approx(stage.compute_mb)
    with pytest.raises(ValueError, match="attention_backward_speed"):
        replace(SLOW, attention_backward_speed=0.0)


def test_cp_ring_in_pairs_also_hides_behind_the_other_pass():
    layout = P.Layout(cp=2, micro_batch_size=1)
    alone = _predict(layout, 4, seq=256)
    paired = _predict(layout, 4, seq=256, overlap_moe_ep_comm=True)
    costs, stage = paired.costs, paired.stages[paired.slow_stage]
    fwd, bwd = costs.ring_step_bytes
    block = 1 * 4 * 256 * 256 * 128 / 4 / 1e12
    f_left, kv_left, dkv_left = (max(0.0, LAT + b / BW - block) for b in (fwd, fwd, bwd - fwd))
    forward, backward = ring_pair_items(costs, stage, (block, block), LAT + fwd / BW,
                                        (LAT + fwd / BW, LAT + (bwd - fwd) / BW))
    # per layer: one forward transfer, the K/V and dK/dV backward; each item the compute up to its
    # block's end, then what of its transfer is left
    assert [x for _, x in forward] == pytest.approx([f_left] * 4 + [0.0])
    assert [x for _, x in backward] == pytest.approx([kv_left, dkv_left] * 4 + [0.0])
    assert backward[1][0] == pytest.approx(block)
    assert sum(c for c, _ in forward + backward) == pytest.approx(stage.compute_mb)
    # 4 micro-batches: 3 pairs, the first forward and the last backward alone (what they leave exposed)
    want = alone_exposed(forward) + alone_exposed(backward) + 3 * pair_exposed(forward, backward)
    assert alone_exposed(forward) + alone_exposed(backward) == pytest.approx(alone.exposed["cp"].exposed / 4)
    x = paired.exposed["cp"]
    assert x.exposed == pytest.approx(want) and paired.time.cp_comm == pytest.approx(want)
    # by phase (what the suite holds against the ranks' waits by phase)
    assert x.phases == pytest.approx({"forwards alone": alone_exposed(forward),
                                      "pairs": 3 * pair_exposed(forward, backward),
                                      "backwards alone": alone_exposed(backward)})
    assert alone.exposed["cp"].phases == {}  # no paired program: no phases
    assert 0 < x.exposed < alone.exposed["cp"].exposed and x.comm == alone.exposed["cp"].comm
    assert "other pass" in x.behind


def test_ep_dispatch_is_exposed_unless_the_overlap_option_pairs_it_with_a_backward():
    moe = TINY.replace(num_moe_experts=8, moe_router_topk=2)
    layout = P.Layout(dp=2, micro_batch_size=8, ep=2, etp=1)
    run = P.Run(32, 64, "fp32", 200_000)  # 2 micro-batches a rank
    pred = P.predict(moe, layout, SLOW, run=run)
    costs, x = pred.costs, pred.exposed["ep"]
    # a MoE layer and micro-batch: dispatch + combine forward and backward, the counts' all-gather
    assert costs.ep_exchanges == 5 and x.exchanges == 2 * 4 * 5
    sent = 4 * (2 * 64 * 8) * 128 * 4 / 2  # 4 all-to-alls of half the k x T rows
    assert costs.ep_time == pytest.approx(5 * LAT + sent / BW)
    assert x.exposed == x.comm == pytest.approx(2 * 4 * costs.ep_time)
    paired = P.predict(moe, layout, SLOW, run=P.Run(32, 64, "fp32", 200_000, overlap_moe_ep_comm=True))
    stage = paired.stages[paired.slow_stage]
    forward, backward = pair_items(paired.costs, stage)
    # per layer: the counts (latency only, run in place), the dispatch, the combine forward; two
    # exchanges backward
    assert forward[0][2] is False and all(len(item) == 2 for item in forward[1:3] + backward)
    assert [item[1] for item in forward[:3]] == pytest.approx([LAT, LAT + sent / 4 / BW, LAT + sent / 4 / BW])
    assert len([1 for item in forward if item[1]]) == 4 * 3 and len([1 for item in backward if item[1]]) == 4 * 2
    # every item's compute together is one micro-batch's on the stage; every exchange one micro-batch's
    compute_f, compute_b = (sum(item[0] for item in lane) for lane in (forward, backward))
    assert compute_f + compute_b == pytest.approx(stage.compute_mb) and compute_b == pytest.approx(2 * compute_f)
    assert sum(item[1] for item in forward + backward) == pytest.approx(4 * costs.ep_time)
    # 2 micro-batches: the first forward and the last backward alone, one pair between
    want = 4 * costs.ep_time + pair_exposed(forward, backward)
    assert paired.exposed["ep"].exposed == pytest.approx(want) and paired.time.ep_comm == pytest.approx(want)
    assert 4 * costs.ep_time < paired.exposed["ep"].exposed < x.exposed
    # by phase: each lone pass's exchanges all exposed (no bucket on this link), the pair as played
    lone_f, lone_b = (sum(item[1] for item in lane) for lane in (forward, backward))
    assert paired.exposed["ep"].phases == pytest.approx({"forwards alone": lone_f, "backwards alone": lone_b,
                                                         "pairs": pair_exposed(forward, backward)})


def test_the_pairs_and_lone_passes_come_from_the_ranks_paired_program():
    moe = TINY.replace(num_moe_experts=8, moe_router_topk=2)
    run = P.Run(32, 64, "fp32", 200_000, overlap_moe_ep_comm=True)

    four = P.Cluster(gpus=4, gpus_per_node=1, inter_node_gbps=1, peak_tflops=1, efficiency=1, collective_latency_ms=1)

    def counts(layout, rank):
        return pass_counts(P.predict(moe, layout, four if layout.pp > 1 else SLOW, run=run).costs, rank)

    # pp 1, 4 micro-batches: 3 pairs, the first forward and the last backward alone
    assert counts(P.Layout(dp=2, micro_batch_size=4, ep=2, etp=1), 0) == (3, 1, 1)
    # 1F1B at pp 2 x dp 2 (8 micro-batches): p - r warm-up forwards, as many lone backwards
    assert counts(P.Layout(pp=2, dp=2, micro_batch_size=2, ep=2, etp=1), 0) == (6, 2, 2)
    assert counts(P.Layout(pp=2, dp=2, micro_batch_size=2, ep=2, etp=1), 1) == (7, 1, 1)
    # DualPipeV's own pairs, two chunks a pass each; ZB-V has none (everything exposed)
    dual = counts(P.Layout(pp=2, dp=2, micro_batch_size=2, ep=2, etp=1, schedule="dualpipev"), 0)
    assert dual[0] > 0 and dual[0] + dual[1] == dual[0] + dual[2] == 2 * 8
    zbv = P.Layout(pp=2, dp=2, micro_batch_size=2, ep=2, etp=1, schedule="zb-v")
    assert counts(zbv, 0) is None
    x = P.predict(moe, zbv, four, run=run).exposed["ep"]
    assert x.exposed == x.comm


def test_a_pair_hides_each_exchange_behind_the_other_lanes_next_compute_only():
    # the forward computes 1 then exchanges 3; the backward computes 2 (hiding 2 of the 3), its
    # exchange of 1 launched when the forward's is done; the forward computes 1 (hiding it)
    assert played_pair([(1.0, 3.0), (1.0, 0.0)], [(2.0, 1.0)]) == pytest.approx(1 + 3 + 1 + 0)
    assert pair_exposed([(1.0, 3.0), (1.0, 0.0)], [(2.0, 1.0)]) == pytest.approx(1.0)
    # compute longer than every exchange: all hidden but the backward's last (nothing after it)
    assert pair_exposed([(5.0, 1.0), (5.0, 0.0)], [(5.0, 1.0), (5.0, 0.0)]) == pytest.approx(0.0)
    assert pair_exposed([(5.0, 1.0), (5.0, 0.0)], [(5.0, 1.0)]) == pytest.approx(0.0)
    # two exchanges back to back on one lane (nothing computed between): the second waits for the
    # first, so the other lane's compute hides only one of them
    assert pair_exposed([(0.0, 2.0), (0.0, 2.0), (0.0, 0.0)], [(2.0, 0.0)]) == pytest.approx(2.0)
    # an exchange run in place (the counts): the lane keeps the turn and waits for it
    assert played_pair([(1.0, 2.0, False), (0.0, 3.0)], [(4.0, 0.0)]) == pytest.approx(1 + 2 + 4)
    # ... also when it costs nothing (no latency): the turn is kept all the same
    assert played_pair([(1.0, 0.0, False), (0.0, 2.0)], [(3.0, 0.0)]) == pytest.approx(1 + 3)
    # compute with no exchange after it keeps the turn too (a lane hands over only at an exchange or its end)
    assert played_pair([(1.0, 0.0), (1.0, 2.0)], [(3.0, 0.0)]) == pytest.approx(1 + 1 + 3)
    # a lane alone: every exchange exposed
    assert alone_exposed([(1.0, 2.0), (3.0, 4.0)]) == 6.0


def test_pp_exposes_the_transfers_on_the_schedules_path():
    pred = _predict(P.Layout(pp=2, micro_batch_size=4), 16)  # 4 micro-batches
    costs, x = pred.costs, pred.exposed["pp"]
    msg = 64 * 4 * 128 * 4
    assert x.exchanges == 8 and x.bytes == 8 * msg
    assert x.comm == pytest.approx(8 * (LAT + msg / BW)) and pred.time.pp_comm == pytest.approx(x.comm)
    # each stage at its own passes: rank 0's layers (stage_result's compute_mb), rank 1's with the output layer
    first, last = pred.stages[0].compute_mb, pred.stages[1].compute_mb
    assert last > first and pred.slow_stage == 1
    f = [c * costs.fwd / (costs.fwd + costs.bwd) for c in (first, last)]
    assert x.exposed == pytest.approx(exposed_transfers(2, 4, None, "1f1b", f, [first - f[0], last - f[1]], [0.0, 0.0],
                                                        LAT + msg / BW))
    assert x.exposed < exposed_transfers(2, 4, None, "1f1b", f[1], last - f[1], 0.0, LAT + msg / BW)
    # the tied embedding, summed over its two stages after the schedule: exposed, on the dp row
    assert pred.exposed["dp"].exchanges == 1 and pred.exposed["dp"].exposed == pytest.approx(LAT + 1024 * 128 * 4 / BW)


def test_dp_exchanges_per_zero_stage_and_each_bucket_pays_the_latency():
    base = _predict(P.Layout(dp=2, micro_batch_size=8), 16)
    n = sum(1 for chunk in base.stages[0].state.buckets for b in chunk)
    assert n > 1 and dp_exchanges(base) == n == base.exposed["dp"].exchanges
    assert dp_exchanges(_predict(P.Layout(dp=2, micro_batch_size=8, zero_stage=1), 16)) == 2 * n
    z2 = _predict(P.Layout(dp=2, micro_batch_size=4, zero_stage=2), 16)  # 2 micro-batches
    assert dp_exchanges(z2) == 2 * n + n
    z3 = _predict(P.Layout(dp=2, micro_batch_size=4, zero_stage=3), 16)
    units = sum(1 for chunk in z3.stages[0].state.buckets for b in chunk)
    assert dp_exchanges(z3) == units * 3 * 2  # per micro-batch: gather, gather again, reduce-scatter
    # context parallelism's ranks reduce the gradients too (dp x cp): exposed, not 0
    cp = _predict(P.Layout(cp=2, micro_batch_size=4), 4, seq=256)
    assert cp.exposed["dp"].comm > 0 and cp.dp_parts[0].overlapped > 0


def test_the_calibration_is_zero_on_equal_links_and_fits_the_bare_step():
    layout, run = P.Layout(tp=1, dp=2, micro_batch_size=8), P.Run(16, 64, "fp32", 200_000)
    link, bare = MeasuredLink(35.8e6, 3.8e-3), MeasuredLink(1e9, 1e-4)
    got = predicted_link_cost(TINY, layout, run, link, bare, 0.0729)
    assert got["dimensions"]["dp"]["exchanges"] >= 1 and got["exposed_ms"] > 0
    assert got["compute_ms"] + got["dimensions"]["dp"]["exposed_bare_ms"] == pytest.approx(72.9, rel=0.02)
    assert predicted_link_cost(TINY, layout, run, bare, bare, 0.0729)["exposed_ms"] == pytest.approx(0.0)


def test_measured_attention_blocks_set_the_speeds_at_the_fitted_rate():
    # cp 2 on the slow link: blocks measured at 2x (forward) and 1.5x (backward) their FLOPs' time at
    # the fitted rate hide more of each ring transfer; the fitted rate and the compute are unchanged
    layout, run = P.Layout(cp=2, micro_batch_size=1), P.Run(4, 2048, "fp32", 200_000, overlap_moe_ep_comm=True)
    link, bare = MeasuredLink(35.8e6, 3.8e-3), MeasuredLink(1e9, 1e-4)
    flops = predicted_link_cost(TINY, layout, run, link, bare, 1.0)
    block = 4 * 2048 * 2048 * 128 / 4 / (flops["tflops"] * 1e12)  # the attention core over cp^2 blocks
    got = predicted_link_cost(TINY, layout, run, link, bare, 1.0, attention_block_s=(2 * block, 1.5 * block))
    assert got["attention_speed"] == pytest.approx([0.5, 1 / 1.5])
    phases = got["dimensions"]["cp"]["phases_ms"]  # across less bare, by phase: they add up
    assert set(phases) == {"forwards alone", "pairs", "backwards alone"}
    cp = got["dimensions"]["cp"]
    assert sum(phases.values()) == pytest.approx(cp["exposed_across_ms"] - cp["exposed_bare_ms"])
    assert got["tflops"] == flops["tflops"] and got["compute_ms"] == flops["compute_ms"]
    assert got["dimensions"]["cp"]["exposed_across_ms"] < flops["dimensions"]["cp"]["exposed_across_ms"]
    assert "attention_speed" not in flops
    # no ring: the blocks change nothing
    dp = P.Layout(dp=2, micro_batch_size=8)
    assert "attention_speed" not in predicted_link_cost(TINY, dp, P.Run(16, 64, "fp32", 200_000), link, bare, 0.07,
                                                        attention_block_s=(1.0, 1.0))


def test_a_reference_run_fits_the_compute_and_the_exchanges_own_cost_covers_no_transfer():
    # dp 2 with a one-rank reference of a rank's work: the bare step's 30 ms beyond it (gloo's
    # reductions on the rank's own core) is no compute, so less of the reduction is covered
    layout, run = P.Layout(tp=1, dp=2, micro_batch_size=8), P.Run(16, 64, "fp32", 200_000)
    link, bare = MeasuredLink(35.8e6, 3.8e-3), MeasuredLink(1e9, 1e-4)
    ref = Reference(P.Layout(tp=1, dp=1, micro_batch_size=8), P.Run(8, 64, "fp32", 200_000), 0.0729, bare)
    fitted = predicted_link_cost(TINY, layout, run, link, bare, 0.1029)
    got = predicted_link_cost(TINY, layout, run, link, bare, 0.1029, ref)
    assert got["compute_ms"] == pytest.approx(72.9, rel=1e-3)  # one rank: no link exposes anything
    assert got["own_ms"] == pytest.approx(102.9 - 72.9 - got["dimensions"]["dp"]["exposed_bare_ms"])
    assert got["exposed_ms"] > fitted["exposed_ms"] and "own_ms" not in fitted
    # a reference that is the bare run itself fits as the bare run does
    same = Reference(layout, run, 0.1029, bare)
    assert predicted_link_cost(TINY, layout, run, link, bare, 0.1029, same)["tflops"] == pytest.approx(fitted["tflops"])
    # tp in four pieces a shard, fitted to its one-piece run: the pieces' cost is not GEMM time
    tp = P.Layout(tp=2, micro_batch_size=8, sequence_parallel=True)
    one, four = (P.Run(16, 64, "fp32", 200_000, tp_comm_overlap=True, tp_comm_overlap_splits=k) for k in (1, 4))
    at_one = predicted_link_cost(TINY, tp, four, link, bare, 0.2, Reference(tp, one, 0.15, bare))
    assert at_one["own_ms"] == pytest.approx(50, rel=0.05)
    assert at_one["exposed_ms"] > predicted_link_cost(TINY, tp, four, link, bare, 0.2)["exposed_ms"]


def test_cli_takes_the_attention_speeds(capsys):
    # --attention-speed / --attention-backward-speed: the ring's blocks at half and 0.8 of the
    # layer's average rate, twice and 1.25x as long: more of each transfer hidden
    argv = ["--model", "gpt-tiny", "--gpus", "2", "--gpus-per-node", "1", "--global-batch-size", "4", "--seq-length",
            "2048", "--cp", "2", "--micro-batch-size", "1", "--tp", "1", "--collective-latency-ms", "3.8",
            "--inter-node-gbps", "0.0358", "--peak-tflops", "0.05", "--efficiency", "1"]
    rows = []
    for extra in ([], ["--attention-speed", "0.5", "--attention-backward-speed", "0.8"]):
        assert P.main(argv + extra) == 0
        rows.append(next(line for line in capsys.readouterr().out.splitlines() if "attention block" in line))
    assert "(10.737 ms forward, 10.737 backward)" in rows[0] and "(21.475 ms forward, 13.422 backward)" in rows[1]
    assert float(rows[1].split()[4]) < float(rows[0].split()[4])  # exposed ms


def test_cli_prints_the_exposed_section(capsys):
    assert P.main(["--model", "gpt-tiny", "--gpus", "2", "--gpus-per-node", "1", "--max-tp", "2",
                   "--global-batch-size", "16", "--seq-length", "64", "--tp", "2", "--sequence-parallel", "on",
                   "--tp-comm-overlap", "--micro-batch-size", "8", "--zero-stage", "0", "--recompute", "none",
                   "--collective-latency-ms", "3.8", "--inter-node-gbps", "0.0358"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("exposed communication per step"):].splitlines()
    assert "each exchange 3.8 ms" in section[0] and section[1].split()[:3] == ["dim", "exchanges", "MB"]
    assert section[2].split()[:2] == ["tp", "72"] and "shard GEMM" in section[2]
    assert section[3].startswith("  all")
    assert "--tp-comm-overlap" in out[:out.index("exposed communication")]
    pred = P.predict(TINY, P.Layout(dp=2, micro_batch_size=8), SLOW, 16, 64)
    assert "dp" in format_exposed(pred) and set(pred.to_dict()["exposed_comm"]) == {"dp"}


def test_the_overlapped_parameter_gather_exposes_only_what_arrives_after_its_layer_begins():
    layout = P.Layout(dp=2, micro_batch_size=8, zero_stage=1)
    after, overlapped = _predict(layout, 16), _predict(layout, 16, overlap_param_gather=True)
    state = after.stages[0].state
    buckets = [b for chunk in state.buckets for b in chunk]
    # after the update: every bucket's gather, each with its latency (fp32: 4 bytes, half the elements sent)
    whole = sum(LAT + (b.end - b.start) * 4 / 2 / BW for b in buckets)
    assert after.dp_parts[0].all_gather == pytest.approx(whole)
    # overlapped: the embeddings' bucket (posted first) is read before the first layer; each later
    # one is late by what its arrival exceeds the forward's progress to the first layer that holds
    # any of its parameters, the largest lateness what the forward waits in all
    forward = 4 * after.costs.fwd / after.costs.rate
    arrived, late = 0.0, 0.0
    for b, at in reversed(list(zip(buckets, state.bucket_needed[0]))):
        arrived += LAT + (b.end - b.start) * 4 / 2 / BW
        late = max(late, arrived - forward * at)
    assert overlapped.dp_parts[0].all_gather == pytest.approx(late) and 0 < late < whole
    assert late >= LAT + (buckets[-1].end - buckets[-1].start) * 2 / BW  # at least the embeddings' bucket
    assert overlapped.exposed["dp"].exposed == pytest.approx(after.exposed["dp"].exposed - whole + late)
    assert "parameter gathers" in overlapped.exposed["dp"].behind
    # pp 2: each stage's gathers (the last stage's tied copy among them) hide behind its forward
    four = replace(SLOW, gpus=4)
    pp = [P.predict(TINY, P.Layout(pp=2, dp=2, micro_batch_size=4, zero_stage=1), four,
                    run=P.Run(16, 64, "fp32", 200_000, overlap_param_gather=o)) for o in (False, True)]
    for stage in (0, 1):
        assert 0 < pp[1].dp_parts[stage].all_gather < pp[0].dp_parts[stage].all_gather
    from megalite.tools.plan.command import launch_command  # the printed command carries the flag
    assert "--overlap-param-gather" in launch_command(overlapped)
    assert "--overlap-param-gather" not in launch_command(after)


def test_the_ep_bound_is_the_best_order_of_a_pairs_items():
    from megalite.tools.plan.ep_bound import alone_phase_bound, ep_bound_of, ep_step_bound, pair_bound
    from megalite.tools.plan.pair_play import played_pair

    forward = [(2.0, 5.0), (6.0, 5.0)]  # compute 8, link 10: its chain 18
    backward = [(4.0, 5.0), (11.0, 5.0)]  # compute 15, link 10: its chain 25
    # The CPU 23, the link 20, the chains 18 and 25 allow 2 beyond the compute, but no order gets there:
    # the backward's chain runs uninterrupted only if the forward's 6 fits in its one 5-second gap.
    # The best order exposes 6, which megalite's lanes also reach.
    assert pair_bound(forward, backward) == 6.0 == played_pair(forward, backward) - 23.0
    assert pair_bound([(10.0, 1.0)], [(10.0, 1.0)]) == 1.0  # compute-bound: only the last exchange sticks out
    assert pair_bound([(1.0, 10.0)], [(1.0, 10.0)]) == 19.0  # link-bound: the link's 20 after the first compute
    # Where the turn rules cost something: the forward's second compute fits inside the backward's
    # 4-second one split in two (the lanes run an item to its exchange): 10 against the lanes' 11.
    short, long = [(1.0, 2.0), (1.0, 2.0)], [(1.0, 2.0), (4.0, 2.0)]
    assert pair_bound(short, long) == 3.0 and played_pair(short, long) == 11.0
    # alone: its own exchanges, or the link's bytes with the reduction's if longer
    assert alone_phase_bound(backward, 0.0) == 10.0 and alone_phase_bound(backward, 30.0) == 25.0
    got = ep_step_bound(3, forward, backward, 30.0, 0.0)
    assert got == {"pairs": 18.0, "first_forward": 10.0, "last_backward": 25.0, "exposed": 53.0}
    # a run's: pp 1 with pairs at stage 0 or 1; none for other layouts
    moe = preset("moe-tiny")
    run = P.Run(16, 64, "fp32", 200_000, overlap_moe_ep_comm=True)
    pred = P.predict(moe, P.Layout(dp=2, ep=2, micro_batch_size=2), SLOW, run=run)
    bound = ep_bound_of(pred)
    assert bound["exposed"] == pytest.approx(bound["pairs"] + bound["first_forward"] + bound["last_backward"])
    assert 0 < bound["exposed"] <= pred.exposed["ep"].exposed + pred.exposed["dp"].exposed
    assert ep_bound_of(P.predict(moe, P.Layout(dp=2, ep=2, micro_batch_size=2), SLOW,
                                 run=P.Run(16, 64, "fp32", 200_000))) is None  # no pairs
    after = ep_bound_of(P.predict(moe, P.Layout(dp=2, ep=2, micro_batch_size=2, zero_stage=1), SLOW, run=run))
    assert after["after_update"] > 0  # the distributed optimizer's gathers, with nothing beside them


def test_a_bucket_is_needed_when_the_forward_reaches_the_first_layer_holding_any_of_it():
    from megalite.optim.bucket_plan import BucketLayout
    from megalite.tools.plan.overlap import needed_fractions

    # parameters in definition order: an embedding, two layers of 30 and 10 elements (two params
    # each), a final norm; buckets in backward order (the layout's)
    numels, layer_of = [5, 20, 10, 6, 4, 2], [None, 0, 0, 1, 1, None]
    bucket = lambda *members: BucketLayout(members, (), 0, 0, False)  # noqa: E731
    buckets = [bucket(5, 4), bucket(3, 2), bucket(1, 0)]
    # the norm is needed after the layers, but its bucket holds layer 1's second weight: at layer 1's start
    # (3/4 of the forward); layer 0's second and layer 1's first: at layer 0's start; the embedding's: at 0
    assert needed_fractions(buckets, numels, layer_of) == [0.75, 0.0, 0.0]
    assert needed_fractions([bucket(5)], numels, layer_of) == [1.0]
    # with the layers' parts (each its own module, waited for as it begins): layer 0's second weight
    # is in its second part, which starts after the first's 20 elements (half the forward's 40)
    parts = [None, 0, 1, 0, 1, None]
    assert needed_fractions(buckets, numels, layer_of, parts) == [0.75 + 0.15, 0.5, 0.0]


def test_a_pass_alone_in_groups_hides_each_groups_exchange_behind_the_next_groups_experts():
    from megalite.tools.plan.chunk_play import chunked_alone_exposed, pass_ops, played_alone
    from megalite.tools.plan.exposed import EpParts

    # the FIFO queue by hand: two posts, each launched when the one before it is waited for
    ops = [("post", "a", 2.0), ("post", "b", 2.0), ("wait", "a"), ("compute", 3.0), ("wait", "b")]
    assert played_alone(ops) == 5.0  # a's 2, then b's 2 beside the 3 of compute
    assert played_alone([("compute", 1.0), ("in place", 2.0), ("compute", 1.0)]) == 4.0
    # a layer: attention 1, counts 0.5 in place, two exchanges of 4 (latency 0.5) each way, experts 4
    e = EpParts(1, 0.5, 4.0, 1, 1.0, 4.0, 2.0, 8.0, 1, 1)
    assert chunked_alone_exposed(e, 1, "F") == 0.5 + 4.0 + 4.0  # whole: every exchange waited for
    # 2 groups: each exchange 0.5 + 1.75 = 2.25; the first group's rows, then its experts (2) beside the
    # second group's rows (2.25), then the second's experts (2) beside the first's outputs (2.25), then
    # the second's outputs: 0.5 + 2.25 + 0.25 + 0.25 + 2.25 exposed
    assert chunked_alone_exposed(e, 2, "F") == pytest.approx(5.5)
    # backward: the outputs' gradients of group 1 then 0; group 1's experts (4) beside group 0's
    # gradients (2.25), group 0's experts (4) beside group 1's rows' (2.25), then group 0's rows'
    assert chunked_alone_exposed(e, 2, "B") == pytest.approx(2.25 + 2.25)
    assert [op[0] for op in pass_ops(e, 2, "B")][:3] == ["post", "post", "wait"]


def test_the_planner_predicts_groups_where_the_dispatcher_makes_them():
    from megalite.tools.plan.command import launch_command
    from megalite.tools.plan.exposed import dispatch_groups

    moe = preset("moe-tiny")
    layout = P.Layout(dp=2, ep=2, micro_batch_size=2)
    narrow = P.Cluster(gpus=2, gpus_per_node=1, inter_node_gbps=0.1, peak_tflops=0.01, efficiency=1,
                       collective_latency_ms=0.05)  # bytes, not latency, decide each exchange; compute as long
    whole = P.predict(moe, layout, narrow, run=P.Run(16, 64, "fp32", 200_000))
    grouped = P.predict(moe, layout, narrow, run=P.Run(16, 64, "fp32", 200_000, moe_dispatch_chunks=2))
    assert dispatch_groups(grouped.costs) == 2 and dispatch_groups(whole.costs) == 1
    a, b = whole.exposed["ep"], grouped.exposed["ep"]
    assert b.bytes == a.bytes and b.exchanges > a.exchanges and b.comm > a.comm  # more latencies
    assert b.exposed < 0.8 * a.exposed and a.exposed == a.comm  # whole: every exchange waited for
    # where each exchange is mostly latency (1 ms), the groups' extra latencies cost more than they hide
    assert (P.predict(moe, layout, SLOW, run=replace(grouped.run, moe_dispatch_chunks=2)).exposed["ep"].exposed
            > P.predict(moe, layout, SLOW, run=whole.run).exposed["ep"].exposed)
    assert "--moe-dispatch-chunks 2" in launch_command(grouped) and "chunks" not in launch_command(whole)
    # more groups than local experts: the dispatcher makes one group an expert
    many = P.predict(moe, layout, narrow, run=P.Run(16, 64, "fp32", 200_000, moe_dispatch_chunks=64))
    assert dispatch_groups(many.costs) == moe.num_moe_experts // 2
    # with pairs only the forwards alone go in groups
    paired = P.Run(16, 64, "fp32", 200_000, overlap_moe_ep_comm=True)
    p1 = P.predict(moe, layout, narrow, run=paired).exposed["ep"]
    p2 = P.predict(moe, layout, narrow, run=replace(paired, moe_dispatch_chunks=2)).exposed["ep"]
    assert p2.exposed < p1.exposed and p2.exchanges > p1.exchanges


def test_a_backwards_weight_gradients_lent_to_the_waits_fill_them_piece_by_piece():
    from megalite.tools.plan.pair_play import alone_played

    # alone: the backward computes 2 (1 of it W, lent in two pieces of 0.5), exchanges 3 (filled by
    # both pieces: 2 of the 3 exposed), computes 4 (2 lent: run when it ends)
    assert alone_played([(2.0, 3.0), (4.0, 0.0)], wgrad=0.5) == pytest.approx(1 + 3 + 2 + 2)
    assert alone_exposed([(2.0, 3.0), (4.0, 0.0)], wgrad=0.5) == pytest.approx(2.0)
    assert alone_exposed([(2.0, 3.0), (4.0, 0.0)]) == 3.0
    # a piece begun runs to its end, past the exchange: 1 piece of 2 against an exchange of 1
    assert alone_played([(8.0, 1.0)], wgrad=0.5) == pytest.approx(4 + 2 + 2)
    # the counts' exchange (in place) is waited for at once: nothing fills it
    assert alone_played([(2.0, 3.0, False)], wgrad=0.5) == pytest.approx(1 + 3 + 1)
    # a pair. Without: F 0-1, its exchange 1-3; B 1-5, its exchange 5-7; F 5-6, its exchange queued
    # behind B's (7-9); B waits (idle 6-7), 7-8, ends; F waits (idle 8-9), 9-10. With half of B's
    # compute lent: B 1-3 (two pieces of 1 lent), exchange 3-5; F 3-4, its exchange queued (5-7); B
    # waits for its own filling a piece 4-5, 5-5.5 and its W left (1.5) 5.5-7; F 7-8
    forward, backward = [(1.0, 2.0), (1.0, 2.0), (1.0, 0.0)], [(4.0, 2.0), (1.0, 0.0)]
    assert played_pair(forward, backward) == played_pair(forward, backward, 0.0) == pytest.approx(10.0)
    assert played_pair(forward, backward, 0.5) == pytest.approx(8.0)
    assert pair_exposed(forward, backward, 0.5) == pytest.approx(0.0)


def test_the_planner_plays_delayed_weight_gradients_where_megalite_runs_them():
    from megalite.tools.plan.command import launch_command
    from megalite.tools.plan.ep_bound import pair_bound
    from megalite.tools.plan.exposed import wgrad_share

    moe = preset("moe-tiny")
    layout = P.Layout(dp=2, ep=2, micro_batch_size=2)
    narrow = P.Cluster(gpus=2, gpus_per_node=1, inter_node_gbps=0.1, peak_tflops=0.01, efficiency=1,
                       collective_latency_ms=0.05)  # compute about as long as the exchanges
    for paired in (False, True):
        run = P.Run(16, 64, "fp32", 200_000, overlap_moe_ep_comm=paired)
        plain = P.predict(moe, layout, narrow, run=run)
        delayed = P.predict(moe, layout, narrow, run=replace(run, delay_wgrad_compute=True))
        assert wgrad_share(plain.costs) == 0 and 0.3 < wgrad_share(delayed.costs) <= 0.5
        a, b = plain.exposed["ep"], delayed.exposed["ep"]
        assert b.comm == a.comm and 0 < b.exposed < a.exposed, (paired, a.exposed, b.exposed)
        assert "--delay-wgrad-compute" in launch_command(delayed) and "wgrad" not in launch_command(plain)
    # refused at ZeRO-2: nothing lent, nothing printed
    zero2 = P.predict(moe, replace(layout, zero_stage=2, distributed_optimizer=True), narrow,
                      run=P.Run(16, 64, "fp32", 200_000, delay_wgrad_compute=True))
    assert wgrad_share(zero2.costs) == 0 and "--delay-wgrad-compute" not in launch_command(zero2)
    # the pair's bound once W may run anywhere: no more than with W in place, never below zero
    forward, backward = pair_items(delayed.costs, delayed.stages[0])
    share = wgrad_share(delayed.costs)
    assert 0 <= pair_bound(forward, backward, share) <= pair_bound(forward, backward)
