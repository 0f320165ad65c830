"""Issue #48: every Megatron-LM flag is honoured (a field's flag or alias), accepted without effect
(with a note) or refused in one line saying why; none is unknown. The list of Megatron-LM's flags,
with how many values each takes, is tests/data/megatron_lm_flags.txt (read from Megatron-LM's
megatron/training/arguments.py; its first line names the commit)."""
from pathlib import Path

import pytest

from megalite.config import build_parser, megatron

FLAGS_FILE = Path(__file__).resolve().parent / "data" / "megatron_lm_flags.txt"


def _megatron_flags() -> dict[str, str]:
    lines = FLAGS_FILE.read_text().splitlines()
    assert lines[0].startswith("# NVIDIA/Megatron-LM megatron/training/arguments.py at ")
    flags = dict(line.split() for line in lines[1:] if line.strip())
    assert set(flags.values()) <= {"0", "1", "+", "*"}
    return flags


MEGATRON_FLAGS = _megatron_flags()


@pytest.fixture(scope="module")
def parser():
    return build_parser("x", "gpt-tiny")


def _argv(flag: str, values) -> list[str]:
    """The flag with as many values as it takes (one for "+" / "*")."""
    return [flag] + ["1"] * (1 if values in ("+", "*") else int(values))


def test_every_megatron_lm_flag_is_honoured_accepted_or_refused(parser):
    unknown = [flag for flag in MEGATRON_FLAGS if megatron.kind_of(flag, parser) is None]
    assert not unknown, f"Megatron-LM flags megalite does not know: {unknown}"
    assert len(MEGATRON_FLAGS) > 250
    assert megatron.kind_of("--no-such-megatron-flag", parser) is None  # the check can fail
    assert megatron.kind_of("--tensor-model-parallel-size", parser) == ("honoured", "parallel.tp")


def test_no_flag_is_both_accepted_and_refused_or_also_a_field(parser):
    assert not megatron.ACCEPTED_WITHOUT_EFFECT.keys() & megatron.REFUSED.keys()
    fields = {o for a in parser._actions if "." in a.dest and not a.dest.startswith(("megatron_noop",
                                                                                     "megatron_refused"))
              for o in a.option_strings}
    assert not fields & (megatron.ACCEPTED_WITHOUT_EFFECT.keys() | megatron.REFUSED.keys())


def test_the_tables_take_as_many_values_as_megatron_lm(parser):
    parser.format_help()  # every reason is --help text too (a stray % breaks it)
    for table in (megatron.ACCEPTED_WITHOUT_EFFECT, megatron.REFUSED):
        for flag, (values, why) in table.items():
            assert why.strip() and "\n" not in why, flag
            if flag in MEGATRON_FLAGS:
                assert str(values) == MEGATRON_FLAGS[flag], flag


def test_switches_of_megatron_lm_take_no_value_in_megalite(parser):
    """A Megatron-LM switch must not swallow the next flag as its value (or the other way)."""
    for flag, values in MEGATRON_FLAGS.items():
        action = parser._option_string_actions[flag]
        if values == "0":
            assert action.nargs in (0, "?"), flag  # "?": a bool field that also takes true/false
        else:
            assert action.nargs != 0, flag


@pytest.mark.parametrize("flag", sorted(megatron.REFUSED))
def test_a_refused_flag_ends_in_one_line_naming_it(capsys, flag):
    with pytest.raises(SystemExit) as e:
        build_parser("x", "gpt-tiny").parse(_argv(flag, megatron.REFUSED[flag][0]))
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"error: {flag}: {megatron.REFUSED[flag][1]}" in lines[0], lines


@pytest.mark.parametrize("flag", sorted(megatron.ACCEPTED_WITHOUT_EFFECT))
def test_an_accepted_flag_parses_with_a_note_and_changes_nothing(flag):
    parser = build_parser("x", "gpt-tiny")
    cfg = parser.parse(_argv(flag, megatron.ACCEPTED_WITHOUT_EFFECT[flag][0]))[0]
    assert flag in cfg.ignored_flags
    assert cfg == parser.parse([])[0]
