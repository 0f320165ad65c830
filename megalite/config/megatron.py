"""Megatron-LM's flags that have no field of their own, read from megatron_flags.toml beside this
file: those megalite accepts without effect (what they switch on, megalite always does or has no use
for) and those it refuses (it cannot honour them). Flags that do have a field are that field's
aliases (megalite.config.sections)."""
from __future__ import annotations

from pathlib import Path

from megalite.config.files import tomllib

_TABLES = tomllib.loads((Path(__file__).with_name("megatron_flags.toml")).read_text(encoding="utf-8"))

# flag -> (how many values it takes, why)
ACCEPTED_WITHOUT_EFFECT: dict[str, tuple[int, str]] = {k: tuple(v) for k, v in _TABLES["accepted"].items()}
REFUSED: dict[str, tuple[int, str]] = {k: tuple(v) for k, v in _TABLES["refused"].items()}
