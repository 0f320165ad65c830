"""One optimizer step of the optimizer choices against PyTorch's fused AdamW, in the same run.

The parameters of a Llama-shaped model's layers (fp32 masters with gradients), updated by: AdamW
(torch fused, the baseline), AdamW with bf16 moments (megalite.optim.low_precision_adam), and Muon for
the matrices (megalite.optim.muon, one device, --muon-fp32-matmul-prec medium and highest) with AdamW
for the rest. Rounds interleave the optimizers; each reports its median step and the ratio to AdamW's
median, and the bytes of optimizer state it holds (docs/BENCHMARKS.md).

    python scripts/benchmark_optimizers.py --hidden 512 --layers 2 --steps 5 --rounds 5
    python scripts/benchmark_optimizers.py --device cuda --hidden 2048 --layers 4   # scripts/gpu_checks.sh optim
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megalite.optim.low_precision_adam import LowPrecisionAdamW
from megalite.optim.muon import Matrix, Muon, MuonAndAdamW, Rows


def model_params(hidden: int, layers: int, ffn: int, device: str, groups_ratio: int = 4) -> tuple[list, list, list]:
    """(matrices, their q/k/v rows or None, vectors) of `layers` Llama layers at tp 1."""
    head = 64
    groups = max(1, hidden // head // groups_ratio)  # key groups of head_dim 64
    matrices, rows, vectors = [], [], []
    for _ in range(layers):
        shapes = [((hidden, hidden), None), ((2 * groups * head, hidden), Rows((head, head))), ((hidden, hidden), None),
                  ((2 * ffn, hidden), None), ((hidden, ffn), None)]
        for shape, row in shapes:
            matrices.append(torch.randn(shape, device=device) * 0.02)
            rows.append(row)
        vectors += [torch.ones(hidden, device=device), torch.ones(hidden, device=device)]
    for p in matrices + vectors:
        p.grad = torch.randn_like(p) * 1e-3
    return matrices, rows, vectors


def optimizers(matrices, rows, vectors) -> dict:
    group = lambda ps: [{"params": ps, "weight_decay": 0.1}]  # noqa: E731
    everything = matrices + vectors
    adam_kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    out = {"adamw (fused, baseline)": torch.optim.AdamW(group(everything), fused=True, **adam_kw),
           "adamw, bf16 moments": LowPrecisionAdamW(group(everything), exp_avg_dtype=torch.bfloat16,
                                                    exp_avg_sq_dtype=torch.bfloat16, **adam_kw)}
    for precision in ("medium", "highest"):
        muon = Muon(group(matrices), [Matrix([m], r) for m, r in zip(matrices, rows)], lr=0.02, momentum=0.95,
                    nesterov=False, steps=5, precision=precision, scale_mode="spectral", extra_scale=1.0,
                    tp_mode="blockwise")
        out[f"muon ({precision}) + adamw"] = MuonAndAdamW(muon, torch.optim.AdamW(group(vectors), fused=True,
                                                                                   **adam_kw))
    return out


def state_bytes(opt) -> int:
    states = opt.state.values() if not isinstance(opt, MuonAndAdamW) else [s for o in opt.optimizers
                                                                              for s in o.state.values()]
    return sum(t.numel() * t.element_size() for st in states for t in st.values() if torch.is_tensor(t) and t.dim())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=None, help="default 8/3 hidden, a multiple of 64")
    ap.add_argument("--steps", type=int, default=5, help="steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON to FILE")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ffn = args.ffn or int(8 * args.hidden / 3 / 64) * 64
    torch.manual_seed(0)
    runs = {}
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for name, opt in optimizers(*model_params(args.hidden, args.layers, ffn, args.device)).items():
        opt.step()  # the states exist, first-step work done
        runs[name] = (opt, [])
    for _ in range(args.rounds):  # interleaved: a slow moment of the machine falls on every optimizer
        for name, (opt, times) in runs.items():
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                opt.step()
            sync()
            times.append((time.perf_counter() - start) / args.steps)
    base = statistics.median(runs["adamw (fused, baseline)"][1])
    rows = [{"optimizer": name, "ms_per_step": 1e3 * statistics.median(t), "ratio": statistics.median(t) / base,
             "state_bytes": state_bytes(opt)} for name, (opt, t) in runs.items()]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "hidden": args.hidden, "layers": args.layers, "ffn": ffn,
                       "threads": torch.get_num_threads(), "rows": rows}, f)
    print(f"{args.device}: hidden {args.hidden}, {args.layers} layers, ffn {ffn}, {torch.get_num_threads()} threads; median of "
          f"{args.rounds} rounds of {args.steps} steps")
    print(f"{'optimizer':28} {'ms/step':>9} {'x adamw':>8} {'state bytes':>12}")
    for r in rows:
        print(f"{r['optimizer']:28} {r['ms_per_step']:9.2f} {r['ratio']:8.2f} {r['state_bytes']:12,}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
