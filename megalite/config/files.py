"""Config files: TOML (YAML too where PyYAML is installed) in, TOML out. A file holds sections as
tables, `[parallel]\ntp = 2`, with the same names as RunConfig's fields."""
from __future__ import annotations

import json
from pathlib import Path

from megalite.config.run import ConfigError, RunConfig

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def read_config_file(path: str) -> dict:
    """The file's {section: {field: value}}; unreadable or malformed files raise ConfigError."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        if p.suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise ConfigError(f"--config {path}: YAML needs PyYAML (pip install pyyaml), or use TOML") from None
            data = yaml.safe_load(p.read_text()) or {}
        else:
            data = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path}: not valid {'YAML' if p.suffix in ('.yaml', '.yml') else 'TOML'}: "
                          f"{str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected tables of settings, got {type(data).__name__}")
    return data


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


def to_toml(config: RunConfig, header: str = "") -> str:
    """The configuration as a TOML file that --config reads back to the same RunConfig. Values derived
    from other settings are comments: a flag given with the file derives them again."""
    lines = [f"# {line}" for line in header.splitlines()]
    for name, values in config.to_dict().items():
        if values:
            lines += ["", f"[{name}]"] + [f"# {k} = {_toml_value(v)}  (derived)" if f"{name}.{k}" in config.derived
                                          else f"{k} = {_toml_value(v)}" for k, v in values.items()]
    return "\n".join(lines).lstrip("\n") + "\n"
