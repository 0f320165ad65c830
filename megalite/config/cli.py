"""The command line, generated from the sections: a flag per field (its Megatron-LM aliases too),
`--help` grouped by section, `--config FILE` under the flags, and errors in one line, once per node,
with the closest known flag for a typo."""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import typing

from megalite.config import megatron
from megalite.config.fields import flags_of, in_user_spelling, spec_of
from megalite.config.files import read_config_file
from megalite.config.run import SECTIONS, ConfigError, RunConfig, section_from_dict

_NOOP, _REFUSE = megatron.NOOP, megatron.REFUSE


def _on_off(value: str) -> bool:
    if value.lower() in ("true", "1", "yes", "on"):
        return True
    if value.lower() in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def _int_list(value: str) -> list[int]:
    try:
        return [int(x) for x in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {value!r}") from None


class ConfigParser(argparse.ArgumentParser):
    """argparse whose parse_args returns a RunConfig, and which reports a bad command line in one
    line once per node: under torchrun every rank parses the same argv."""

    def __init__(self, *a, default_model: str | None = None, **kw):
        super().__init__(*a, allow_abbrev=False, **kw)
        self.default_model = default_model

    def parse_args(self, args=None, namespace=None) -> RunConfig:  # type: ignore[override]
        return self.parse(args)[0]

    def parse(self, argv: list[str] | None = None) -> tuple[RunConfig, argparse.Namespace]:
        """(the resolved configuration, the namespace of what was given); usage errors exit."""
        argv = sys.argv[1:] if argv is None else list(argv)
        ns, extras = self.parse_known_args(argv)
        if extras:
            self.error(_unknown(extras, self))
        refused = [f for f in vars(ns) if f.startswith(_REFUSE)]
        if refused:
            flag = refused[0].split(".", 1)[1]
            self.error(f"{flag}: {megatron.REFUSED[flag][1]}")
        spelled = self.spellings(argv)
        try:
            config = dataclasses.replace(self.configure(ns), spelled=spelled)
        except ConfigError as e:
            self.error(in_user_spelling(str(e), spelled))
        return config, ns

    def spellings(self, argv: list[str]) -> tuple[tuple[str, str], ...]:
        """(a field's flag, the alias `argv` gave it by) for each field given by another spelling (the
        last one given counts, as its value does)."""
        out: dict[str, str] = {}
        for word in argv:
            name = word.split("=", 1)[0] if word.startswith("--") else None
            action = self._option_string_actions.get(name) if name else None
            if action is None or "." not in action.dest or action.dest.startswith((_NOOP, _REFUSE)):
                continue
            flag = action.option_strings[0]
            if name == flag:
                out.pop(flag, None)
            else:
                out[flag] = name
        return tuple(out.items())

    def configure(self, ns: argparse.Namespace) -> RunConfig:
        """--config's file, then the flags over it, then the derived defaults."""
        from megalite.config.rules import resolve

        given: dict[str, dict] = {}
        path = getattr(ns, "config", None)
        if path:
            file_values = read_config_file(path)
            RunConfig.from_dict(file_values, f"--config {path}")  # keys and types, naming the file
            given = {k: dict(v) for k, v in file_values.items()}
        for dest, value in vars(ns).items():
            if "." in dest and not dest.startswith((_NOOP, _REFUSE)):
                section, name = dest.split(".")
                given.setdefault(section, {})[name] = value
        sections = {name: section_from_dict(name, given.get(name, {}), "the command line") for name in SECTIONS}
        config = RunConfig(**sections)
        explicit = frozenset(f"{s}.{k}" for s, values in given.items() for k in values)
        noops = sorted(dest.split(".", 1)[1] for dest in vars(ns) if dest.startswith(_NOOP))
        return resolve(config, self.default_model, explicit, noops)

    def error(self, message):
        from megalite.runtime import env_world, tell_torchrun

        if env_world()[2] != 0:
            raise SystemExit(2)
        line = f"{self.prog}: error: {message}"
        tell_torchrun(line)
        print(f"{line} (--help lists every flag)", file=sys.stderr, flush=True)
        raise SystemExit(2)


def _unknown(extras: list[str], parser: ConfigParser) -> str:
    flag = next((e for e in extras if e.startswith("-")), None)
    if flag is None:
        return f"unexpected argument {extras[0]!r} (every setting is a --flag)"
    name = flag.split("=", 1)[0]
    known = [o for a in parser._actions for o in a.option_strings]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"unknown flag {name}" + (f" (did you mean {close[0]}?)" if close else "")


def _add_field(group, section: str, f: dataclasses.Field, hint) -> None:
    spec = spec_of(f)
    dest = f"{section}.{f.name}"
    kind = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
    default = f.default if f.default is not dataclasses.MISSING else None
    text = spec.help + ("" if default in (None, False) else f" (default: {default})")
    kw: dict = dict(dest=dest, default=argparse.SUPPRESS, help=text)
    if kind is bool and spec.switch:
        kw.update(action="store_true")
    elif kind is bool:
        kw.update(nargs="?", const=True, type=_on_off, metavar="{true,false}")
    elif typing.get_origin(kind) is list:
        many = ({"type": int, "nargs": spec.nargs} if spec.nargs else
                {"type": _int_list} if typing.get_args(kind)[0] is int else {"nargs": "+"})  # N words, "3,5", words
        kw.update(many, metavar=spec.metavar)
    else:
        if f.name == "normalization":  # Megatron-LM spells them LayerNorm / RMSNorm
            kw.update(type=str.lower)
        else:
            kw.update(type=kind)
        kw.update(choices=spec.choices, metavar=spec.metavar)
    group.add_argument(*flags_of(f), **kw)
    for flag, value in spec.sets:
        group.add_argument(flag, dest=dest, action="store_const", const=value, default=argparse.SUPPRESS,
                           help=f"the same as {flags_of(f)[0]} {str(value).lower()}")


def _takes(values: int) -> dict:
    return {"action": "store_true"} if values == 0 else {"metavar": "X"} if values == 1 else {"nargs": values,
                                                                                                "metavar": "X"}


def build_parser(description: str, default_model: str) -> ConfigParser:
    """The entry points' command line: a group of flags per section."""
    p = ConfigParser(description=description, default_model=default_model)
    p.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                   help="a TOML (or YAML) file of settings, as --print-config writes; flags override it")
    p.add_argument("--print-config", action="store_true", default=argparse.SUPPRESS,
                   help="print the resolved configuration as a file --config reads, checked for the world size "
                        "torchrun gives (WORLD_SIZE), and exit without training")
    for name, cls in SECTIONS.items():
        group = p.add_argument_group(f"[{name}] {cls.__doc__.strip().splitlines()[0]}")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            _add_field(group, name, f, hints[f.name])
    group = p.add_argument_group("Megatron-LM flags accepted without effect (a note line lists those given)")
    for flag, (values, why) in megatron.ACCEPTED_WITHOUT_EFFECT.items():
        group.add_argument(flag, dest=f"{_NOOP}.{flag}", default=argparse.SUPPRESS, help=why, **_takes(values))
    group = p.add_argument_group("Megatron-LM flags megalite refuses (it cannot honour them)")
    for flag, (values, why) in megatron.REFUSED.items():
        group.add_argument(flag, dest=f"{_REFUSE}.{flag}", default=argparse.SUPPRESS, help=why, **_takes(values))
    _add_aliases(p)
    return p


def _add_aliases(p: ConfigParser) -> None:
    """Megatron-LM's other spellings (megatron.ALIASES): each one more option string of the action of
    the flag it names, so it parses, helps and is reported as that flag does. A spelling the parser
    already has (a field made it its own) is left to it."""
    for alias, flag in megatron.ALIASES.items():
        action = p._option_string_actions.get(flag)
        if action is None:
            raise ValueError(f"megatron_flags.toml: alias {alias} names {flag}, which megalite does not know")
        if alias not in p._option_string_actions:
            action.option_strings.append(alias)
            p._option_string_actions[alias] = action

