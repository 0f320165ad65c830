"""Megatron-LM's flags that have no field of their own, read from megatron_flags.toml beside this
file: those megalite accepts without effect (they cannot change the numbers: what they switch on,
megalite always does or has no use for) and those it refuses (it cannot honour them). Flags that do
have a field are that field's aliases (megalite.config.sections); `kind_of` says which of the three a
flag is."""
from __future__ import annotations

from pathlib import Path

from megalite.config.files import tomllib

_TABLES = tomllib.loads((Path(__file__).with_name("megatron_flags.toml")).read_text(encoding="utf-8"))

# flag -> (how many values it takes: 0, 1, ..., or "+" / "*" as argparse's nargs, why)
ACCEPTED_WITHOUT_EFFECT: dict[str, tuple[int | str, str]] = {k: tuple(v) for k, v in _TABLES["accepted"].items()}
REFUSED: dict[str, tuple[int | str, str]] = {k: tuple(v) for k, v in _TABLES["refused"].items()}


def _check_tables() -> None:
    both = sorted(ACCEPTED_WITHOUT_EFFECT.keys() & REFUSED.keys())
    if both:
        raise ValueError(f"megatron_flags.toml: {', '.join(both)} both accepted and refused")
    for flag, (values, why) in {**ACCEPTED_WITHOUT_EFFECT, **REFUSED}.items():
        if not flag.startswith("--") or not why or not (values in ("+", "*") or isinstance(values, int) and values >= 0):
            raise ValueError(f"megatron_flags.toml: {flag} = [{values!r}, {why!r}]: expected \"--flag\" = [N, \"why\"]")


_check_tables()


def kind_of(flag: str, parser) -> tuple[str, str] | None:
    """("honoured", the field's section.name), ("accepted", why) or ("refused", why) for a flag of
    `parser` (megalite.config.build_parser's); None for a flag megalite does not know."""
    if flag in ACCEPTED_WITHOUT_EFFECT:
        return "accepted", ACCEPTED_WITHOUT_EFFECT[flag][1]
    if flag in REFUSED:
        return "refused", REFUSED[flag][1]
    action = parser._option_string_actions.get(flag)
    if action is None or "." not in action.dest:
        return None
    return "honoured", action.dest
