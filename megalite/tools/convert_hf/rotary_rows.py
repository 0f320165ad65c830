"""Rotary rows between the two rope layouts. Interleaved rope (Megatron-LM's --rotary-interleaved,
DeepSeek's `rope_interleave`) rotates dims in pairs (0, 1), (2, 3), ...; Hugging Face's Llama family
rotates dim i with i + rotated / 2. The same function in the other layout takes the rows that make
each head's rotary dims in rotate-half order (the even dims, then the odd ones), as Meta's original
Llama weights are permuted for Hugging Face."""
from __future__ import annotations

from typing import Mapping

import torch


def rotate_half_order(d_r: int) -> torch.Tensor:
    """Interleaved rotary dims (pairs (0, 1), (2, 3), ...) in rotate-half order: even, then odd."""
    return torch.cat([torch.arange(0, d_r, 2), torch.arange(1, d_r, 2)])


def reorder_head_rows(w: torch.Tensor, block: int, starts: tuple[int, ...], d_r: int,
                   order: torch.Tensor) -> torch.Tensor:
    """w's rows (a weight's, or a bias's or norm's values) as blocks of `block`, the d_r rows from each
    of `starts` in every block taken in `order`."""
    blocks = w.reshape(-1, block, *w.shape[1:]).clone()
    for start in starts:
        blocks[:, start:start + d_r] = blocks[:, start:start + d_r][:, order]
    return blocks.reshape(w.shape)


def interleaved_to_rotate_half(tensors: Mapping[str, torch.Tensor], c) -> dict[str, torch.Tensor]:
    """A copy of a megalite state dict of a --rotary-interleaved model (config `c`) whose query and key
    rows, q/k biases and q/k norm weights are in rotate-half order: the same model once
    `rotary_interleaved` is off. Head rows: qkv [q | k | v] per head, q per head, kv [k | v] per group."""
    if c.multi_latent_attention:  # its q rows hold no rotary dims first (and the flag is refused with it)
        raise ValueError("interleaved_to_rotate_half is for the Llama family's attention, not multi-latent attention")
    d, d_r = c.head_dim, c.rotary_dims
    order = rotate_half_order(d_r)
    modules = {"qkv": (3 * d, (0, d)), "q": (d, (0,)), "kv": (2 * d, (0,)), "q_norm": (d, (0,)), "k_norm": (d, (0,))}
    out = dict(tensors)
    for key, value in tensors.items():
        *_, module, _param = key.split(".")
        if ".attention." in key and module in modules:
            out[key] = reorder_head_rows(value, *modules[module], d_r, order)
    return out
