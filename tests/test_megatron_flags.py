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


def test_megatrons_other_spellings_are_the_flags_they_name(parser):
    for alias, flag in megatron.ALIASES.items():
        assert megatron.kind_of(alias, parser) == megatron.kind_of(flag, parser), alias
    cfg = build_parser("x", "gpt-tiny").parse_args(["--persistent-save-interval", "7", "--save", "ckpt",
                                                    "--num-virtual-stages-per-pipeline-rank", "2", "--pp", "2"])
    assert (cfg.checkpoint.save_interval, cfg.parallel.vpp) == (7, 2)


# (flags, world size, what the one-line error must say): the flag as the command line spelled it
SPELLED = [
    (["--tensor-model-parallel-size", "3"], 4, "--tensor-model-parallel-size 3 does not divide the number of ranks"),
    (["--pipeline-model-parallel-size", "3"], 4, "--tp 1 x --pipeline-model-parallel-size 3 = 3 does not divide"),
    (["--tensor-model-parallel-size", "1", "--pp", "3"], 4, "--tensor-model-parallel-size 1 x --pp 3 = 3"),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2,
     "the number of layers (3) is not divisible by --pipeline-model-parallel-size (2)"),
    (["--context-parallel-size", "2", "--seq-length", "30"], 2, "--context-parallel-size 2 cuts each sequence"),
    (["--num-virtual-stages-per-pipeline-rank", "2"], 1, "--num-virtual-stages-per-pipeline-rank 2 needs pipeline"),
    (["--micro-batch-size", "3", "--global-batch-size", "16"], 1, "is not divisible by --micro-batch-size 3"),
]


@pytest.mark.parametrize("argv, world, message", SPELLED)
def test_an_error_names_the_flag_as_the_user_spelled_it(argv, world, message):
    from megalite.config import model_config, validate
    from megalite.errors import UsageError

    cfg = build_parser("x", "gpt-tiny").parse_args(["--mock-data", *argv])
    with pytest.raises(UsageError) as e:
        validate(cfg, world, model_config(cfg))
    assert message in str(e.value), str(e.value)
    if "--tensor-model-parallel-size" in argv:
        assert "--tp " not in str(e.value) and "--tp/" not in str(e.value)


def test_a_parse_error_names_the_flag_as_the_user_spelled_it(capsys):
    with pytest.raises(SystemExit):
        build_parser("x", "gpt-tiny").parse(["--train-samples", "3", "--global-batch-size", "8"])
    assert "--train-samples 3 is less than one --global-batch-size (8)" in capsys.readouterr().err


MEGATRON_SIZES = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--mock-data"]


@pytest.mark.parametrize("argv, activation", [
    (MEGATRON_SIZES, "gelu_tanh"),  # Megatron-LM's flags give the model: its fused bias-GeLU, the tanh form
    (MEGATRON_SIZES + ["--no-bias-gelu-fusion"], "gelu"),  # its unfused MLP: the exact GeLU
    (MEGATRON_SIZES + ["--disable-bias-linear"], "gelu"),  # no bias, no fused bias-GeLU
    (MEGATRON_SIZES + ["--disable-bias-linear", "--openai-gelu"], "gelu_tanh"),
    (MEGATRON_SIZES + ["--model", "gpt-tiny"], "gelu_tanh"),  # a GPT-2 preset keeps GPT-2's (Hugging Face's) tanh
    (["--num-layers", "2"], "gelu_tanh"),  # the default preset, resized: its own
    (["--model", "bert-tiny"], "gelu"),
    (MEGATRON_SIZES + ["--swiglu"], "silu"),
])
def test_the_mlp_gelu_is_megatrons_for_a_model_of_megatron_flags(argv, activation):
    from megalite.config import model_config

    assert model_config(build_parser("x", "gpt-tiny").parse_args(argv)).activation == activation


@pytest.mark.parametrize("extra, activation", [([], "gelu_tanh"), (["--no-bias-gelu-fusion"], "gelu")])
def test_a_printed_megatron_model_reads_back_with_its_gelu(tmp_path, extra, activation):
    from megalite.config import expanded, model_config, to_toml

    cfg = build_parser("x", "gpt-tiny").parse_args(MEGATRON_SIZES + extra)
    (tmp_path / "run.toml").write_text(to_toml(expanded(cfg), "x"))
    again = build_parser("x", "gpt-tiny").parse_args(["--config", str(tmp_path / "run.toml")])
    assert model_config(again) == model_config(cfg) and model_config(again).activation == activation


def test_sgd_is_megatrons_with_momentum_and_l2_weight_decay():
    import torch

    from megalite.optim.optimizer import sgd

    cfg = build_parser("x", "gpt-tiny").parse_args(["--optimizer", "sgd"])
    assert cfg.optimizer.sgd_momentum == 0.9  # Megatron-LM's default
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = sgd([{"params": [p], "weight_decay": 0.1}], lr=0.5, momentum=0.9)
    want, buf = p.detach().clone(), None
    for g in (torch.tensor([0.3, 0.1]), torch.tensor([-0.2, 0.4])):
        p.grad = g.clone()
        opt.step()
        d = g + 0.1 * want  # weight decay added to the gradient, then momentum (the first step: the gradient)
        buf = d if buf is None else 0.9 * buf + d
        want = want - 0.5 * buf
        assert torch.allclose(p.detach(), want, atol=1e-6)
    assert opt.state[p]["exp_avg"] is opt.state[p]["momentum_buffer"]  # what a checkpoint saves as the first moment


def _sgd_runs(rank, world, argvs):
    from training_ranks import gpt_run

    return [[(r["consumed_samples"], r["loss"]) for r in gpt_run(argv).records] for argv in argvs]


def test_a_run_resumed_with_sgd_momentum_continues_the_unbroken_one(tmp_path):
    from megalite.testing import run_ranks

    argv = ["--optimizer", "sgd", "--lr", "0.05", "--mock-data", "--seq-length", "32", "--global-batch-size", "4",
            "--micro-batch-size", "2", "--log-interval", "1", "--eval-interval", "0", "--train-iters", "4"]
    saved = argv + ["--save", str(tmp_path)]
    unbroken, _, resumed = run_ranks(_sgd_runs, 1, args=([argv, saved + ["--exit-interval", "2"],
                                                          saved + ["--load", str(tmp_path)]],))[0]
    assert [c for c, _ in resumed] == [c for c, _ in unbroken[2:]]
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in unbroken[2:]], rel=1e-5)


@pytest.mark.parametrize("given, runs, noted", [
    (["--attention-backend", "flash"], "sdpa", True),
    (["--attention-backend", "unfused"], "torch", True),
    (["--attention-backend", "local"], "fused", True),
    (["--attention-backend", "fused"], "sdpa", True),  # Megatron-LM's fused attention kernel: PyTorch's SDPA
    (["--attention-backend", "fused", "--model", "gpt-tiny"], "fused", False),  # megalite's own fused softmax
])
def test_megatron_lms_attention_backend_names_run_megalites_backend_with_a_note(given, runs, noted):
    from megalite import arguments

    shape = [] if "--model" in given else ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    cfg = arguments.build_parser("test", default_model="gpt-tiny").parse_args(["--mock-data", *shape, *given])
    assert arguments.model_config(cfg).attention_backend == runs
    assert any(n.startswith(f"--attention-backend {given[1]} ") for n in cfg.ignored_flags) == noted
