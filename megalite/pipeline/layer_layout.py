"""Megatron-LM's ways of placing layers on pipeline stages, as megalite's one layer count per virtual
stage (`--pipeline-layers`): the layout string (`--pipeline-model-parallel-layout`) and the split that
counts the embedding and the loss as layers (`--account-for-embedding/loss-in-pipeline-split`).

A layout names each virtual stage's contents in virtual-stage order (stage c*pp + r is chunk c of
pipeline rank r), stages separated by `|`: `E` the embedding, `t` a transformer layer, `m` a
multi-token-prediction layer, `L` the output layer and loss. `X*n` repeats a letter, `(...)*n` a
group (which may hold `|`); commas are for the eye. "Et*3|(tt|)*2,mL" on --pp 4 is four stages:
E+3 layers, 2 layers, 2 layers, MTP+loss (the last holds no transformer layer).
"""
from __future__ import annotations

import re

_LETTERS = "EtmL"
_GROUP = re.compile(r"\(([^()]*)\)\*(\d+)")
_LETTER = re.compile(r"(.)\*(\d+)")


def layout_stages(layout: str) -> list[str]:
    """The layout's virtual stages, each its letters in order (repetitions unrolled)."""
    text = layout.replace(",", "").replace(" ", "")
    while _GROUP.search(text):  # innermost groups first, so nested groups unroll too
        text = _GROUP.sub(lambda g: g.group(1) * int(g.group(2)), text)
    text = _LETTER.sub(lambda g: g.group(1) * int(g.group(2)), text)
    stray = sorted(set(text) - set(_LETTERS) - {"|"})
    if stray:
        raise ValueError(f"--pipeline-model-parallel-layout {layout!r}: {''.join(stray)!r} is not a layer letter "
                         f"(E embedding, t transformer layer, m MTP layer, L loss; '|' ends a stage, X*n and (..)*n "
                         f"repeat)")
    return text.split("|")


def layout_layer_counts(layout: str, pp: int, num_layers: int, mtp_layers: int) -> tuple[int, list[int]]:
    """(virtual stages per pipeline rank, transformer layers of each virtual stage) of a layout, checked
    against the model (`num_layers`, `mtp_layers`) and where megalite runs the rest: the embedding on
    the first virtual stage, the MTP layers and the loss on the last (ValueError naming the fix)."""
    stages = layout_stages(layout)
    flag = f"--pipeline-model-parallel-layout {layout!r}"
    if len(stages) % pp:
        raise ValueError(f"{flag} has {len(stages)} stages, not a multiple of --pp {pp}: give --pp x (virtual stages "
                         f"per rank) stages, separated by '|'")
    letters = "".join(stages)
    if letters.count("t") != num_layers:
        raise ValueError(f"{flag} places {letters.count('t')} transformer layers (t) but the model has {num_layers}")
    if letters.count("m") != mtp_layers:
        raise ValueError(f"{flag} places {letters.count('m')} MTP layers (m) but the model has {mtp_layers} "
                         f"(--mtp-num-layers)")
    if letters.count("E") != 1 or letters.count("L") != 1:
        raise ValueError(f"{flag} must name the embedding (E) and the loss (L) once each")
    if not stages[0].startswith("E"):
        raise ValueError(f"{flag}: the embedding (E) comes first, in the first stage (megalite runs it there)")
    if not stages[-1].endswith("L"):
        raise ValueError(f"{flag}: the loss (L) comes last, in the last stage (megalite runs it there)")
    if mtp_layers and (not re.fullmatch(r"t*m+L", stages[-1]) or stages[-1].count("m") != mtp_layers):
        raise ValueError(f"{flag}: megalite runs the MTP layers (m) with the loss, after the last transformer "
                         f"layer: put every m in the last stage, just before L")
    return len(stages) // pp, [stage.count("t") for stage in stages]


def accounted_layer_counts(num_layers: int, pp: int, vpp: int | None, embedding: bool, loss: bool) -> list[int]:
    """Megatron-LM's even split with the embedding (`embedding`) and the loss (`loss`) each counted as
    one more layer: num_layers plus those split evenly over the pp x vpp virtual stages, then the first
    stage's share less the embedding and the last's less the loss (a stage may be left empty)."""
    v = vpp or 1
    total = num_layers + int(embedding) + int(loss)
    if total % (pp * v):
        raise ValueError(f"{account_flags(embedding, loss)}: {num_layers} layers + {int(embedding) + int(loss)} do "
                         f"not split evenly over --pp {pp}{f' x --vpp {v}' if v > 1 else ''} virtual stages: change "
                         f"the layers or the sizes (or give --pipeline-layers instead)")
    counts = [total // (pp * v)] * (pp * v)  # at least one each: the embedding or the loss leaves 0 or more
    counts[0] -= int(embedding)
    counts[-1] -= int(loss)
    return counts


def account_flags(embedding: bool, loss: bool) -> str:
    """The account-for flags given, as the user spelled them."""
    return " and ".join(f for f, on in (("--account-for-embedding-in-pipeline-split", embedding),
                                        ("--account-for-loss-in-pipeline-split", loss)) if on)
