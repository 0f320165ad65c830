#!/usr/bin/env python
"""The layout planner's predictions against measured runs on one GPU (tp = pp = dp = 1).

    python scripts/validate_planner.py --json $OUT/planner.json          # on the H100
    python scripts/validate_planner.py --device cpu --quick              # a smoke run of the script

For gpt2-350m (micro-batch 8, global batch 32, sequence 1024) and gpt-1.3b (4, 32, 2048), bf16, with
each recompute mode: the planner's peak memory and step time (megalite.tools.plan.check_layout,
default cluster: 989 TFLOP/s at efficiency 0.5, 2 GiB overhead) next to the measured ones: peak
`torch.cuda.max_memory_allocated()` from before the model is built to the last step (compared
with the predicted peak minus the fixed overhead, which the allocator does not see) and the mean
step time of megalite.training.TrainStep (scripts/benchmark_gpt.py's timing). Targets: memory
within 10%, step time within 15%; `--check` exits 1 when a row misses them.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megalite.models import preset as preset_config  # noqa: E402
from megalite.tools import plan  # noqa: E402

SHAPES = {"gpt2-350m": (8, 32, 1024), "gpt-1.3b": (4, 32, 2048)}  # micro-batch, global batch, sequence
MODES = ("none", "selective", "full")
MEMORY_TOLERANCE, TIME_TOLERANCE = 0.10, 0.15


def _benchmark_module():
    spec = importlib.util.spec_from_file_location("benchmark_gpt", ROOT / "scripts" / "benchmark_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--presets", nargs="+", default=list(SHAPES))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="gpt-tiny, a few steps (checks the script)")
    p.add_argument("--check", action="store_true", help="exit 1 when a row misses its tolerance")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    bench = _benchmark_module()
    device = torch.device(args.device)
    warmup = args.warmup or (1 if args.quick else 3)
    iters = args.iters or (1 if args.quick else 10)
    shapes = {"gpt-tiny": (2, 4, 64)} if args.quick else {k: SHAPES[k] for k in args.presets}
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 80 * 2 ** 30
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results = {"device": name, "date": datetime.date.today().isoformat(), "torch": torch.__version__, "rows": []}
    print(f"{name}, torch {torch.__version__}")
    print("| model | recompute | predicted GiB (minus overhead) | measured GiB | error | predicted ms | "
          "measured ms | error |")
    print("|---|---|---|---|---|---|---|---|")
    missed = []
    for model, (mb, global_batch, seq) in shapes.items():
        for mode in args.modes:
            config = preset_config(model, recompute=mode, hidden_dropout=0.0, attention_dropout=0.0,
                                   max_position_embeddings=max(seq, preset_config(model).max_position_embeddings))
            _, pred = plan.check_layout(config, micro_batch_size=mb, global_batch_size=global_batch, seq_length=seq,
                                        recompute=mode, dtype="bf16", gpu_memory_bytes=gpu_bytes)
            predicted_bytes = pred.peak_bytes - pred.memory.overhead
            ms = bench.bench_megalite(model, mb, seq, ["--recompute", mode], device, warmup, iters, args.quick,
                                      global_batch=global_batch)
            measured = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            row = {"model": model, "recompute": mode, "micro_batch": mb, "global_batch": global_batch, "seq": seq,
                   "predicted_bytes": predicted_bytes, "measured_bytes": measured,
                   "predicted_ms": pred.step_time * 1e3, "measured_ms": ms,
                   "memory_error": None if measured is None else predicted_bytes / measured - 1,
                   "time_error": pred.step_time * 1e3 / ms - 1}
            results["rows"].append(row)
            mem_ok = row["memory_error"] is None or abs(row["memory_error"]) <= MEMORY_TOLERANCE
            if not mem_ok or abs(row["time_error"]) > TIME_TOLERANCE:
                missed.append(f"{model} {mode}")
            gib = lambda b: "-" if b is None else f"{b / 2 ** 30:.2f}"  # noqa: E731
            mem_err = "-" if row["memory_error"] is None else f"{100 * row['memory_error']:+.1f}%"
            print(f"| {model} | {mode} | {gib(predicted_bytes)} | {gib(measured)} | {mem_err} | "
                  f"{row['predicted_ms']:.1f} | {ms:.1f} | {100 * row['time_error']:+.1f}% |", flush=True)
    results["missed"] = missed
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if missed:
        print(f"outside the tolerances (memory {MEMORY_TOLERANCE:.0%}, time {TIME_TOLERANCE:.0%}): {', '.join(missed)}")
    if args.check and missed:
        sys.exit(1)
    return results


if __name__ == "__main__":
    main()
