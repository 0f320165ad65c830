"""Activation memory of one GPT layer, measured against the formula of Korthikanti et al. 2022.

    python scripts/activation_memory.py                 # on the GPU if there is one, else CPU
    python scripts/activation_memory.py --device cpu --json out.json

For each shape (s, b, h, a) and recompute mode (none / selective / full) it builds one
TransformerLayer (tp=1, bf16, dropout 0.1, explicit-softmax attention so the attention core is
materialized as the formula assumes) and runs its forward on an input that stands for the previous
layer's output. What the forward leaves behind for backward is measured:

- cuda: bytes allocated after the forward minus before it (the layer's output stands in for the
  input it keeps, which was allocated before);
- cpu: bytes of the distinct tensors autograd saved for backward (parameters excluded), through
  saved-tensor hooks. It sees nothing inside a checkpoint, so full recompute is reported as the
  input the checkpoint keeps.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megalite.models import TransformerConfig, activation_bytes_per_layer  # noqa: E402
from megalite.models.transformer import TransformerLayer, run_layers  # noqa: E402

SHAPES = [(1024, 8, 1024, 16), (2048, 4, 1024, 16), (2048, 4, 2048, 16), (1024, 4, 2048, 32)]
CPU_SHAPES = [(256, 2, 256, 4), (512, 1, 256, 8), (256, 2, 512, 8)]


def build_layer(s, h, a, recompute, device, dtype, **arch):
    """arch: TransformerConfig fields of another architecture (e.g. the Llama family's)."""
    config = TransformerConfig(**{**dict(num_layers=1, hidden_size=h, num_attention_heads=a, vocab_size=128,
                                         max_position_embeddings=s, hidden_dropout=0.1, attention_dropout=0.1,
                                         recompute=recompute, attention_backend="torch"), **arch})
    return TransformerLayer(config, 0, seed=0, device=device).to(dtype).train(), config


def measure(s, b, h, a, recompute, device, dtype=torch.bfloat16, **arch) -> int:
    layer, config = build_layer(s, h, a, recompute, device, dtype, **arch)
    stream = torch.float32 if config.fp32_residual_connection else dtype  # the previous layer's output
    x = torch.randn(s, b, h, device=device, dtype=stream, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = run_layers([layer], x, None, config, training=True)
        torch.cuda.synchronize()
        used = torch.cuda.memory_allocated() - before
        del y
        return used
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_layers([layer], x, None, config, training=True)
    if recompute == "full":  # the checkpoint keeps the layer's input to recompute from
        seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    return sum(seen.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    device = torch.device("cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    shapes = SHAPES if device.type == "cuda" else CPU_SHAPES
    rows = []
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, bf16, tp=1, MiB per layer")
    print(f"{'s':>5} {'b':>3} {'h':>5} {'a':>3} | {'mode':>9} | {'measured':>9} {'formula':>9} {'ratio':>6}")
    for s, b, h, heads in shapes:
        by_mode = {}
        for mode in ("none", "selective", "full"):
            measured = measure(s, b, h, heads, mode, device)
            formula = activation_bytes_per_layer(s, b, h, heads, recompute=mode)
            by_mode[mode] = (measured, formula)
            rows.append({"s": s, "b": b, "h": h, "a": heads, "recompute": mode, "measured_bytes": measured,
                         "formula_bytes": formula, "ratio": measured / formula, "device": str(device)})
            print(f"{s:>5} {b:>3} {h:>5} {heads:>3} | {mode:>9} | {measured / 2**20:9.1f} "
                  f"{formula / 2**20:9.1f} {measured / formula:6.2f}")
        saved = by_mode["none"][0] - by_mode["selective"][0]
        predicted = by_mode["none"][1] - by_mode["selective"][1]
        rows[-1]["selective_saving_vs_formula"] = saved / predicted
        print(f"{'':>20} selective recompute saves {saved / 2**20:.1f} MiB = {100 * saved / predicted:.0f}% "
              f"of the formula's {predicted / 2**20:.1f} MiB")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
