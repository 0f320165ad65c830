"""Sliding-window attention: Megatron-LM's --window-size and --window-attn-skip-freq (Mistral's,
Qwen2's and gpt-oss's local attention).

A window (left, right) lets the query at position i attend to keys at positions i - left .. i + right,
-1 leaving that side unbounded (flash attention's and Megatron-Core's convention), within what the
model's own mask allows: a causal model's right side is always 0, as Transformer Engine sets it for
a causal mask. Hugging Face's `sliding_window` W is the window (W - 1, 0): a query sees itself and the
W - 1 keys before it.

Which layers are windowed is Megatron-Core's `is_layer_window_attention`: every layer without a skip
frequency; with an int N, all but every N-th layer (1-based: layers N, 2N, ... attend to the whole
context); with a list, one 1 (windowed) or 0 (full) per layer.

Every attention path applies the same rule: the explicit, fused-softmax and PyTorch-fused backends by a boolean band
mask (`band_mask`, made once a process for every windowed layer of a shape), packed documents'
per-document attention and flash's variable-length kernel by its `window_size`, ring context
parallelism by each block's global positions (blocks wholly outside the window are skipped), the
all-to-all by the band over the whole sequence, and generation by the slots of the key/value cache.
"""
from __future__ import annotations

import re

import torch

from megalite.models.layer_pattern import layer_pattern

Window = tuple[int, int]


def parse_window(value) -> Window | None:
    """A window from Megatron-LM's spellings "4096,0" and "(4096,0)", a single number (the left side;
    the right 0), a pair, or None."""
    if value is None:
        return None
    if isinstance(value, str):
        body = value.strip().strip("()[]")
        if not re.fullmatch(r"\s*-?\d+\s*(,\s*-?\d+\s*)?", body):
            raise ValueError(f"--window-size {value!r} is not a window: give LEFT,RIGHT (e.g. 4096,0; -1 for no "
                             f"bound on a side) or LEFT alone")
        value = [int(v) for v in body.split(",")]
    elif isinstance(value, int):
        value = [value]
    value = list(value)
    if len(value) == 1:
        value.append(0)
    if len(value) != 2 or any(not isinstance(v, int) or v < -1 for v in value):
        raise ValueError(f"--window-size {value} must be two integers >= -1 (LEFT,RIGHT; -1: no bound on that side)")
    return int(value[0]), int(value[1])


def window_pattern(skip_freq, num_layers: int) -> list[int]:
    """One 1 (windowed) or 0 (full attention) per layer, 0-based: Megatron-Core's rule on its 1-based
    layer numbers. `skip_freq`: None (every layer), an int N (layers N, 2N, ... full), a list, or its
    Megatron-LM spelling ("[1,1,1,0]*3", "([1]*3+[0]*1)")."""
    if skip_freq is None:
        return [1] * num_layers

    def every(n: int, layers: int) -> list[int]:
        if n < 1:
            raise ValueError(f"--window-attn-skip-freq must be >= 1, got {n}")
        return [int((i + 1) % n != 0) for i in range(layers)]
    return layer_pattern(skip_freq, num_layers, "--window-attn-skip-freq", every,
                         "1 (sliding window) or 0 (full attention)")


def normalized_window(config) -> tuple[Window | None, list[int] | None]:
    """A TransformerConfig's (window_size, window_attn_skip_freq) as it keeps them: a (left, right)
    pair, and one 0/1 per layer (None where every layer is windowed); refused where they do not fit."""
    window = parse_window(config.window_size)
    if window is None:
        raise ValueError("--window-attn-skip-freq says which layers attend within a sliding window: add "
                         "--window-size, or drop it")
    pattern = window_pattern(config.window_attn_skip_freq, config.num_layers)
    if all(pattern):
        return window, None
    if config.mtp_num_layers:
        raise ValueError("--window-attn-skip-freq with --mtp-num-layers: the prediction layers have no entry in "
                         "the pattern; window every layer (no skip frequency) or drop one")
    return window, pattern


def layer_window(config, layer_number: int) -> Window | None:
    """The window layer `layer_number` (0-based; multi-token prediction's numbered on) applies, or None."""
    pattern = config.window_attn_skip_freq
    if config.window_size is None or (pattern is not None and not pattern[layer_number]):
        return None
    left, right = config.window_size
    if config.causal:  # a causal model's right side is its mask's
        right = 0
    # None where it bounds nothing: (-1, -1), or (-1, r) for a causal model
    return None if left == -1 and (config.causal or right == -1) else (left, right)


def binding(window: Window | None, sq: int, sk: int, causal: bool) -> Window | None:
    """`window` where it hides some key from some query of the last sq of sk positions, else None: the
    plain mask says the same (Mistral's 4096 tokens over a shorter sequence), and the plain path runs."""
    if window is None:
        return None
    left, right = window
    if (left != -1 and left < sk - 1) or (not causal and right != -1 and right < sq - 1):
        return window
    return None


def band(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Window, causal: bool) -> torch.Tensor:
    """Bool [..., queries, keys], True = attend: keys within `window` of each query (and not after it
    when `causal`), from the positions of the queries [..., sq] and keys [..., sk]."""
    left, right = window
    offset = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)  # how far back the key is
    allowed = offset >= 0 if causal else torch.ones_like(offset, dtype=torch.bool)
    if left != -1:
        allowed = allowed & (offset <= left)
    if right != -1 and not causal:
        allowed = allowed & (offset >= -right)
    return allowed


# Band masks by (queries, keys, window, causal, device): one for every windowed layer of a process (each
# layer's attention keeps a reference for its backward, not a mask of its own).
_MASKS: dict = {}
_MAX_MASKS = 8


def band_mask(sq: int, sk: int, window: Window, causal: bool, device) -> torch.Tensor:
    """Bool [1, 1, sq, sk] (the attention backends' mask layout) `band` of the last sq of sk positions
    against all sk (training: sq = sk; generation: a step's new tokens against every cached slot)."""
    def make():
        k_pos = torch.arange(sk, device=device)
        return band(k_pos[sk - sq:], k_pos, window, causal)[None, None]
    if torch.compiler.is_compiling():  # made in the graph: filling the cache would be a guarded side effect
        return make()
    key = (sq, sk, window, causal, str(device))
    if key not in _MASKS:
        if len(_MASKS) >= _MAX_MASKS:
            _MASKS.clear()
        _MASKS[key] = make()
    return _MASKS[key]


def windowed_mask(attention_mask, sq: int, sk: int, window: Window, causal: bool, device) -> torch.Tensor:
    """The mask attention applies under `window`: its band, and `attention_mask` (bool, broadcastable
    to [b, heads, sq, sk], True = attend; None: causal or all, which the band already says). A query
    always sees itself: only a padding token's row changes by it (a real token's own key is in its
    band), which would otherwise see no key once its window holds padding alone, and give NaN that its
    values would carry into the real tokens' attention."""
    mask = band_mask(sq, sk, window, causal, device)
    if attention_mask is None:
        return mask
    return (attention_mask & mask) | band_mask(sq, sk, (0, 0), False, device)
