"""Activation memory per transformer layer, from Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models" (arXiv:2205.05198), section 4.

Bytes stored for backward by one layer with 16-bit activations and 1-byte dropout masks, s the
sequence length, b the micro-batch, h the hidden size, a the heads, t the tensor-parallel size:

    no parallelism                        s*b*h * (34 + 5*a*s/h)
    tensor parallel                       s*b*h * (10 + 24/t + 5*a*s/(h*t))
    tensor + sequence parallel            s*b*h * (34 + 5*a*s/h) / t
    selective recompute (attention core)  drops the 5*a*s/h term: s*b*h * (10 + 24/t), or 34*s*b*h/t with SP
    full recompute                        only the layer's input: 2*s*b*h (/t with SP)

The 5*a*s/h term is the attention core: softmax output (2*a*s^2*b), its dropout mask (a*s^2*b) and
the dropout output (2*a*s^2*b). Fused attention (SDPA flash) never stores it at all.
"""
from __future__ import annotations


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                               recompute: str = "none") -> float:
    sbh = float(s) * b * h
    attention_core = 5.0 * a * s / h
    if recompute == "full":
        return 2.0 * sbh / (t if sequence_parallel else 1)
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    core = attention_core if recompute == "none" else 0.0
    if sequence_parallel:
        return sbh * (34.0 + core) / t
    return sbh * (10.0 + 24.0 / t + core / t)
