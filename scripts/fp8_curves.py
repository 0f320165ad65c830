#!/usr/bin/env python
"""Loss curves of FP8 training against the model dtype's, on the embedded corpus, one process.

    python scripts/fp8_curves.py                                  # llama-tiny, moe-tiny, deepseek-tiny;
                                                                  # bf16 and each recipe; 200 steps
    python scripts/fp8_curves.py --models llama-tiny --iters 20 --json out.json --svg out.svg

Every run starts from the same seed and reads the same batches; only the GEMMs' precision differs.
It prints, per model, each recipe's final loss (the mean of the last 10 steps) and its gap to
bf16's, and writes the curves as JSON and as an SVG picture (no plotting library needed), for
docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ("llama-tiny", "moe-tiny", "deepseek-tiny")
RUNS = {"bf16": [], **{r: ["--fp8-format", "hybrid", "--fp8-recipe", r] for r in
                       ("tensorwise", "delayed", "blockwise", "mxfp8")}}
COLOURS = {"bf16": "#000000", "tensorwise": "#1f77b4", "delayed": "#ff7f0e", "blockwise": "#2ca02c",
           "mxfp8": "#d62728"}


def losses(model: str, extra: list[str], iters: int, common: list[str] = (), lr: float = 1e-3) -> list[float]:
    from megalite import arguments
    from megalite.training import pretrain

    import pretrain_gpt

    argv = ["--model", model, "--bf16", "--train-iters", str(iters), "--log-interval", "1", "--eval-interval",
            str(10 ** 9), "--global-batch-size", "8", "--micro-batch-size", "4", "--seq-length", "128",
            "--lr", str(lr), "--min-lr", str(lr / 10), "--lr-warmup-iters", str(max(1, iters // 10)), *common, *extra]
    cfg = arguments.build_parser("fp8_curves", default_model="gpt-tiny").parse_args(argv)
    return [r["loss"] for r in pretrain(cfg, pretrain_gpt.task()).records]


def final(curve: list[float]) -> float:
    return statistics.fmean(curve[-10:])


def _smoothed_gap(curve: list[float], base: list[float], window: int = 10) -> list[float]:
    """100 * (run - bf16) / bf16 per step, each a mean over the last `window` steps."""
    gaps = [100 * (a - b) / b for a, b in zip(curve, base)]
    return [statistics.fmean(gaps[max(0, i - window + 1):i + 1]) for i in range(len(gaps))]


def _panel(x0: float, y0: float, w: float, h: float, title: str, lines: dict[str, list[float]]) -> list[str]:
    values = [v for c in lines.values() for v in c]
    lo, hi = min(values), max(values)
    steps = max(len(c) for c in lines.values())
    left = 46

    def point(step, value):
        x = x0 + left + (w - left - 10) * step / max(1, steps - 1)
        y = y0 + 16 + (h - 36) * (hi - value) / max(hi - lo, 1e-9)
        return f"{x:.1f},{y:.1f}"

    out = [f'<text x="{x0 + w / 2}" y="{y0 + 11}" text-anchor="middle">{title}</text>',
           f'<rect x="{x0 + left}" y="{y0 + 16}" width="{w - left - 10}" height="{h - 36}" fill="none" stroke="#999"/>',
           f'<text x="{x0 + left - 3}" y="{y0 + 20}" text-anchor="end">{hi:.3g}</text>',
           f'<text x="{x0 + left - 3}" y="{y0 + h - 20}" text-anchor="end">{lo:.3g}</text>',
           f'<text x="{x0 + w - 10}" y="{y0 + h - 8}" text-anchor="end">step {steps}</text>']
    for name, curve in lines.items():
        pts = " ".join(point(i, v) for i, v in enumerate(curve))
        out.append(f'<polyline points="{pts}" fill="none" stroke="{COLOURS[name]}" stroke-width="1"/>')
    return out


def svg(curves: dict[str, dict[str, list[float]]]) -> str:
    """Per model: the loss curves, and below them each run's gap to bf16 in percent (10-step mean)."""
    w, h = 330, 200
    width = max(w * len(curves), 100 * len(COLOURS))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{2 * h + 24}" '
             f'font-family="sans-serif" font-size="11">', f'<rect width="{width}" height="{2 * h + 24}" fill="#fff"/>']
    for i, (model, runs) in enumerate(curves.items()):
        parts += _panel(i * w, 0, w, h, f"{model}: loss", runs)
        if "bf16" in runs:
            gaps = {n: _smoothed_gap(c, runs["bf16"]) for n, c in runs.items()}
            parts += _panel(i * w, h, w, h, f"{model}: gap to bf16 (%)", gaps)
    for j, (name, colour) in enumerate(COLOURS.items()):
        parts.append(f'<text x="{10 + 100 * j}" y="{2 * h + 16}" fill="{colour}">{name}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--json", type=Path)
    p.add_argument("--svg", type=Path)
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (cosine to a tenth, warm-up a tenth)")
    p.add_argument("--train-args", default="", help="flags given to every run, e.g. '--mock-data'")
    args = p.parse_args(argv)
    common = args.train_args.split()
    curves = {m: {r: losses(m, RUNS[r], args.iters, common, args.lr) for r in args.runs} for m in args.models}
    for model, runs in curves.items():
        base = final(runs["bf16"]) if "bf16" in runs else None
        for name, curve in runs.items():
            gap = "" if base is None else f"  gap to bf16 {100 * (final(curve) - base) / base:+.2f}%"
            print(f"{model:14s} {name:10s} first {curve[0]:.4f}  final (last 10) {final(curve):.4f}{gap}")
    if args.json:
        args.json.write_text(json.dumps(curves))
    if args.svg:
        args.svg.write_text(svg(curves))
    return curves


if __name__ == "__main__":
    main()
