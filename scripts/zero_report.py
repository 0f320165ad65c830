#!/usr/bin/env python
"""What each ZeRO stage holds and sends, measured on real training steps (CPU, gloo):

    python scripts/zero_report.py                      # gpt-tiny, 4 layers, dp 4, bf16, m = 1 and 2
    python scripts/zero_report.py --dp 2 --layers 8 --json $OUT/zero.json
    python scripts/zero_report.py --timeline --dp 2 --layers 8   # stage 3's gathers against compute

Per rank and stage: the parameter, gradient and optimizer-state bytes it stores (and those per
parameter), the peak of transient bytes during the step (whole-bucket gradients; stage 3's gathered
layers), and the bytes it sends for data parallelism in one step (ring volumes of the DP
collectives, counted where megalite calls them), as a ratio to plain data parallelism's all-reduce
measured in the same run. docs/optimizer.md quotes its output.
"""
from __future__ import annotations

import argparse
import json
import sys
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megalite import arguments  # noqa: E402
from megalite.testing import counting_collectives, ring_bytes, run_ranks  # noqa: E402
from megalite.training import pretrain  # noqa: E402

import pretrain_gpt  # noqa: E402


def one_stage(rank, world, argv):
    sent: list[Fraction] = []
    args = arguments.build_parser("zero_report", default_model="gpt-tiny").parse_args(argv)
    with counting_collectives(lambda kind, nbytes, n: sent.append(ring_bytes(kind, nbytes, n)), dp_buffers_only=True):
        run = pretrain(args, pretrain_gpt.task())
    buf = run.buffers[0]
    stored = buf.stored_bytes()
    return {"params": stored["params"], "grads": stored["grads"], "optimizer": run.optimizer.state_bytes(),
            "peak_transient": stored.get("peak_transient", 0), "real": sum(buf.numel_of.values()),
            "sent": float(sum(sent, Fraction(0)))}


def gather_overlap(rank, world, argv, trace):
    """Stage 3 with --timeline: how long the gathers were in flight and how long compute waited."""
    args = arguments.build_parser("zero_report", default_model="gpt-tiny").parse_args(argv + ["--timeline", trace])
    pretrain(args, pretrain_gpt.task())
    if rank != 0:
        return None
    events = json.loads(Path(trace).read_text())["traceEvents"]
    out = {}
    for r in range(world):
        mine = [e for e in events if e.get("pid") == r]
        out[r] = {"gathers": sum(e.get("cat") == "zero-gather" for e in mine),
                  "in_flight_ms": sum(e["dur"] for e in mine if e.get("cat") == "zero-gather") / 1e3,
                  "waited_ms": sum(e["dur"] for e in mine if e.get("cat") == "zero-wait") / 1e3,
                  "compute_ms": sum(e["dur"] for e in mine if e.get("cat") in ("forward", "backward")) / 1e3}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2])
    p.add_argument("--json", default=None)
    p.add_argument("--timeline", action="store_true",
                   help="instead: stage 3 with --timeline, gathers in flight vs compute's waits (prefetch)")
    p.add_argument("--hidden-size", type=int, default=None)
    opts = p.parse_args()
    if opts.timeline:
        return overlap_report(opts)
    rows = []
    for m in opts.micro_batches:
        argv = ["--mock-data", "--seq-length", "32", "--micro-batch-size", "2", "--num-layers", str(opts.layers),
                "--global-batch-size", str(2 * opts.dp * m), "--train-iters", "1", "--eval-iters", "0",
                "--log-interval", "1", "--bf16", "--grad-reduce-dtype", "fp32"]
        by_stage = {}
        for stage in (0, 1, 2, 3):
            by_stage[stage] = run_ranks(one_stage, opts.dp, args=(argv + ["--zero-stage", str(stage)],))[0]
        plain = by_stage[0]["sent"]
        for stage, got in by_stage.items():
            state = got["params"] + got["grads"] + got["optimizer"]
            rows.append({"micro_batches": m, "stage": stage, **got, "state_bytes_per_param": state / got["real"],
                         "sent_vs_plain_dp": got["sent"] / plain})
    print(f"gpt-tiny, {opts.layers} layers, dp {opts.dp}, bf16 parameters, fp32 gradients and masters; per rank")
    print(f"{'m':>2} {'stage':>5} {'params B':>10} {'grads B':>10} {'optim B':>10} {'B/param':>8} "
          f"{'transient B':>12} {'sent B/step':>12} {'vs DP':>6}")
    for r in rows:
        print(f"{r['micro_batches']:>2} {r['stage']:>5} {r['params']:>10,} {r['grads']:>10,} {r['optimizer']:>10,} "
              f"{r['state_bytes_per_param']:>8.2f} {r['peak_transient']:>12,} {r['sent']:>12,.0f} "
              f"{r['sent_vs_plain_dp']:>6.2f}")
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1))


def overlap_report(opts) -> None:
    import tempfile

    argv = ["--mock-data", "--seq-length", "128", "--micro-batch-size", "2", "--num-layers", str(opts.layers),
            "--global-batch-size", str(2 * opts.dp * 2), "--train-iters", "3", "--eval-iters", "0",
            "--log-interval", "1", "--zero-stage", "3"]
    if opts.hidden_size:
        argv += ["--hidden-size", str(opts.hidden_size), "--num-attention-heads", "8"]
    with tempfile.TemporaryDirectory() as tmp:
        got = run_ranks(gather_overlap, opts.dp, args=(argv, str(Path(tmp) / "trace.json")))[0]
    print(f"stage 3, gpt-tiny, {opts.layers} layers, dp {opts.dp}, 2 micro-batches a step, 3 steps traced")
    print(f"{'rank':>4} {'gathers':>7} {'in flight ms':>12} {'waited ms':>9} {'hidden':>6} {'compute ms':>10}")
    for r, g in got.items():
        hidden = 1 - g["waited_ms"] / g["in_flight_ms"] if g["in_flight_ms"] else 0.0
        print(f"{r:>4} {g['gathers']:>7} {g['in_flight_ms']:>12.1f} {g['waited_ms']:>9.1f} {hidden:>6.0%} "
              f"{g['compute_ms']:>10.1f}")
    if opts.json:
        Path(opts.json).write_text(json.dumps(got, indent=1))


if __name__ == "__main__":
    main()
