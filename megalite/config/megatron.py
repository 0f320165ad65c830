"""Megatron-LM's flags that have no field of their own, read from megatron_flags.toml beside this
file: those megalite accepts without effect (they cannot change the numbers: what they switch on,
megalite always does or has no use for) and those it refuses (it cannot honour them). Flags that do
have a field are that field's aliases (megalite.config.sections), and Megatron-LM's other spellings of a
flag megalite knows are ALIASES of it; `kind_of` says which of the three a flag is."""
from __future__ import annotations

from pathlib import Path

from megalite.config.files import tomllib

_TABLES = tomllib.loads((Path(__file__).with_name("megatron_flags.toml")).read_text(encoding="utf-8"))

# flag -> (how many values it takes: 0, 1, ..., or "+" / "*" as argparse's nargs, why)
ACCEPTED_WITHOUT_EFFECT: dict[str, tuple[int | str, str]] = {k: tuple(v) for k, v in _TABLES["accepted"].items()}
REFUSED: dict[str, tuple[int | str, str]] = {k: tuple(v) for k, v in _TABLES["refused"].items()}
# Megatron-LM spelling -> the flag megalite knows it by (a field's flag, or one of the two tables')
ALIASES: dict[str, str] = dict(_TABLES.get("aliases", {}))


def _check_tables() -> None:
    both = sorted(ACCEPTED_WITHOUT_EFFECT.keys() & REFUSED.keys())
    if both:
        raise ValueError(f"megatron_flags.toml: {', '.join(both)} both accepted and refused")
    for flag, (values, why) in {**ACCEPTED_WITHOUT_EFFECT, **REFUSED}.items():
        if not flag.startswith("--") or not why or not (values in ("+", "*") or isinstance(values, int) and values >= 0):
            raise ValueError(f"megatron_flags.toml: {flag} = [{values!r}, {why!r}]: expected \"--flag\" = [N, \"why\"]")
    for alias, flag in ALIASES.items():
        if alias in ACCEPTED_WITHOUT_EFFECT or alias in REFUSED or flag in ALIASES or not flag.startswith("--"):
            raise ValueError(f"megatron_flags.toml: alias {alias} = {flag!r}: an alias names a flag megalite knows "
                             f"(and is in no table itself)")


_check_tables()


# The command line's destinations for the tables' flags: f"{NOOP}.--flag", f"{REFUSE}.--flag".
NOOP, REFUSE = "megatron_noop", "megatron_refused"


def kind_of(flag: str, parser) -> tuple[str, str] | None:
    """("honoured", the field's section.name), ("accepted", why) or ("refused", why) for a flag of
    `parser` (megalite.config.build_parser's); None for a flag megalite does not know. An alias is the
    kind of the flag it names."""
    action = parser._option_string_actions.get(flag)
    if action is None or "." not in action.dest:
        return None
    where, name = action.dest.split(".", 1)
    if where == NOOP:
        return "accepted", ACCEPTED_WITHOUT_EFFECT[name][1]
    if where == REFUSE:
        return "refused", REFUSED[name][1]
    return "honoured", action.dest
