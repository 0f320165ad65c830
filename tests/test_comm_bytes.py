"""megalite counts the bytes every collective it calls sends (megalite.parallel.traffic), and the
count of one training step equals the analytical volume of the layout, term by term, computed here
from the model's shape (docs/communication.md names every term above the textbook minimum)."""
import json
from fractions import Fraction

import pytest

from megalite import parallel
from megalite.parallel import traffic
from megalite.parallel.layers import pad_vocab_size
from megalite.testing import run_ranks

from training_ranks import gpt_run

# gpt-tiny: L layers, hidden h, HEADS heads, ffn 4h, vocab V (padded to 128 tp), P learned positions; all fp32.
L, H, HEADS, VOCAB, POSITIONS = 4, 128, 4, 1024, 128
SEQ, MICRO, GLOBAL = 32, 1, 4
E = 4  # bytes of an fp32 element: model, gradients and the loss statistics alike
BASE = ["--seq-length", str(SEQ), "--micro-batch-size", str(MICRO), "--global-batch-size", str(GLOBAL),
        "--train-iters", "2", "--log-interval", "1", "--eval-iters", "0"]


def step_traffic(rank, world, argv):
    """This rank's records' comm_bytes, its place in the layout, and its buffers' sizes."""
    run = gpt_run(argv)
    params = [p for c in run.model_chunks for p in c.parameters()]
    return {"comm": [r["comm_bytes"] for r in run.records],
            "stage": parallel.get_pipeline_model_parallel_rank(),
            "param_numel": sum(p.numel() for p in params), "params": len(params),
            "buffer_numel": sum(b.numel for b in run.buffers), "buckets": sum(len(b.buckets) for b in run.buffers)}


def ring(n: int) -> Fraction:
    """(n-1)/n: the share of a tensor one rank sends in a ring all-gather or reduce-scatter."""
    return Fraction(n - 1, n)


def stage_params(tp: int, first: bool, last: bool, layers: int, pp: int, h: int = H) -> int:
    """Parameters one rank holds (GPT-2 shape: biases, LayerNorm, tied embeddings, ffn 4h)."""
    vocab, ffn = pad_vocab_size(VOCAB, tp), 4 * h
    layer = (2 * h  # input LayerNorm
             + (3 * h * h + 3 * h) // tp + h * h // tp + h  # qkv (column), projection (row) and its whole bias
             + 2 * h  # MLP LayerNorm
             + (ffn * h + ffn) // tp + ffn * h // tp + h)  # fc1 (column), fc2 (row) and its whole bias
    n = layers * layer
    if first:
        n += vocab * h // tp + POSITIONS * h
    if last:
        n += 2 * h + (vocab * h // tp if pp > 1 else 0)  # final norm; a last stage's copy of the tied embedding
    return n


def expected(tp, pp, dp, sp, dist_opt, stage, exits_counted, cp=1, cp_comm="p2p") -> dict[str, Fraction]:
    """Bytes one rank of pipeline stage `stage` sends in one step, by kind."""
    first, last, layers = stage == 0, stage == pp - 1, L // pp
    m = GLOBAL // (MICRO * dp)  # micro-batches per step
    act = MICRO * SEQ // cp * H * E  # A = b s h: one micro-batch's hidden states (this CP rank's share)
    tokens = MICRO * SEQ // cp
    out = {k: Fraction(0) for k in traffic.KINDS}
    if cp > 1:  # every layer's attention, each micro-batch
        if cp_comm == "p2p":  # K and V blocks around the ring, forward and again backward; dK, dV (fp32) back
            block = 2 * MICRO * HEADS * (SEQ // cp) * (H // HEADS)
            out["cp"] += m * layers * (cp - 1) * block * (E + E + 4)
        else:  # all-to-all of q, k, v and the output, forward and backward
            out["cp"] += m * layers * 8 * ring(cp) * act
    if tp > 1:
        r = ring(tp)
        per_micro = {"tp": Fraction(0), "sp": Fraction(0)}
        act_kind = "sp" if sp else "tp"
        # Each layer: attention and MLP each an all-reduce forward (row-parallel output) and one
        # backward (the gradient of the column-parallel input): 4 all-reduces of A, or with sequence
        # parallelism 4 all-gathers + 4 reduce-scatters of A, the same bytes.
        per_micro[act_kind] += layers * 4 * 2 * r * act
        if first:  # the vocab-parallel embedding: all-reduce forward (reduce-scatter + all-gather backward)
            per_micro[act_kind] += 2 * r * act
            if sp:  # the position embedding's gradient gathered along the sequence (above the minimum)
                per_micro["sp"] += r * act
        if last:
            per_micro[act_kind] += 2 * r * act  # the output layer: all-reduce backward (all-gather + r-s)
            per_micro["tp"] += 2 * r * (tokens * E) + 2 * r * (2 * tokens * E)  # cross-entropy: max, then two sums
        out["tp"] += m * per_micro["tp"]
        out["sp"] += m * per_micro["sp"]
        if sp:  # once a step: the gradients of norms and row biases, partial over the sequence, summed over TP
            partial = layers * (2 * 2 * H + 2 * H) + (2 * H if last else 0)
            out["sp"] += 2 * r * partial * E
    if pp > 1:  # each micro-batch's activation forward (but from the last stage), its gradient back (but the first)
        message = MICRO * (SEQ // tp if sp else SEQ) * H * E
        out["pp"] += m * message * ((not last) + (not first))
    dp_cp = dp * cp  # gradients are reduced, token counts and losses summed, over DP x CP
    if dp_cp > 1:  # gpt-tiny's parameters are all multiples of 64 elements: no bucket padding
        grads = stage_params(tp, first, last, layers, pp) * E
        if dist_opt:  # reduce-scatter of the fp32 gradients, all-gather of the (fp32) parameters
            out["dp"] += ring(dp_cp) * grads * 2
        else:
            out["dp"] += 2 * ring(dp_cp) * grads
    if pp > 1 and (first or last):  # the tied embedding's gradient summed over the first and last stage
        out["embedding"] += 2 * ring(2) * pad_vocab_size(VOCAB, tp) * H // tp * E
    world = tp * pp * dp_cp
    metrics = 2 * ring(dp_cp) * E  # the global token count
    if world > 1:  # grad norm: over DP (distributed optimizer's shards), then over TP x PP
        metrics += (2 * ring(dp_cp) * E if dist_opt else 0) + 2 * ring(tp * pp) * E
    metrics += 2 * ring(dp_cp) * E  # the log line: the loss over DP
    if pp > 1:  # ... the bubble over PP, the loss broadcast from the last stage
        metrics += 2 * ring(pp) * E + ring(pp) * 2 * E
    if exits_counted:  # the exit flags of the iteration before (three fp32 over every rank)
        metrics += 2 * ring(world) * 3 * E
    out["metrics"] = metrics
    return {k: v for k, v in out.items() if v}


LAYOUTS = [  # (tp, pp, dp, sequence parallel, distributed optimizer)
    (2, 1, 1, False, False), (2, 1, 1, True, False), (1, 2, 1, False, False), (1, 1, 2, False, False),
    (1, 1, 2, False, True), (2, 2, 2, False, False), (2, 2, 2, True, True),
]


@pytest.mark.parametrize("tp,pp,dp,sp,dist_opt", LAYOUTS)
def test_counted_bytes_equal_the_formula(tp, pp, dp, sp, dist_opt):
    argv = BASE + ["--tp", str(tp), "--pp", str(pp)] + (["--sequence-parallel"] if sp else []) + \
        (["--use-distributed-optimizer"] if dist_opt else [])
    world = tp * pp * dp
    results = run_ranks(step_traffic, world, args=(argv,), timeout=600)
    for rank, res in enumerate(results):
        first, last = res["stage"] == 0, res["stage"] == pp - 1
        assert res["param_numel"] == res["buffer_numel"] == stage_params(tp, first, last, L // pp, pp), rank
        for step, comm in enumerate(res["comm"]):
            want = expected(tp, pp, dp, sp, dist_opt, res["stage"], exits_counted=step > 0)
            assert comm == {k: round(v) for k, v in want.items()}, f"rank {rank} (stage {res['stage']}) step {step + 1}"


@pytest.mark.parametrize("cp_comm", ["p2p", "a2a"])
def test_context_parallel_bytes_equal_the_formula(cp_comm):
    argv = BASE + ["--cp", "2", "--cp-comm-type", cp_comm]
    for rank, res in enumerate(run_ranks(step_traffic, 2, args=(argv,), timeout=300)):
        for step, comm in enumerate(res["comm"]):
            want = expected(1, 1, 1, False, False, 0, step > 0, cp=2, cp_comm=cp_comm)
            assert comm == {k: round(v) for k, v in want.items()}, f"rank {rank} step {step + 1}"


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_bytes_equal_the_formula(stage):
    """ZeRO-2 reduce-scatters every micro-batch's gradients (it holds no whole gradient between them)
    and all-gathers the parameters after the update; ZeRO-3 instead gathers every unit for each
    micro-batch's forward and again for its backward, except what a turn keeps whole: a backward
    finds its forward's last layer and the rest (embeddings, final norm), the next forward the
    backward's first layer and the rest."""
    for res in run_ranks(step_traffic, 2, args=(BASE + ["--zero-stage", str(stage)],), timeout=300):
        m, grads = GLOBAL // (MICRO * 2), stage_params(1, True, True, L, 1) * E
        layer = stage_params(1, False, False, 1, 1) * E
        rest = grads - L * layer
        gathers = ring(2) * grads if stage == 2 else ring(2) * (2 * m * grads - (2 * m - 1) * (rest + layer))
        assert res["comm"][0]["dp"] == round(m * ring(2) * grads + gathers)


def test_dp_bytes_above_the_minimum_are_the_bucket_padding():
    """With a hidden size of 96 parameters are not multiples of 64 elements: each starts aligned, each
    bucket ends on a multiple of 64 dp, and that padding (and nothing else) is reduced beside the
    gradients (distributed optimizer: reduce-scattered and all-gathered)."""
    results = run_ranks(step_traffic, 2, args=(BASE + ["--use-distributed-optimizer", "--hidden-size", "96"],),
                        timeout=300)
    for res in results:
        params = stage_params(1, True, True, L, 1, h=96)
        padding = res["buffer_numel"] - params
        assert res["param_numel"] == params and 0 < padding < 64 * res["params"] + 64 * 2 * res["buckets"]
        minimum = ring(2) * params * E * 2
        assert res["comm"][0]["dp"] == round(minimum + ring(2) * padding * E * 2)


def train_with_files(rank, world, argv):
    run = gpt_run(argv)
    return [r["comm_bytes"] for r in run.records]


def test_metrics_file_and_timeline_hold_the_counts(tmp_path):
    metrics, timeline = tmp_path / "metrics.jsonl", tmp_path / "timeline.json"
    argv = BASE + ["--tp", "2", "--pp", "2", "--metrics-file", str(metrics), "--timeline", str(timeline),
                   "--timeline-iters", "2"]
    per_rank = run_ranks(train_with_files, 4, args=(argv,), timeout=300)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["comm_bytes"] for r in train] == per_rank[0]  # rank 0's counts, as the counter gave them
    assert set(per_rank[0][0]) == {"tp", "pp", "embedding", "metrics"}
    events = json.loads(timeline.read_text())["traceEvents"]
    for rank, counts in enumerate(per_rank):  # every rank's count, a counter point per step
        points = sorted((e for e in events if e["ph"] == "C" and e["pid"] == rank), key=lambda e: e["ts"])
        assert [e["args"] for e in points] == counts
        assert all(e["name"] == "comm bytes" for e in points)


def test_traffic_counter_volumes_and_reset():
    traffic.take()
    traffic.all_reduce("dp", 1000, 4)  # 2 * 3/4 * 1000
    traffic.gather_or_scatter("tp", 999, 3)  # 2/3 * 999
    traffic.all_reduce("tp", 1000, 1)  # a group of one sends nothing
    traffic.send("pp", 7)
    with traffic.excluded():
        traffic.send("pp", 1000)
    assert traffic.take() == {"tp": 666, "pp": 7, "dp": 1500}
    assert traffic.take() == {}
