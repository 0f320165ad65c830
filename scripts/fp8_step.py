#!/usr/bin/env python
"""FP8 against the model dtype on one device: forward + backward of a stack of transformer layers
shaped like GPT 1.3B and Llama 3 8B, each recipe timed in interleaved rounds with bf16 in the same run.

    python scripts/fp8_step.py --device cuda --json fp8_step.json     # on a GPU (scripts/gpu_checks.sh fp8)
    python scripts/fp8_step.py --tiny                                  # CPU smoke test: gpt-tiny shapes

It prints per shape and recipe the median milliseconds of a step, the TFLOP/s of the linear layers'
GEMMs and attention (Megatron's count: 6 x linear parameters x tokens plus attention's score and
value products), and the ratio to bf16's step time measured in the same run. On a CPU the tiled
recipes are emulated and every FP8 GEMM is slower than bf16's: only the GPU's figures mean speed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"gpt-1.3b": "gpt-1.3b", "llama-3-8b": "llama-3-8b"}
RECIPES = ("bf16", "tensorwise", "delayed", "blockwise", "mxfp8")


def build(preset: str, layers: int, device, recipe: str | None):
    from megalite.models import preset as make
    from megalite.models.fp8 import enable_fp8
    from megalite.models.transformer import TransformerLayer
    from megalite.precision.recipes import Recipe

    config = make(preset, num_layers=layers, params_dtype=torch.bfloat16)
    stack = torch.nn.ModuleList(TransformerLayer(config, i, seed=0, device=device) for i in range(layers))
    if recipe is not None:
        enable_fp8(stack, Recipe(recipe, "hybrid"), range(layers))
    return config, stack


def flops(config, layers: int, tokens: int, seq: int) -> float:
    linear = sum(p.numel() for name, p in _one_layer_params(config) if p.dim() == 2)
    attention = 2 * 2 * tokens * seq * config.num_attention_heads * config.head_dim  # q k^T and p v, forward
    return layers * (6 * linear * tokens + 3 * attention)


def _one_layer_params(config):
    from megalite.models.transformer import TransformerLayer

    return TransformerLayer(config.replace(num_layers=1), 0, seed=0, device="meta").named_parameters()


def time_steps(stack, x: torch.Tensor, steps: int, device) -> list[float]:
    from megalite.models.fp8 import close_delayed_scaling

    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        h = x
        for layer in stack:
            h = layer(h)
        h.float().square().mean().backward()
        close_delayed_scaling([stack])  # a step's end, as training closes it (no collective on one device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument("--tiny", action="store_true", help="gpt-tiny shapes, 2 rounds of 1 step (a smoke test)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    shapes = {"gpt-tiny": "gpt-tiny"} if args.tiny else {s: SHAPES[s] for s in args.shapes}
    seq, batch = (32, 2) if args.tiny else (args.seq_length, args.micro_batch_size)
    rounds, steps = (2, 1) if args.tiny else (args.rounds, args.steps)
    results = []
    for name, preset in shapes.items():
        stacks = {r: build(preset, args.layers, device, None if r == "bf16" else r) for r in args.recipes}
        config = next(iter(stacks.values()))[0]
        x = torch.randn(seq, batch, config.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
        for _, stack in stacks.values():  # warm-up: first calls, allocator, delayed scaling's first scales
            time_steps(stack, x, 1, device)
        times = {r: [] for r in stacks}
        for _ in range(rounds):  # interleaved, so drift hits every recipe alike
            for r, (_, stack) in stacks.items():
                times[r] += time_steps(stack, x, steps, device)
        work = flops(config, args.layers, seq * batch, seq)
        base = statistics.median(times["bf16"]) if "bf16" in times else None
        for r, t in times.items():
            ms = statistics.median(t) * 1e3
            row = {"shape": name, "recipe": r, "ms": ms, "tflops": work / (ms / 1e3) / 1e12,
                   "ratio_to_bf16": None if base is None else ms / (base * 1e3), "device": str(device),
                   "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
            results.append(row)
            ratio = "" if row["ratio_to_bf16"] is None else f"  {row['ratio_to_bf16']:.3f} of bf16's time"
            print(f"{name:12s} {r:10s} {ms:9.2f} ms  {row['tflops']:8.2f} TFLOP/s{ratio}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
