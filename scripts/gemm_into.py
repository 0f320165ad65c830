#!/usr/bin/env python
"""A weight gradient written into its buffer on a CPU: one overwriting GEMM (beta 0) against
`zero_()` and a GEMM that adds (beta 1), the way megalite.optim.buffers.write_gemm writes it.

    python scripts/gemm_into.py                 # the shapes of benchmark_step.py's GPT models
    python scripts/gemm_into.py --rounds 40

For each weight-gradient shape (out x in, summed over `tokens` rows) both ways write the same view of
a flat buffer, each timed cold (a 64 MB pass between calls evicts the caches, as a training step
leaves them), in interleaved rounds on one thread; it prints the median time of each and their
ratio, and checks that the two results are equal bit for bit. MKL's overwriting GEMM first scales
its output by zero in a pass of its own, slower than torch's fill.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

# (name, out, in, tokens): benchmark_step.py's GPT tiny (64 tokens a step) and GPT 124m (128)
SHAPES = [("tiny fc1", 1024, 256, 64), ("tiny qkv", 768, 256, 64), ("tiny proj", 256, 256, 64),
          ("tiny embedding", 8192, 256, 64), ("124m fc1", 3072, 768, 128), ("124m qkv", 2304, 768, 128),
          ("124m embedding", 50304, 768, 128)]


def overwrite(out, a, b):
    torch.mm(a, b, out=out)


def zero_then_add(out, a, b):
    out.zero_().addmm_(a, b)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="two small shapes, two rounds (tests/test_grad_accumulation.py)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    shapes = [("quick", 96, 64, 16), ("quick embedding", 512, 64, 16)] if args.quick else SHAPES
    rounds = 2 if args.quick else args.rounds
    evict = torch.zeros((64 << 20) // 4 if not args.quick else 1 << 16)
    rows = []
    for name, n_out, n_in, tokens in shapes:
        torch.manual_seed(0)
        grad_out, inputs = torch.randn(tokens, n_out), torch.randn(tokens, n_in)
        flat = torch.full((n_out * n_in + 128,), float("nan"))
        out = flat[64:64 + n_out * n_in].view(n_out, n_in)  # a view at a buffer's alignment
        results, times = {}, {overwrite: [], zero_then_add: []}
        for r in range(rounds + 1):
            for fn in (overwrite, zero_then_add) if r % 2 == 0 else (zero_then_add, overwrite):
                evict.add_(1.0)
                t0 = time.process_time()
                fn(out, grad_out.t(), inputs)
                if r:  # the first round warms up
                    times[fn].append(time.process_time() - t0)
                results[fn] = out.clone()
        row = {"shape": name, "out": n_out, "in": n_in, "tokens": tokens,
               "overwrite_us": statistics.median(times[overwrite]) * 1e6,
               "zero_then_add_us": statistics.median(times[zero_then_add]) * 1e6,
               "bitwise": torch.equal(results[overwrite], results[zero_then_add])}
        row["ratio"] = row["zero_then_add_us"] / row["overwrite_us"]
        rows.append(row)
        print(f"{name:>16} [{n_out} x {n_in}] over {tokens} tokens: mm(out=) {row['overwrite_us']:8.1f} us, "
              f"zero_ + addmm_ {row['zero_then_add_us']:8.1f} us, ratio {row['ratio']:.3f}, "
              f"bitwise {'yes' if row['bitwise'] else 'NO'}", flush=True)
    if not all(r["bitwise"] for r in rows):
        raise SystemExit("the two ways gave different bits")
    return rows


if __name__ == "__main__":
    main()
