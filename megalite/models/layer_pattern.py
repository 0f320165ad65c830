"""Per-layer 0/1 patterns (--moe-layer-freq, --window-attn-skip-freq, --no-rope-freq): Megatron-LM's
spellings read, checked against the layers, and written back as flag text."""
from __future__ import annotations

import re
from typing import Callable


def parse_layer_freq(text: str, flag: str):
    """"4", "[0,1,1,1]" or "([0]*1+[1]*3)" (Megatron-LM's spelling of a per-layer pattern, given to
    `flag`): lists of 0/1, repeated (*) and joined (+), nothing else."""
    body = text.strip()
    if re.fullmatch(r"\d+", body):
        return int(body)
    repeated = re.fullmatch(r"\((.*)\)\s*\*\s*(\d+)", body)  # "([0]*3+[1]*1)*3": the whole pattern repeated
    if repeated and not isinstance(inner := parse_layer_freq(repeated.group(1), flag), int):
        return inner * int(repeated.group(2))
    while body.startswith("(") and body.endswith(")"):
        body = body[1:-1].strip()
    out: list[int] = []
    for term in body.split("+"):
        m = re.fullmatch(r"\s*\[([\d\s,]*)\]\s*(?:\*\s*(\d+))?\s*", term)
        if not m:
            raise ValueError(f"{flag} {text!r} is not an int, a list like [0,1,1,1] or a sum of repeated lists "
                             f"like ([0]*1+[1]*3)")
        items = [int(v) for v in m.group(1).replace(",", " ").split()]
        out += items * int(m.group(2) or 1)
    return out


def layer_pattern(freq, num_layers: int, flag: str, every: Callable[[int, int], list[int]], entry: str) -> list[int]:
    """One 0/1 per layer (0-based) from an int (its pattern is `every(int, num_layers)`, which refuses
    a bad one), a list, or its Megatron-LM spelling (parse_layer_freq); `entry` says what a 1 is, for
    the error naming a list of the wrong length or values."""
    if isinstance(freq, str):
        freq = parse_layer_freq(freq, flag)
    if isinstance(freq, int):
        return every(freq, num_layers)
    pattern = [int(v) for v in freq]
    if len(pattern) != num_layers or any(v not in (0, 1) for v in pattern):
        raise ValueError(f"{flag} lists {len(pattern)} entries ({pattern}) for {num_layers} layers: give one {entry} "
                         f"per layer")
    return pattern


def pattern_text(pattern) -> str:
    """A per-layer pattern as its flag's text: "[0,1,1,1]" (an int as it is)."""
    return str(pattern) if isinstance(pattern, int) else "[" + ",".join(str(int(v)) for v in pattern) + "]"


def layer_pattern_fields(config) -> dict:
    """The model section's window and per-layer flags (their text) that give `config`'s sliding windows
    and layers without rope; empty where it has neither."""
    out = {}
    if config.window_size is not None:
        out["window_size"] = ",".join(map(str, config.window_size))
        if config.window_attn_skip_freq is not None:
            out["window_attn_skip_freq"] = pattern_text(config.window_attn_skip_freq)
    if config.no_rope_freq is not None:
        out["no_rope_freq"] = pattern_text(config.no_rope_freq)
    return out
