"""How a configuration field is declared: its default, one line of help, and what the command line
and config files need to know (flags, aliases, choices, the range a number must be in).

Every section is a dataclass of such fields; the command line, `--help`, config files,
`--print-config` and docs/configuration.md are all generated from them, so they cannot drift."""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

# Ranges numbers must be in: (test, what the error says). A value is tested only when set (not None).
POSITIVE_INT = (lambda v: v >= 1, "an integer >= 1")
NON_NEGATIVE = (lambda v: v >= 0, ">= 0")
POSITIVE = (lambda v: v > 0, "> 0")
PROBABILITY = (lambda v: 0 <= v < 1, "in [0, 1)")
FRACTION = (lambda v: 0 < v <= 1, "in (0, 1]")


@dataclass(frozen=True)
class Spec:
    """What a field tells the command line, the config files and the docs."""
    help: str
    flags: tuple[str, ...] = ()  # first: the canonical flag; then accepted aliases (Megatron-LM's names)
    choices: tuple | None = None
    check: tuple[Callable[[Any], bool], str] | None = None  # the range of a number
    metavar: str | None = None
    # Extra switches that set this field to a constant: {"--recompute-activations": "selective"}
    sets: tuple[tuple[str, Any], ...] = ()
    switch: bool = False  # a bool given as a bare flag (store_true); else --flag {true,false}
    resume: bool = True  # may change when a run resumes (layout, intervals, paths); False: the model's shape
    nargs: int | None = None  # a list given as N words (--flag 1 2 3) rather than "1,2,3"


def opt(default, help: str, *, flags: tuple[str, ...] = (), choices=None, check=None, metavar=None,
        sets: dict | None = None, switch: bool | None = None, shape: bool = False, nargs: int | None = None):
    """A section field. `flags` defaults to --field-name; `switch` (bools) to True when the default
    is False; `shape`: part of the model's shape (a checkpoint's value is kept on --load)."""
    if switch is None:
        switch = default is False
    spec = Spec(help, tuple(flags), tuple(choices) if choices else None, check, metavar,
                tuple((sets or {}).items()), switch, not shape, nargs)
    factory = {"default_factory": (lambda: list(default))} if isinstance(default, list) else {"default": default}
    return dataclasses.field(metadata={"spec": spec}, **factory)


def spec_of(f: dataclasses.Field) -> Spec:
    return f.metadata["spec"]


def flags_of(f: dataclasses.Field) -> tuple[str, ...]:
    spec = spec_of(f)
    return spec.flags or ("--" + f.name.replace("_", "-"),)


def flag_of(f: dataclasses.Field) -> str:
    """The canonical flag, as errors name it."""
    return flags_of(f)[0]


def section_fields(section) -> Iterator[dataclasses.Field]:
    return iter(dataclasses.fields(section))


def check_numbers(section) -> None:
    """Every number of `section` in its range and finite; raises ValueError naming the flag."""
    for f in section_fields(section):
        v, rule = getattr(section, f.name), spec_of(f).check
        if v is None or rule is None or isinstance(v, bool):
            continue
        ok, text = rule
        if not math.isfinite(v) or not ok(v):
            raise ValueError(f"{flag_of(f)} must be {text}, got {v}")


def in_user_spelling(message: str, spelled) -> str:
    """`message` with each flag it names as the user spelled it: `spelled` holds (flag, spelling)
    pairs (RunConfig.spelled: --pipeline-model-parallel-size given, an error about --pp says so)."""
    names = dict(spelled)
    if not names:
        return message
    pattern = "|".join(re.escape(flag) for flag in sorted(names, key=len, reverse=True))
    return re.sub(rf"(?<![\w-])({pattern})(?![\w-])", lambda m: names[m.group(1)], message)

