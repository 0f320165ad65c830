#!/usr/bin/env python
"""Full training steps on one GPU: megalite's GPT against a plain PyTorch GPT of the same shape.

    python scripts/benchmark_gpt.py --json $OUT/gpt.json                 # the H100 run
    python scripts/benchmark_gpt.py --device cpu --quick                 # a smoke run of the script

A step is forward, backward, gradient-norm clipping and the AdamW update, in bf16. megalite runs
megalite.training.TrainStep (bf16 parameters, fp32 gradient buffer and master weights, fused
AdamW); the plain model is a compact GPT-2 written here (SDPA causal attention, autocast bf16 over
fp32 parameters, fused AdamW), timed eager and under torch.compile. For each: milliseconds per step
(CUDA events, after warm-up), tokens/s, model TFLOP/s by Megatron's formula
72*B*s*L*h^2*(1 + s/(6h) + V/(12*L*h)), MFU against the datasheet peak (989 TFLOP/s for the H100
SXM bf16) and against the bf16 matmul peak measured in the same run, and peak memory. Then it
runs pretrain_gpt.py itself for the same shape and reports the MFU its training log printed, to
check that the log agrees with the benchmark.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megalite.metrics import gpt_flops_per_iteration  # noqa: E402
from megalite.models import PRESETS  # noqa: E402

DATASHEET_TFLOPS = 989.0  # H100 SXM dense bf16, the convention of Megatron-LM and torchtitan
SHAPES = {  # preset: (micro-batch, sequence length), as the issue fixes them
    "gpt2-350m": (8, 1024),
    "gpt-1.3b": (4, 2048),
}
VOCAB = 50304


class PlainBlock(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    """GPT-2 in plain PyTorch: learned positions, pre-LN blocks, tied output embedding."""

    def __init__(self, layers: int, h: int, heads: int, vocab: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(PlainBlock(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids, labels):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.tok.weight)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def matmul_peak_tflops(device, quick: bool) -> float:
    n = 512 if quick else 8192
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n ** 3 / (time_steps(lambda: a @ b, device, 2, 3 if quick else 20) * 1e-3) / 1e12


def time_steps(step, device, warmup: int, iters: int) -> float:
    """Mean milliseconds of step() over `iters` calls after `warmup` calls."""
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - t0) * 1e3 / iters


def reset_memory(device):
    gc.collect()  # the previous run's model and optimizer, if a cycle still holds them
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None


def bench_plain(shape, device, compiled: bool, warmup: int, iters: int, fp32: bool = False) -> float:
    layers, h, heads, mb, seq = shape
    reset_memory(device)
    torch.manual_seed(0)
    model = PlainGPT(layers, h, heads, VOCAB, seq).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    forward = torch.compile(model) if compiled else model
    ids = torch.randint(0, VOCAB, (mb, seq), device=device)
    labels = ids.roll(-1, 1)
    amp = contextlib.nullcontext() if fp32 else torch.autocast(device.type, dtype=torch.bfloat16)

    def step():
        with amp:
            loss = forward(ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    ms = time_steps(step, device, warmup, iters)
    del model, opt, forward
    return ms


def megalite_args(preset: str, mb: int, seq: int, extra: list[str], iters: int, quick: bool,
                  fp32: bool = False) -> list[str]:
    args = ["--model", preset, "--micro-batch-size", str(mb), "--global-batch-size", str(mb), "--seq-length",
            str(seq), *([] if fp32 else ["--bf16"]), "--mock-data", "--train-iters", str(iters), "--eval-interval", "0",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--no-progress-bar"]
    if not quick:
        args += ["--vocab-size", str(VOCAB)]
    return args + extra


def bench_megalite(preset, mb, seq, extra, device, warmup, iters, quick, global_batch: int | None = None,
                   fp32: bool = False) -> float:
    """Milliseconds per megalite.training.TrainStep, over the same pieces pretrain() builds
    (global_batch / mb micro-batches a step; default one)."""
    import pretrain_gpt
    from megalite import arguments, training
    from megalite.pipeline.schedules import build_program

    reset_memory(device)
    args = arguments.build_parser("benchmark", "gpt-tiny").parse_args(
        megalite_args(preset, mb, seq, extra, warmup + iters, quick, fp32) + ["--global-batch-size",
                                                                              str(global_batch or mb)])
    task = pretrain_gpt.task()
    config, _, _ = training.setup(args, 1)
    chunks = training.build_model_chunks(task, config, args, device)
    buffers, optimizer = training.build_optimizer(args, chunks)
    data, _ = task.build_data(config, args)
    train_step = training.TrainStep(build_program(1, 0, args.training.global_batch_size // mb, None), chunks,
                                    task.forward_step, (seq, mb, config.hidden_size),
                                    torch.float32 if fp32 else torch.bfloat16, buffers, optimizer, clip_grad=1.0)
    for c in chunks:
        c.train()
    counter = iter(range(10 ** 9))

    def step():
        batches = training.micro_batches(data, next(counter), args, 1, 0, device)
        train_step(batches, training.global_normalizer(batches, args.training.global_batch_size, None), lr=1e-4)

    ms = time_steps(step, device, warmup, iters)
    del chunks, buffers, optimizer, train_step
    return ms


def log_mfu(preset, mb, seq, extra, warmup, iters, quick, peak) -> float | None:
    """The MFU pretrain_gpt.py's own log reports for the same run (its last logged window)."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        cmd = [sys.executable, str(ROOT / "pretrain_gpt.py"),
               *megalite_args(preset, mb, seq, extra, warmup + iters, quick),
               "--log-interval", str(iters), "--metrics-file", str(metrics), "--peak-tflops", str(peak)]
        # A process group of its own: not this process's rendezvous port.
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**env, "MEGALITE_QUIET": "1"})
        if r.returncode != 0:
            raise RuntimeError(f"pretrain_gpt.py failed:\n{r.stderr[-3000:]}")
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        return records[-1]["mfu"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    # GPT-2-shaped presets only: the plain PyTorch baseline is a GPT-2 and the FLOPs are its formula's.
    p.add_argument("--presets", nargs="+", default=list(SHAPES),
                   choices=[n for n in PRESETS if n.startswith("gpt")])
    p.add_argument("--variants", nargs="+", default=["eager", "compile"],
                   help="eager: megalite as configured by default; compile: megalite --torch-compile")
    p.add_argument("--no-plain-compile", action="store_true", help="leave out the plain torch.compile baseline")
    p.add_argument("--no-log-check", action="store_true", help="do not run pretrain_gpt.py for the log's MFU")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="gpt-tiny shapes, a few steps (checks the script)")
    p.add_argument("--fp32", action="store_true",
                   help="fp32 for both (no autocast, no --bf16): the fair comparison on a CPU, where bf16 is emulated")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    warmup = args.warmup or (1 if args.quick else 10)
    iters = args.iters or (2 if args.quick else 20)
    presets = ["gpt-tiny"] if args.quick else args.presets
    matmul_peak = matmul_peak_tflops(device, args.quick)
    peak = DATASHEET_TFLOPS if device.type == "cuda" else matmul_peak
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results = {"device": name, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
               "datasheet_tflops": peak, "matmul_peak_tflops": matmul_peak, "runs": []}
    matmul_dtype = "bf16" if device.type == "cuda" else "fp32"
    print(f"{name}, torch {torch.__version__}; measured {matmul_dtype} matmul peak {matmul_peak:.3g} TFLOP/s")
    print("| model | implementation | ms/step | tokens/s | TFLOP/s | MFU (datasheet) | MFU (matmul peak) | "
          "peak memory GiB | vs plain eager |")
    print("|---|---|---|---|---|---|---|---|---|")
    from megalite.models import preset as preset_config
    for preset in presets:
        c = preset_config(preset)
        mb, seq = SHAPES.get(preset, (2, 64))
        vocab = c.vocab_size if args.quick else VOCAB
        flops = gpt_flops_per_iteration(mb, seq, c.num_layers, c.hidden_size, vocab)
        shape = (c.num_layers, c.hidden_size, c.num_attention_heads, mb, seq)
        runs = [("plain eager", lambda: bench_plain(shape, device, False, warmup, iters, args.fp32))]
        if not args.no_plain_compile and not (args.quick and device.type == "cpu"):
            runs.append(("plain torch.compile", lambda: bench_plain(shape, device, True, warmup, iters, args.fp32)))
        for v in args.variants:
            extra = ["--torch-compile"] if v == "compile" else []
            runs.append((f"megalite {v}", lambda extra=extra: bench_megalite(preset, mb, seq, extra, device, warmup,
                                                                              iters, args.quick, fp32=args.fp32)))
        base_ms = None
        for label, run in runs:
            ms = run()
            tflops = flops / (ms * 1e-3) / 1e12
            row = {"model": preset, "implementation": label, "ms_per_step": ms, "tokens_per_sec": mb * seq / (ms * 1e-3),
                   "tflops": tflops, "mfu_datasheet": tflops / peak, "mfu_matmul_peak": tflops / matmul_peak,
                   "peak_memory_gib": peak_memory_gib(device)}
            base_ms = base_ms or ms
            row["speedup_vs_plain_eager"] = base_ms / ms
            results["runs"].append(row)
            mem = "-" if row["peak_memory_gib"] is None else f"{row['peak_memory_gib']:.1f}"
            print(f"| {preset} | {label} | {ms:.1f} | {row['tokens_per_sec']:.0f} | {tflops:.3g} | "
                  f"{100 * row['mfu_datasheet']:.1f}% | {100 * row['mfu_matmul_peak']:.1f}% | {mem} | "
                  f"{row['speedup_vs_plain_eager']:.2f}x |", flush=True)
        if not args.no_log_check:
            extra = ["--torch-compile"] if "compile" in args.variants else []
            label = "megalite compile" if extra else f"megalite {args.variants[0]}"
            bench = next(r for r in results["runs"] if r["model"] == preset and r["implementation"] == label)
            logged = log_mfu(preset, mb, seq, extra, warmup, iters, args.quick, peak)
            bench["log_mfu"] = logged
            bench["log_mfu_difference_points"] = 100 * (logged - bench["mfu_datasheet"])
            print(f"  {preset}: the training log's MFU {100 * logged:.1f}% vs the benchmark's "
                  f"{100 * bench['mfu_datasheet']:.1f}% ({bench['log_mfu_difference_points']:+.1f} points)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
