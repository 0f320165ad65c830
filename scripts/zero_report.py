#!/usr/bin/env python
"""What each ZeRO stage holds and sends, measured on real training steps (CPU, gloo):

    python scripts/zero_report.py                      # gpt-tiny, 4 layers, dp 4, bf16, m = 1 and 2
    python scripts/zero_report.py --dp 2 --layers 8 --json $OUT/zero.json

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
    pins = [why for _, why in getattr(buf, "gather_log", []) if why == "pin"]
    pin_bytes = ring_bytes("all_gather", buf.numel * buf.param_dtype.itemsize, world) if pins else 0
    stored = buf.stored_bytes()
    return {"params": stored["params"], "grads": stored["grads"], "optimizer": run.optimizer.state_bytes(),
            "peak_transient": stored.get("peak_transient", 0), "real": sum(p.numel() for p in buf.params),
            "sent": float(sum(sent, Fraction(0)) - pin_bytes)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2])
    p.add_argument("--json", default=None)
    opts = p.parse_args()
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


if __name__ == "__main__":
    main()
