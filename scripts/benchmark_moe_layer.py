#!/usr/bin/env python
"""megalite's MoE layer, forward + backward, against a plain PyTorch MoE at the same shapes and
parameters, and megalite's grouped expert GEMM against its per-expert loop; one CPU thread.

    python scripts/benchmark_moe_layer.py --size tiny --rounds 12
    python scripts/benchmark_moe_layer.py --size 124m --compare grouped --json grouped-124m.json
    python scripts/benchmark_moe_layer.py --quick                          # a smoke run (the tests)

--compare layer (default): megalite's `MoELayer` (router in fp32, top-k then softmax, the
all-to-all dispatcher at EP 1, gated SiLU experts through `grouped_linear`) against `PlainMoE` below:
the same routing, then a loop over experts in the style of transformers' eager Mixtral/Qwen-MoE
experts (each expert's tokens found with `torch.where`, gathered, run through its MLP, weighted and
`index_add_`ed back). Both hold the same weights and get the same input and output gradient.
--compare grouped: the same megalite layer with `grouped_linear` forced onto PyTorch's grouped GEMM
(`torch.nn.functional.grouped_mm`) against it forced onto its loop of `torch.mm`s: the choice
`megalite.models.moe.experts` makes on a CPU.

Method as scripts/benchmark_step.py: interleaved ABBA rounds in one process, CPU time per call from
time.process_time(), the median and range of the per-round ratio A / B (A megalite, or the grouped
GEMM). Shapes: tiny 2,048 tokens (batch 8 x sequence 256), hidden 256, 8 experts of width 512,
top-2; 124m 4,096 tokens (4 x 1,024), hidden 768, 8 experts of width 1,536, top-2.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from benchmark_step import Side, abba_rounds, device_string, git_state  # noqa: E402

SIZES = {  # tokens, hidden, experts, expert width, top-k
    "tiny": (2048, 256, 8, 512, 2),
    "124m": (4096, 768, 8, 1536, 2),
    "quick": (64, 32, 4, 32, 2),
}


class PlainMoE(torch.nn.Module):
    """A MoE MLP as plain PyTorch (and transformers' eager experts) writes it."""

    def __init__(self, router: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, topk: int):
        super().__init__()
        self.router = torch.nn.Parameter(router.detach().clone())
        self.fc1 = torch.nn.Parameter(fc1.detach().clone())  # [E, 2F, H]: gate rows, then up rows
        self.fc2 = torch.nn.Parameter(fc2.detach().clone())  # [E, H, F]
        self.topk = topk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        logits = F.linear(tokens.float(), self.router)
        top, indices = logits.topk(self.topk, dim=-1)
        weights = top.softmax(dim=-1)
        out = torch.zeros_like(tokens)
        for e in range(self.fc1.shape[0]):
            rows, slot = torch.where(indices == e)
            if rows.numel() == 0:
                continue
            gate, up = F.linear(tokens[rows], self.fc1[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.fc2[e]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out.view_as(x)


def megalite_layer(hidden: int, experts: int, width: int, topk: int):
    from megalite.models.config import TransformerConfig
    from megalite.models.moe.layer import MoELayer

    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4, num_moe_experts=experts,
                               moe_router_topk=topk, moe_ffn_hidden_size=width, gated_linear_unit=True,
                               activation="silu", normalization="rmsnorm", add_bias_linear=False)
    torch.manual_seed(0)
    return MoELayer(config, layer_number=0)


def side(name: str, layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, path: str | None = None) -> Side:
    """One forward + backward of `layer` per step; `path` forces grouped_linear's choice."""
    from megalite.models.moe import experts

    choose = experts._grouped_mm_applies

    def step():
        if path is not None:
            experts._grouped_mm_applies = (lambda a, b: True) if path == "grouped" else (lambda a, b: False)
        try:
            x.grad = None
            layer.zero_grad(set_to_none=True)
            out = layer(x)
            out.backward(grad)
        finally:
            experts._grouped_mm_applies = choose
        return out.detach().float().mean()

    return Side(name, step, sum(p.numel() for p in layer.parameters()))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("tiny", "124m"), default="tiny")
    p.add_argument("--compare", choices=("layer", "grouped"), default="layer")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=2, help="calls timed back to back in each A or B slot")
    p.add_argument("--quick", action="store_true", help="tiny shapes, two rounds: a smoke run")
    p.add_argument("--json", help="write the result here")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    size = "quick" if a.quick else a.size
    tokens, hidden, experts, width, topk = SIZES[size]
    rounds = 2 if a.quick else a.rounds
    layer = megalite_layer(hidden, experts, width, topk).train()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens // 8 if size != "quick" else tokens, 8 if size != "quick" else 1, hidden,
                    generator=g).requires_grad_(True)
    grad = torch.randn(x.shape, generator=g)
    if a.compare == "layer":
        plain = PlainMoE(layer.router.weight, layer.experts.fc1_weight, layer.experts.fc2_weight, topk)
        with torch.no_grad():  # the same function: checked before timing
            want = plain(x)
        got = layer(x).detach()
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()
        sides = side("megalite", layer, x, grad), side("plain", plain, x, grad)
    else:
        sides = side("grouped", layer, x, grad, "grouped"), side("loop", layer, x, grad, "loop")
    for s in (*sides, *sides):  # warm-up
        s.step()
    rows = abba_rounds(*sides, rounds=rounds, steps=a.steps)
    ratios = [r["ratio"] for r in rows]
    a_ms, b_ms = (statistics.median(r[f"{s.name}_ms"] for r in rows) for s in sides)
    result = {"compare": a.compare, "size": size, "tokens": tokens, "hidden": hidden, "experts": experts,
              "width": width, "topk": topk, "a": sides[0].name, "b": sides[1].name, "a_ms": a_ms, "b_ms": b_ms,
              "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
              "rounds": rounds, "device": device_string(), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "git": git_state()}
    print(f"{a.compare} {size}: {sides[0].name} {a_ms:.2f} ms, {sides[1].name} {b_ms:.2f} ms, ratio "
          f"{result['ratio_median']:.3f} ({result['ratio_min']:.3f}-{result['ratio_max']:.3f}, {rounds} rounds)")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
