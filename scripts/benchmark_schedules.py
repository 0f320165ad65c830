#!/usr/bin/env python
"""Pipeline schedules on two ranks, one core each: what each leaves idle and what it holds.

    python scripts/benchmark_schedules.py                       # GPT 4 layers h512, pp 2, 8 micro-batches
    python scripts/benchmark_schedules.py --quick --json out.json

Idle: in one spawn of two ranks pinned to one core each, each schedule trains the same model for
--iters steps (the first dropped), in --rounds rounds of ABBA order. A step's idle fraction on a
rank is 1 - (time in F, B and W passes) / (the schedule's wall time): waiting for a neighbour and
the sends themselves count as idle, as in the training log's `bubble_measured`. Reported: the
median idle fraction (the two ranks' mean per step), the median and range of its per-round ratio
to 1F1B's, the same for the schedule's wall time per step, and the simulator's prediction beside
them: the simulator's idle fraction (megalite.pipeline.schedules.predicted_idle: the bubble
formula for 1F1B and ZB-H1) at the F, B and W costs measured in the run (1F1B's backward is B + W
as one pass; ZB-V's passes are of one of its two chunks per rank). ZB-V runs twice: `zb-v` ordered
for equal costs (the default --pipeline-pass-costs), `zb-v*` for the F, B and W a calibration run
of zb-v measured first (each rank runs the same program: the costs are agreed before the spawn).

Memory: one step of each schedule with saved-tensor hooks on every forward. A stage's activation
memory at a moment is the bytes of the distinct storages autograd holds for backward (parameters
excluded) plus the output gradients that deferred W passes keep (`weight_grad.held_bytes`); its
peak is read after every forward and every B. The formula: the program's peak micro-batches in flight
(`peak_in_flight`: forwarded, not yet through their last backward pass) times one micro-batch's
activations (the most one forward saved): 1F1B (p - r) M on stage r, ZB-H1 p M on every stage,
1F1B's first-stage peak (Qi et al. 2023: ZB-H1 keeps 1F1B's peak memory), and ZB-V 2p chunks of
half a stage's on every stage: p M again. A B frees what only it needed, so later stages stay below.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import tempfile
import weakref
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from benchmark_step import device_string, git_state  # noqa: E402

SCHEDULES = ("1f1b", "zb-h1", "zb-v", "zb-v*", "dualpipev")  # zb-v*: ordered for the pass costs measured first
MEMORY_SCHEDULES = ("1f1b", "zb-h1", "zb-v", "dualpipev")
MODEL = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "256",
         "--micro-batch-size", "2", "--global-batch-size", "16", "--vocab-size", "1024"]
QUICK = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "1", "--global-batch-size", "4", "--vocab-size", "128"]


def _args(model: list[str], iters: int, schedule: str, costs: str = "1,1,1"):
    from megalite import arguments

    if schedule == "zb-v*":
        schedule = "zb-v"
    else:
        costs = "1,1,1"
    argv = ["--mock-data", "--pp", "2", "--train-iters", str(iters), "--log-interval", str(iters),
            "--lr-warmup-iters", "0", "--no-progress-bar", *model, "--pipeline-schedule", schedule,
            "--pipeline-pass-costs", costs]
    return arguments.build_parser("benchmark", default_model="gpt-tiny").parse_args(argv)


def _pass_costs(spans) -> dict[str, float]:
    """Mean seconds of this step's F, B and W passes (from the schedule's spans)."""
    out = {}
    for kind in "FBW":
        durations = [d for name, _, _, d, *_ in spans if name.startswith(kind + " ")]
        out[kind] = statistics.fmean(durations) if durations else 0.0
    return out


def idle_rank(rank, world, model, iters, schedules, rounds, costs="1,1,1"):
    """Each schedule's steps on this rank, per round (ABBA order: 1f1b first in even rounds, last in
    odd ones): (idle fraction, pass costs, the schedule's wall seconds), each run's first dropped.
    `costs`: the --pipeline-pass-costs of zb-v*."""
    import pretrain_gpt
    from megalite.training import pretrain, step as step_module

    os.sched_setaffinity(0, {rank % os.cpu_count()})
    steps = []
    run_schedule = step_module.run_schedule

    def recording(*args, **kwargs):  # spans on every step: on a CPU they cost no synchronization
        stats = run_schedule(*args, **{**kwargs, "record_spans": True})
        steps.append((1.0 - stats.busy_s / stats.wall_s, _pass_costs(stats.spans), stats.wall_s))
        return stats

    step_module.run_schedule = recording
    out = {schedule: [] for schedule in schedules}
    for k in range(rounds):
        for schedule in (schedules if k % 2 == 0 else reversed(schedules)):
            steps.clear()
            pretrain(_args(model, iters, schedule, costs), pretrain_gpt.task())
            out[schedule].append(steps[1:])
    return out


def measured_costs(idle) -> str:
    """--pipeline-pass-costs for zb-v*: the F, B and W of a calibration run of zb-v, relative to F."""
    passes = [c for r in range(2) for run in idle[r]["zb-v"] for _, c, _ in run]
    f, b, w = (statistics.fmean(c[kind] for c in passes) for kind in "FBW")
    return f"1,{b / f:.2f},{w / f:.2f}"


class SavedBytes:
    """Bytes of the distinct storages autograd keeps for backward (parameters excluded), and the
    peak of that plus what deferred W passes hold, read with `sample`."""

    def __init__(self):
        self.tensors: dict[int, weakref.ref] = {}
        self.params: set[int] = set()
        self.peak = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in self.params:
            self.tensors[id(t)] = weakref.ref(t)
        return t

    def live(self) -> int:
        storages = {}
        for key, ref in list(self.tensors.items()):
            t = ref()
            if t is None:
                del self.tensors[key]
            else:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    def sample(self) -> int:
        from megalite.parallel import weight_grad

        now = self.live() + weight_grad.held_bytes()
        self.peak = max(self.peak, now)
        return now


def memory_rank(rank, world, model, schedules):
    """Each schedule's peak activation bytes on this rank over one step, one micro-batch's
    activations (the most one forward saved) and the program's peak micro-batches in flight."""
    import pretrain_gpt
    from megalite import parallel
    from megalite.parallel import weight_grad
    from megalite.pipeline.schedules import build_program, peak_in_flight
    from megalite.training import Task, pretrain

    base = pretrain_gpt.task()
    out = {}
    for schedule in schedules:
        saved = SavedBytes()
        one = [0]

        def forward_step(chunk, batch):
            saved.params = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
            before = saved.live()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                loss = base.forward_step(chunk, batch)
            one[0] = max(one[0], saved.live() - before)
            saved.sample()
            return loss

        args = _args(model, 1, schedule)
        deferred = weight_grad.deferred

        @contextlib.contextmanager
        def sampled_after_b(*args, **kwargs):  # right after a B: what its W keeps, with the W's held back before it
            with deferred(*args, **kwargs) as work:
                yield work
            saved.sample()

        weight_grad.deferred = sampled_after_b
        try:
            pretrain(args, Task(base.build_model, base.build_data, forward_step))
        finally:
            weight_grad.deferred = deferred
        m = args.training.global_batch_size // args.training.micro_batch_size
        program = build_program(2, parallel.get_pipeline_model_parallel_rank(), m, None, schedule)
        out[schedule] = {"peak": saved.peak, "micro_batch": one[0], "in_flight": peak_in_flight(program)}
    return out


def main() -> None:
    from megalite.pipeline.schedules import predicted_idle
    from megalite.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=4, help="steps per run (the first is dropped)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of one run per schedule, in ABBA order")
    ap.add_argument("--quick", action="store_true", help="a tiny model and 3 steps (the tests' smoke run)")
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args()
    model, iters, rounds = (QUICK, 3, 1) if a.quick else (MODEL, a.iters, a.rounds)
    m = int(model[model.index("--global-batch-size") + 1]) // int(model[model.index("--micro-batch-size") + 1])
    calibration = run_ranks(idle_rank, 2, args=(model, iters, ("zb-v",), 1), timeout=600)
    v_costs = measured_costs(calibration)
    idle = run_ranks(idle_rank, 2, args=(model, iters, SCHEDULES, rounds, v_costs), timeout=3600)
    memory = run_ranks(memory_rank, 2, args=(model, MEMORY_SCHEDULES), timeout=600)

    def per_round(schedule, k):
        """(median idle fraction, median wall seconds) of a schedule's steps in round k (both ranks)."""
        steps = list(zip(idle[0][schedule][k], idle[1][schedule][k]))
        return (statistics.median(statistics.fmean(s[0] for s in step) for step in steps),
                statistics.median(max(s[2] for s in step) for step in steps))

    def ordered_for(schedule):
        return tuple(float(x) for x in v_costs.split(",")) if schedule == "zb-v*" else (1, 1, 1)

    rows = {}
    for schedule in SCHEDULES:
        rounds_of = [per_round(schedule, k) for k in range(rounds)]
        base = [per_round("1f1b", k) for k in range(rounds)]
        idle_ratio = [x[0] / b[0] for x, b in zip(rounds_of, base)]
        wall_ratio = [x[1] / b[1] for x, b in zip(rounds_of, base)]
        passes = [c for r in range(2) for run in idle[r][schedule] for _, c, _ in run]
        costs = {kind: statistics.fmean(c[kind] for c in passes) for kind in "FBW"}
        rows[schedule] = {"idle": statistics.median(x[0] for x in rounds_of),
                          "idle_ratio": statistics.median(idle_ratio), "idle_ratio_range": [min(idle_ratio), max(idle_ratio)],
                          "schedule_ms": 1e3 * statistics.median(x[1] for x in rounds_of),
                          "wall_ratio": statistics.median(wall_ratio), "wall_ratio_range": [min(wall_ratio), max(wall_ratio)],
                          "costs_ms": {k: 1e3 * v for k, v in costs.items()},
                          "predicted": predicted_idle(2, m, schedule.rstrip("*"), costs["F"], costs["B"], costs["W"],
                                                      ordered_for=ordered_for(schedule)),
                          "memory": [memory[r][schedule] for r in range(2)] if schedule in memory[0] else None}
    print(f"device: {device_string()}; 2 ranks (one core each), pp 2, {m} micro-batches; {rounds} ABBA rounds of "
          f"{iters - 1} steps per schedule; zb-v ordered for equal costs, zb-v* for those a calibration run "
          f"measured (--pipeline-pass-costs {v_costs}); {datetime.date.today()}")
    print(f"{'schedule':>8} | {'idle':>6} {'vs 1f1b (range)':>20} | {'predicted':>9} | {'step ms':>7} "
          f"{'vs 1f1b (range)':>20} | F, B, W ms")
    for schedule, row in rows.items():
        c, (i0, i1), (w0, w1) = row["costs_ms"], row["idle_ratio_range"], row["wall_ratio_range"]
        print(f"{schedule:>8} | {row['idle']:6.1%} {row['idle_ratio']:5.2f} ({i0:.2f}-{i1:.2f}) | "
              f"{row['predicted']:9.1%} | {row['schedule_ms']:7.0f} {row['wall_ratio']:6.3f} ({w0:.3f}-{w1:.3f}) | "
              f"{c['F']:.1f}, {c['B']:.1f}, {c['W']:.1f}")
    print(f"\n{'schedule':>8} {'stage':>5} | {'peak MiB':>8} {'formula':>8} {'ratio':>5} | in flight x one micro-batch")
    for schedule, row in rows.items():
        for r, mem in enumerate(row["memory"] or []):
            formula = mem["in_flight"] * mem["micro_batch"]
            print(f"{schedule:>8} {r:>5} | {mem['peak'] / 2**20:8.2f} {formula / 2**20:8.2f} "
                  f"{mem['peak'] / formula:5.2f} | {mem['in_flight']} x {mem['micro_batch'] / 2**20:.2f} MiB")
    if a.json:
        Path(a.json).write_text(json.dumps({"date": str(datetime.date.today()), "device": device_string(),
                                            "git": git_state(), "micro_batches": m, "steps": iters - 1, "rounds": rounds,
                                            "zb_v_star_pass_costs": v_costs,
                                            "schedules": rows}, indent=2))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        main()
