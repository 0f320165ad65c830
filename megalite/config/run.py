"""`RunConfig`: a run's whole configuration, one typed section per concern, and its conversion to and
from plain dicts (config files, checkpoints, metrics) with every key and type checked."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from megalite.config.fields import flag_of, section_fields, spec_of
from megalite.config.model_sections import MoEConfig, ModelConfig
from megalite.config.output_sections import CheckpointConfig, LoggingConfig
from megalite.config.optimizer_section import OptimizerConfig
from megalite.config.sections import (DataConfig, DataParallelConfig, LocalSGDConfig, ParallelConfig,
                                      TrainingConfig)
from megalite.config.precision import PrecisionConfig


class ConfigError(ValueError):
    """A configuration that cannot run: one line naming the key (or flag) and the fix."""


@dataclass
class RunConfig:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    local_sgd: LocalSGDConfig = field(default_factory=LocalSGDConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # Not settings: which fields a file or a flag set ("section.field"; the rest are defaults or
    # derived), and the Megatron-LM flags given that change nothing here.
    explicit: frozenset = field(default=frozenset(), compare=False, repr=False, metadata={"meta": True})
    derived: frozenset = field(default=frozenset(), compare=False, repr=False, metadata={"meta": True})
    ignored_flags: tuple = field(default=(), compare=False, repr=False, metadata={"meta": True})
    # (a field's flag, the spelling the command line used for it) where they differ: errors name the latter
    spelled: tuple = field(default=(), compare=False, repr=False, metadata={"meta": True})

    def sections(self):
        """(name, section) pairs in declaration order."""
        return [(name, getattr(self, name)) for name in SECTIONS]

    def check(self) -> None:
        """Each section's own rules (megalite.config.rules joins sections)."""
        for _, section in self.sections():
            section.check()

    def to_dict(self) -> dict[str, dict]:
        """{section: {field: value}} without unset (None) fields: what a TOML file holds."""
        return {name: {f.name: _plain(getattr(s, f.name)) for f in section_fields(s) if getattr(s, f.name) is not None}
                for name, s in self.sections()}

    def flat(self) -> dict:
        """{field: value} over every section (field names are unique across sections)."""
        return {f.name: getattr(s, f.name) for _, s in self.sections() for f in section_fields(s)}

    def given(self, name: str) -> bool:
        """Whether a file or a flag set this field (by its name), rather than a default."""
        return f"{FIELD_SECTION[name]}.{name}" in self.explicit

    def replace(self, section: str, **changes) -> "RunConfig":
        return dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section), **changes)})

    @classmethod
    def from_dict(cls, data: dict, source: str = "the configuration") -> "RunConfig":
        """Sections from a dict shaped like `to_dict`'s; an unknown key or a wrong type raises
        ConfigError naming the key and `source`."""
        return cls(**{name: section_from_dict(name, data.get(name, {}), source) for name in SECTIONS
                      if _check_section(name, data, source)})


SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(RunConfig)[f.name] for f in dataclasses.fields(RunConfig)
                             if not f.metadata.get("meta")}
# field name -> section name: what `flat` and the command line rely on (names never repeat).
FIELD_SECTION: dict[str, str] = {f.name: name for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
assert len(FIELD_SECTION) == sum(len(dataclasses.fields(c)) for c in SECTIONS.values()), "a field name repeats"


def _check_section(name: str, data: dict, source: str) -> bool:
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"{source}: unknown section [{unknown[0]}]{_did_you_mean(unknown[0], SECTIONS)}; "
                          f"sections: {', '.join(SECTIONS)}")
    if not isinstance(data.get(name, {}), dict):
        raise ConfigError(f"{source}: {name} must be a table ([{name}]), got {data[name]!r}")
    return True


def _did_you_mean(word: str, known) -> str:
    import difflib
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def field_types(cls) -> dict[str, object]:
    return typing.get_type_hints(cls)


def section_from_dict(name: str, values: dict, source: str):
    cls = SECTIONS[name]
    types = field_types(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = {}
    for key, value in values.items():
        if key not in fields:
            home = FIELD_SECTION.get(key)
            hint = f" (it belongs in [{home}])" if home else _did_you_mean(key, fields)
            raise ConfigError(f"{source}: unknown key {name}.{key}{hint}")
        if key == "normalization" and isinstance(value, str):  # Megatron-LM spells them LayerNorm / RMSNorm
            value = value.lower()
        out[key] = coerce(value, types[key], f"{source}: {name}.{key}", spec_of(fields[key]).choices)
    return cls(**out)


def coerce(value, hint, where: str, choices=None):
    """`value` as the field's type (ints are accepted for floats, never bools for numbers)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if value is None and type(None) in typing.get_args(hint):
        return None
    kind = args[0]
    if typing.get_origin(kind) is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return [coerce(v, typing.get_args(kind)[0], where) for v in value]
    ok = (isinstance(value, bool) if kind is bool else
          isinstance(value, int) and not isinstance(value, bool) if kind is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else
          isinstance(value, kind))
    if not ok:
        raise ConfigError(f"{where} must be {'true or false' if kind is bool else 'a ' + kind.__name__}, "
                          f"got {value!r}")
    if choices and value not in choices:
        raise ConfigError(f"{where} must be one of {', '.join(map(str, choices))}, got {value!r}")
    return float(value) if kind is float else value


def _plain(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def flag_name(field_name: str) -> str:
    """The canonical flag of a field, as errors name it."""
    cls = SECTIONS[FIELD_SECTION[field_name]]
    return flag_of(next(f for f in dataclasses.fields(cls) if f.name == field_name))
