"""Megatron-LM's spelling of a per-layer 0/1 pattern (--moe-layer-freq, --window-attn-skip-freq)."""
from __future__ import annotations

import re


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
