#!/usr/bin/env python
"""Time megalite's fused kernels against PyTorch eager and torch.compile of the same math, in one run.

    python scripts/bench_kernels.py --json $OUT/kernels.json          # on the GPU
    python scripts/bench_kernels.py --device cpu --quick               # a smoke run of the script itself

For each case: forward and forward+backward time (median of --reps after --warmup, CUDA events),
the bytes the operation must move divided by the time (GB/s) and as a fraction of the device copy
bandwidth measured in the same run, and the speed ratio (baseline time / megalite time) against
eager and compiled PyTorch. Bytes counted: every input read once and every output written once;
the causal softmax need only read the visible (lower-triangular) part of its scores and of y/dy.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megalite import ops  # noqa: E402


def timer(device: torch.device, reps: int, warmup: int):
    def measure(fn) -> float:
        """Median milliseconds of fn()."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    return measure


def copy_bandwidth(device, measure, nbytes: int) -> float:
    """GB/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = measure(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def fwd_bwd(fn, x):
    def run():
        y = fn(x)
        torch.autograd.grad(y, x, _grad_for(y))
    return run


_GRADS = {}


def _grad_for(y):
    """One fixed upstream gradient per shape, made once (not timed)."""
    key = (tuple(y.shape), y.dtype, y.device)
    if key not in _GRADS:
        _GRADS[key] = torch.randn_like(y)
    return _GRADS[key]


def softmax_cases(quick: bool):
    if quick:
        return [("causal", 2, 2, 64), ("masked", 2, 2, 64)]
    return ([("causal", 8, 16, s) for s in (1024, 2048, 4096)]
            + [("masked", 8, 16, s) for s in (1024, 2048, 4096)])


def norm_cases(quick: bool):
    if quick:
        return [("layer_norm", 64, 128), ("rms_norm", 64, 128)]
    return ([("layer_norm", 16384, h) for h in (1024, 2048, 4096, 8192)]
            + [("rms_norm", 16384, h) for h in (2048, 8192)])


def bench_softmax(kind, b, heads, s, dtype, device, measure, compile_baselines):
    scale = 1.0 / math.sqrt(128)
    x = torch.randn(b, heads, s, s, dtype=dtype, device=device, requires_grad=True)
    if kind == "causal":
        hidden = torch.ones(s, s, dtype=torch.bool, device=device).triu(1)
        ours = lambda t: ops.scaled_causal_softmax(t, scale)  # noqa: E731
        visible = (s + 1) / (2 * s)
    else:
        # BERT padding: each sequence keeps a different number of real tokens; keys beyond are hidden.
        lengths = torch.linspace(s // 2, s, b, device=device).long()
        hidden = (torch.arange(s, device=device)[None, :] >= lengths[:, None])[:, None, None, :].expand(b, 1, s, s).contiguous()
        ours = lambda t: ops.scaled_masked_softmax(t, hidden, scale)  # noqa: E731
        visible = 1.0

    def eager(t):
        return torch.softmax(t.masked_fill(hidden, float("-inf")) * scale, dim=-1)

    elem, nbytes = x.numel(), x.element_size()
    mask_bytes = 0 if kind == "causal" else hidden.numel()
    fwd_bytes = elem * nbytes * (visible + 1) + mask_bytes
    bwd_bytes = elem * nbytes * (2 * visible + 1)
    impls = {"megalite": ours, "eager": eager}
    if compile_baselines:
        impls["compile"] = torch.compile(eager)
    return _time_impls(impls, x, measure, fwd_bytes, bwd_bytes)


def bench_norm(kind, rows, h, dtype, device, measure, compile_baselines):
    x = torch.randn(rows, h, dtype=dtype, device=device, requires_grad=True)
    w = torch.randn(h, dtype=dtype, device=device, requires_grad=True)
    if kind == "layer_norm":
        b = torch.randn(h, dtype=dtype, device=device, requires_grad=True)
        ours = lambda t: ops.layer_norm(t, w, b, 1e-5)  # noqa: E731
        eager = lambda t: F.layer_norm(t, (h,), w, b, 1e-5)  # noqa: E731
    else:
        ours = lambda t: ops.rms_norm(t, w, 1e-5)  # noqa: E731
        eager = lambda t: F.rms_norm(t, (h,), w, 1e-5)  # noqa: E731
    elem, nbytes = x.numel(), x.element_size()
    impls = {"megalite": ours, "eager": eager}
    if compile_baselines:
        impls["compile"] = torch.compile(eager)
    return _time_impls(impls, x, measure, 2 * elem * nbytes, 3 * elem * nbytes)


def _time_impls(impls, x, measure, fwd_bytes, bwd_bytes):
    out = {}
    for name, fn in impls.items():
        def forward():
            with torch.no_grad():
                fn(x)
        fwd = measure(forward)
        both = measure(fwd_bwd(fn, x))
        out[name] = {"fwd_ms": fwd, "fwd_bwd_ms": both, "fwd_gbs": fwd_bytes / (fwd * 1e-3) / 1e9,
                     "fwd_bwd_gbs": (fwd_bytes + bwd_bytes) / (both * 1e-3) / 1e9}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--quick", action="store_true", help="tiny shapes and few repetitions (checks the script)")
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile baselines")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    reps = args.reps or (3 if args.quick else 30)
    measure = timer(device, reps, warmup=1 if args.quick else 5)
    status = ops.kernels_available()
    if device.type == "cuda" and not status:
        sys.exit(f"bench_kernels: the fused kernels cannot run: {status.reason}")
    compile_baselines = not args.no_compile and not (args.quick and device.type == "cpu")
    copy_gbs = copy_bandwidth(device, measure, (1 << 16) if args.quick else (1 << 30))
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results = {"device": device_name, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
               "dtype": args.dtype, "kernels": str(status), "copy_gbs": copy_gbs, "cases": []}
    print(f"{device_name}, torch {torch.__version__}, {args.dtype}; {status}; copy bandwidth {copy_gbs:.0f} GB/s")
    header = ("| case | shape | megalite fwd ms | fwd GB/s (% copy) | vs eager | vs compile | fwd+bwd ms | "
              "fwd+bwd GB/s (% copy) | vs eager | vs compile |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    cases = [("softmax", c) for c in softmax_cases(args.quick)] + [("norm", c) for c in norm_cases(args.quick)]
    for family, case in cases:
        if family == "softmax":
            kind, b, heads, s = case
            timings = bench_softmax(kind, b, heads, s, dtype, device, measure, compile_baselines)
            label, shape = f"{kind} softmax", f"b={b} heads={heads} s={s}"
        else:
            kind, rows, h = case
            timings = bench_norm(kind, rows, h, dtype, device, measure, compile_baselines)
            label, shape = kind, f"rows={rows} hidden={h}"
        ours = timings["megalite"]
        row = {"case": label, "shape": shape, **{f"{impl}_{k}": v for impl, t in timings.items() for k, v in t.items()}}
        cells = [label, shape]
        for phase in ("fwd", "fwd_bwd"):
            ms, gbs = ours[f"{phase}_ms"], ours[f"{phase}_gbs"]
            row[f"{phase}_copy_fraction"] = gbs / copy_gbs
            cells += [f"{ms:.3f}", f"{gbs:.0f} ({100 * gbs / copy_gbs:.0f}%)"]
            for base in ("eager", "compile"):
                if base in timings:
                    row[f"{phase}_speedup_vs_{base}"] = timings[base][f"{phase}_ms"] / ms
                    cells.append(f"{row[f'{phase}_speedup_vs_{base}']:.2f}x")
                else:
                    cells.append("-")
        results["cases"].append(row)
        print("| " + " | ".join(cells) + " |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
