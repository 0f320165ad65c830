"""--overlap-moe-expert-parallel-comm (issue #50): each steady-state forward runs beside a backward of
another micro-batch on two lanes that hand the turn over at every collective
(megalite.parallel.lanes), so one's expert all-to-alls (and TP/SP, CP exchanges) are in flight while
the other computes. Claims: the paired programs are right under NCCL's matching, never pair a pass
with the one it reads, and hold one more micro-batch; training is bitwise the run without the flag
(losses, gradient norms, bytes counted, every weight) at EP 2 with dropout, TP 2 (SP) x EP 2,
CP 2 x EP 2, PP 2 x EP 2 under 1F1B, interleaving and DualPipeV; the forward lane's all-to-alls
are launched and the backward lane computes before they are waited for; no host sync is added;
the timeline draws the second lane and the all-to-alls in flight; what it cannot pair is refused
in one line."""
import json

import pytest
import torch

from helpers import fresh_seed
from megalite.parallel import lanes
from megalite.pipeline.programs import build_program, peak_in_flight
from megalite.pipeline.replay import check_nccl_order, exchange_plan, incoming, outgoing
from megalite.testing import run_ranks
from test_moe_training import MOE  # the tiny MoE GPT: a dense first layer, shared expert, aux and z-losses
from training_ranks import refusal, steady_host_syncs, train_params

BASE = ["--train-iters", "2", "--log-interval", "1", "--seq-length", "32", "--micro-batch-size", "2",
        "--eval-interval", "0", "--hidden-dropout", "0.1", *MOE]
FLAG = "--overlap-moe-expert-parallel-comm"


@pytest.mark.parametrize("kind,chunks", [("1f1b", None), ("interleaved", 2), ("interleaved", 3)])
def test_paired_programs_match_under_nccl_order_and_never_pair_a_pass_with_its_input(kind, chunks):
    for p in (1, 2, 3, 4):
        for m in range(1, 13):
            if kind == "interleaved" and (p < 2 or m % p):
                continue
            programs = [build_program(p, r, m, chunks, kind, paired=True) for r in range(p)]
            check_nccl_order([exchange_plan(prog, p, r, chunks or 1) for r, prog in enumerate(programs)], p)
            for r, prog in enumerate(programs):
                plain = build_program(p, r, m, chunks, kind)
                assert sorted(map(repr, (op for op in prog if op.kind in "FB"))) == \
                    sorted(map(repr, (op for op in plain if op.kind in "FB")))
                pairs = [(prog[i + 1], prog[i + 2]) for i, op in enumerate(prog) if op.kind == "O"]
                # The steady state is paired (the last stage's backward reads the forward before it).
                assert len(pairs) == max(0, sum(op.kind == "F" for op in prog) - (
                    p - r if kind == "1f1b" else min(m * chunks, (p - r - 1) * 2 + (chunks - 1) * p + 1)
                    if m != p else m * chunks)), (p, r, m)
                for f, b in pairs:
                    assert (f.kind, b.kind) == ("F", "B") and (f.chunk, f.micro_batch) != (b.chunk, b.micro_batch)
                    made = outgoing("F", f.chunk, f.micro_batch, p, r, chunks or 1)
                    assert made is None or made != incoming("B", b.chunk, b.micro_batch, p, r, chunks or 1)
                if pairs:  # the forward beside each backward is one more micro-batch's activations
                    assert peak_in_flight(prog) == peak_in_flight(plain) + 1


def _trainings(rank, world, runs, seed):
    """Each (argv) run's parameters and records, with the lanes' hand-overs it made."""
    out = []
    for argv in runs:
        with lanes.log_handovers() as handovers:
            result = train_params(rank, world, argv + ["--seed", str(seed)])
        out.append({**result, "handovers": list(handovers)})
    return out


def _assert_same(plain, paired):
    assert len(plain["records"]) == len(paired["records"]) > 0
    for a, b in zip(plain["records"], paired["records"]):
        for key in ("loss", "grad_norm", "comm_bytes"):
            assert a[key] == b[key], (key, a[key], b[key])
    assert [n for n, p in plain["params"].items() if not torch.equal(p, paired["params"][n])] == []
    assert plain["handovers"] == []


def test_ep2_trains_bitwise_alike_with_the_all_to_alls_behind_the_other_lane():
    argv = BASE + ["--ep", "2", "--global-batch-size", "8"]  # 2 micro-batches a rank: one pair a step
    for plain, paired in run_ranks(_trainings, 2, args=([argv, argv + [FLAG]], fresh_seed())):
        _assert_same(plain, paired)
        kinds = paired["handovers"]
        # Every hand-over comes at a collective; the forward lane's dispatches (counts, rows) go out and
        # the backward lane runs until its own, and the other way round.
        assert {lane for lane, _ in kinds} == {"F", "B"} and {kind for _, kind in kinds} == {"ep"}
        # Per MoE layer (3) and pair (one a step, 2 steps) the forward hands over at its dispatch and
        # combine, not at the counts' all-gather (run in place: a few bytes), the backward at its two.
        assert kinds == [("F", "ep"), ("B", "ep")] * (2 * 3 * 2)


def test_an_exchange_run_in_place_keeps_the_turn():
    launched = []

    class Done:
        def wait(self):
            pass

    def exchange(name, async_op=False):
        launched.append((name, async_op))
        return Done() if async_op else None

    def forward():
        lanes.collective(exchange, "counts", kind="ep", hand_over=False)
        lanes.collective(exchange, "dispatch", kind="ep")

    with lanes.log_handovers() as handovers:
        lanes.run_pair(forward, lambda: lanes.collective(exchange, "combine", kind="ep"))
    # the counts ran at once with the forward's turn kept; the dispatch went out and handed over
    assert launched == [("counts", False), ("dispatch", True), ("combine", True)]
    assert handovers == [("F", "ep"), ("B", "ep")]


_HEAP_PROBE = """
import ctypes, sys
import torch
from megalite.parallel import host_heap, lanes
if sys.argv[1] == "one":
    assert host_heap.share_one_heap()
torch.set_num_threads(1)
def passes():  # small blocks, which glibc serves from the allocating thread's heap (not mmap)
    kept = [torch.ones(1000) for _ in range(200)]
    return sum(float(k[0]) for k in kept)
lanes.run_pair(passes, passes)
ctypes.CDLL(None).malloc_stats()  # one "Arena N:" block per heap, on stderr
"""


def test_the_forward_lane_allocates_from_the_main_heap():
    """glibc gives the forward lane's thread a heap of its own, mapped and unmapped as activations
    come and go: measured 2026-12-03, 141k more page faults and 3.5 s more system time over 6 steps
    (docs/communication.md, "One heap on the CPU"). With `share_one_heap` (what pretrain_gpt.py sets
    on the CPU with the flag) every thread allocates from the main heap: one heap where there were
    two. (Counting the page faults themselves failed under a loaded CI machine: 0.99 of own's once.)"""
    import os
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc" or os.environ.get("MALLOC_ARENA_MAX") or os.environ.get("LD_PRELOAD"):
        pytest.skip("glibc's own heaps per thread are what this counts (another allocator, or one already set)")
    heaps = {how: subprocess.run([sys.executable, "-c", _HEAP_PROBE, how], capture_output=True, text=True,
                                 check=True).stderr.count("Arena ") for how in ("own", "one")}
    assert heaps["one"] == 1 < heaps["own"], heaps


LAYOUTS = {
    "tp2-sp-ep2": ["--tp", "2", "--sequence-parallel", "--ep", "2", "--global-batch-size", "8"],
    "cp2-ep2": ["--cp", "2", "--ep", "2", "--global-batch-size", "8"],
    "pp2-ep2-1f1b": ["--pp", "2", "--ep", "2", "--global-batch-size", "16"],
    "pp2-ep2-interleaved": ["--pp", "2", "--vpp", "2", "--ep", "2", "--global-batch-size", "16"],
    "pp2-ep2-dualpipev": ["--pp", "2", "--pipeline-schedule", "dualpipev", "--ep", "2", "--global-batch-size", "16"],
}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """Every layout with and without the flag, in one spawn of 4 ranks (the DualPipeV run paired
    writes a timeline)."""
    timeline = tmp_path_factory.mktemp("timeline") / "trace.json"
    runs = []
    for name, layout in LAYOUTS.items():
        extra = ["--timeline", str(timeline), "--timeline-iters", "2"] if name.endswith("dualpipev") else []
        runs += [BASE + layout, BASE + layout + [FLAG] + extra]
    results = run_ranks(_trainings, 4, args=(runs, fresh_seed()), timeout=600)
    return {name: [(r[2 * i], r[2 * i + 1]) for r in results] for i, name in enumerate(LAYOUTS)}, timeline


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_trains_bitwise_alike_paired(layout_runs, name):
    by_rank = layout_runs[0][name]
    for plain, paired in by_rank:
        _assert_same(plain, paired)
    # Every rank of a pipeline that has a steady state hands over; TP/SP and CP exchanges hand over too.
    kinds = {kind for _, paired in by_rank for _, kind in paired["handovers"]}
    assert "ep" in kinds
    assert {"tp2-sp-ep2": "sp", "cp2-ep2": "cp"}.get(name, "ep") in kinds


@pytest.mark.slow
def test_the_timeline_draws_the_second_lane_and_the_all_to_alls_in_flight(layout_runs):
    events = json.loads(layout_runs[1].read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    second = [e for e in spans if e["tid"] == 3]
    assert second and {e["cat"] for e in second} == {"forward"}
    comm = [e for e in spans if e["cat"] == "ep-comm"]
    assert {e["tid"] for e in comm} == {2, 4}
    names = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"second lane: the overlapped pair's forward", "second lane: its collectives in flight"} <= names
    # Some of the forward lane's all-to-alls are in flight while a backward of the same rank runs.
    backward = [(e["pid"], e["ts"], e["ts"] + e["dur"]) for e in spans if e["cat"] == "backward"]
    assert any(e["tid"] == 4 and pid == e["pid"] and start < e["ts"] + e["dur"] and e["ts"] < end
               for e in comm for pid, start, end in backward)


def test_pairing_adds_no_host_sync():
    # A dense model's steady steps make none, paired or not; dropless routing's one host copy of the
    # counts per layer stays one.
    dense = ["--train-iters", "4", "--log-interval", "4", "--seq-length", "32", "--micro-batch-size", "2",
             "--global-batch-size", "8", "--eval-interval", "0"]
    moe = BASE + ["--ep", "2", "--global-batch-size", "8", "--train-iters", "4", "--log-interval", "4"]
    for counts in run_ranks(steady_host_syncs, 2, args=([dense, dense + [FLAG], moe, moe + [FLAG]],)):
        assert counts[0] == counts[1] == 0 and counts[2] == counts[3] > 0, counts


@pytest.mark.parametrize("extra,named", [
    (["--pp", "2", "--pipeline-schedule", "zb-h1"], "zb-h1 schedule"),
    (["--recompute", "full"], "--recompute"),
    (["--zero-stage", "3"], "--zero-stage 3"),
    (["--fp8-format", "e4m3"], "--fp8-format"),
    (["--torch-compile"], "--torch-compile"),
], ids=["zb-h1", "recompute", "zero3", "fp8", "compile"])
def test_what_cannot_be_paired_is_refused_in_one_line(extra, named):
    message = refusal(BASE + ["--ep", "2", "--global-batch-size", "8", FLAG] + extra, 4)
    assert FLAG in message and named in message, message
