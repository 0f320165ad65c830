"""The typed configuration: every documented command and every old flag resolves as before the
change; --config files round-trip and are checked key by key; Megatron-LM's spellings mean what
they mean there; bad input ends in one line."""
import dataclasses
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megalite import config as C
from megalite.errors import UsageError
from megalite.optim import LRSchedule

ROOT = Path(__file__).resolve().parent.parent
BEFORE = json.loads((ROOT / "tests" / "fixtures" / "resolved_before_config.json").read_text())
ENTRIES = {"pretrain_gpt.py": "gpt-tiny", "pretrain_bert.py": "bert-tiny"}
# Resolved differently on purpose: stage 3's reshard switch is set only at stage 3 now (it meant nothing
# below, and an unused value would make a printed configuration fail to reload).
NORMALIZED = {"zero_reshard_after_forward"}


@functools.lru_cache(maxsize=None)
def _parser(entry):
    """One parser per entry point, built once: building one takes three parses' time, and a parse leaves
    the parser as it was."""
    return C.build_parser("test", ENTRIES[entry])


def parse(argv, entry="pretrain_gpt.py"):
    return _parser(entry).parse_args(argv)


def resolve(entry, world, argv):
    cfg = parse(argv, entry)
    model = C.model_config(cfg)
    return cfg, model, C.validate(cfg, world, model)


# Changed on purpose: argv -> what it means now. --sequence-parallel at --tp 1 is off, said in the note
# line (Megatron-LM turns it off too); a --split that is not numbers is refused before any data is read.
# --save-interval without --save is accepted with a note, as Megatron-LM accepts it (issue #48).
CHANGED = {("--sequence-parallel",): ("note", "--sequence-parallel (with --tp 1)"),
           ("--save-interval", "3"): ("note", "--save-interval (without --save nothing is saved)"),
           ("--split", "x/y"): ("refused", "--split 'x/y' must be comma-separated numbers")}


def _case_id(rec):
    return f"{rec['source']}: {rec['entry']} {' '.join(rec['argv'])}"[:100]


@pytest.mark.parametrize("rec", BEFORE["commands"], ids=_case_id)
def test_documented_commands_and_each_old_flag_resolve_as_before(rec):
    if tuple(rec["argv"]) in CHANGED:
        how, text = CHANGED[tuple(rec["argv"])]
        if how == "refused":
            with pytest.raises(UsageError, match=text):
                resolve(rec["entry"], rec["world"], rec["argv"])
            return
        cfg, _, _ = resolve(rec["entry"], rec["world"], rec["argv"])
        assert not cfg.parallel.sequence_parallel and cfg.ignored_flags == (text,)
        return
    if rec.get("error"):
        with pytest.raises((UsageError, SystemExit)):
            resolve(rec["entry"], rec["world"], rec["argv"])
        return
    cfg, model, dp = resolve(rec["entry"], rec["world"], rec["argv"])
    assert dp == rec["dp"]
    base = BEFORE["defaults"][rec["entry"]]
    flat = cfg.flat()
    flat["model"] = cfg.model.model
    for key, old in base["args"].items():
        if key in NORMALIZED:
            continue
        want = rec["args"].get(key, old)
        assert flat[key] == want, f"{key}: {flat[key]!r} now, {want!r} before"
    got = {k: str(v) if k == "params_dtype" else v for k, v in dataclasses.asdict(model).items()}
    added = {f.name: f.default for f in dataclasses.fields(model) if f.name not in base["model"]}  # since then
    assert got == {**base["model"], **rec["model"], **added}


def test_the_comparison_covers_every_old_flag_and_every_documented_command():
    sources = {rec["source"] for rec in BEFORE["commands"]}
    assert {"README.md", "slurm.md", "pretrain_gpt.sbatch", "flag"} <= sources
    flags = {rec["argv"][0] for rec in BEFORE["commands"] if rec["source"] == "flag"}
    assert len(flags) >= 95


def _ok_commands():
    return [r for r in BEFORE["commands"] if not r.get("error")]


@pytest.mark.parametrize("rec", _ok_commands(), ids=_case_id)
def test_print_config_reloads_to_the_same_configuration(rec, tmp_path):
    cfg = parse(rec["argv"], rec["entry"])
    path = tmp_path / "run.toml"
    path.write_text(C.to_toml(cfg, "header line"))
    again = parse(["--config", str(path)], rec["entry"])
    assert again == cfg
    assert C.to_toml(again) == C.to_toml(cfg)


def test_flags_override_the_file_and_the_file_overrides_defaults(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[parallel]\ntp = 2\npp = 2\n[training]\nmicro_batch_size = 4\nglobal_batch_size = 32\n')
    cfg = parse(["--config", str(path), "--tp", "4", "--seq-length", "64"])
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.training.micro_batch_size, cfg.model.seq_length) == (4, 2, 4, 64)
    assert cfg.given("tp") and cfg.given("micro_batch_size") and not cfg.given("lr")


def _one_line_error(argv, capsys, entry="pretrain_gpt.py") -> str:
    with pytest.raises(SystemExit) as e:
        parse(argv, entry)
    assert e.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("text, says", [
    ('[paralel]\ntp = 2\n', "unknown section [paralel] (did you mean parallel?)"),
    ('[parallel]\ntpp = 2\n', "unknown key parallel.tpp (did you mean tp?)"),
    ('[parallel]\nlr = 0.1\n', "unknown key parallel.lr (it belongs in [optimizer])"),
    ('[parallel]\ntp = "two"\n', "parallel.tp must be a int, got 'two'"),
    ('[training]\nmicro_batch_size = 1.5\n', "training.micro_batch_size must be a int"),
    ('[precision]\nbf16 = 1\n', "precision.bf16 must be true or false"),
    ('[parallel]\ncp_comm_type = "ring"\n', "parallel.cp_comm_type must be one of p2p, a2a, a2a+p2p, got 'ring'"),
    ('[parallel\ntp = 2\n', "not valid TOML"),
], ids=["section", "key", "misplaced", "type", "float-for-int", "bool", "choice", "syntax"])
def test_a_bad_file_is_refused_in_one_line_naming_the_key_and_the_file(tmp_path, capsys, text, says):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    line = _one_line_error(["--config", str(path)], capsys)
    assert says in line and str(path) in line, line


def test_a_bad_value_in_a_file_is_refused_like_the_flag(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[optimizer]\nlr = -1.0\n")
    with pytest.raises(UsageError, match="--lr must be > 0, got -1.0"):
        C.model_config(parse(["--config", str(path)]))


def test_yaml_files_are_read_too(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "job.yaml"
    path.write_text("parallel:\n  tp: 2\noptimizer:\n  lr: 0.002\n")
    cfg = parse(["--config", str(path)])
    assert (cfg.parallel.tp, cfg.optimizer.lr) == (2, 0.002)


@pytest.mark.parametrize("argv, says", [
    (["--tensor-model-paralel-size", "2"], "unknown flag --tensor-model-paralel-size (did you mean "
                                           "--tensor-model-parallel-size?)"),
    (["--lrr", "0.1"], "unknown flag --lrr (did you mean --lr?)"),
    (["--tp", "two"], "invalid int value: 'two'"),
    (["--model", "gpt2-124"], "--model gpt2-124: no such preset (did you mean gpt2-124m?)"),
    (["--fp8-format", "e5m2"], "--fp8-format: invalid choice: 'e5m2'"),
    (["--fp8-recipe", "nope"], "--fp8-recipe: invalid choice: 'nope'"),
    (["--train-iters", "5", "--train-samples", "80"], "--train-iters and --train-samples both give the run's length"),
], ids=["typo-megatron", "typo", "type", "preset", "fp8", "fp8-switch", "two-lengths"])
def test_a_bad_command_line_is_one_line_with_the_closest_flag(capsys, argv, says):
    line = _one_line_error(argv, capsys)
    assert says in line, line
    assert "usage:" not in line


@pytest.mark.parametrize("megatron, ours", [
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"],
     ["--tp", "2", "--pp", "2", "--cp", "2"]),
    (["--recompute-activations"], ["--recompute", "selective"]),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"],
     ["--recompute", "full", "--recompute-method", "block", "--recompute-num-layers", "1"]),
    (["--normalization", "RMSNorm"], ["--normalization", "rmsnorm"]),
    (["--use-rotary-position-embeddings"], ["--position-embedding-type", "rope"]),
    (["--layernorm-epsilon", "1e-6"], ["--norm-epsilon", "1e-6"]),
    (["--async-save", "--save", "x"], ["--save-async", "--save", "x"]),
    (["--overlap-grad-reduce"], ["--overlap-grad-reduce", "true"]),
    (["--exit-signal-handler"], []),
    (["--num-layers", "8", "--pp", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
     ["--num-layers", "8", "--pp", "2", "--vpp", "2", "--num-layers-per-virtual-pipeline-stage", "2"]),
    (["--use-mcore-models", "--transformer-impl", "local", "--use-flash-attn"], []),
], ids=["sizes", "recompute-activations", "granularity", "norm", "rope", "eps", "async-save", "overlap", "signal",
        "layers-per-virtual-stage", "no-ops"])
def test_megatron_spellings_configure_what_megalites_do(megatron, ours):
    got, want = parse(megatron), parse(ours)
    assert got == want
    assert C.model_config(got) == C.model_config(want)


def test_megatron_flags_without_effect_are_listed_once():
    cfg = parse(["--use-mcore-models", "--transformer-impl", "transformer_engine", "--tp", "1"])
    assert cfg.ignored_flags == ("--transformer-impl", "--use-mcore-models")


def test_megatron_lm_accepts_these_and_so_does_megalite_with_a_note():
    """Issue #48: refused where Megatron-LM accepts them."""
    cfg = parse(["--save-interval", "100"])  # no --save: nothing to save
    assert cfg.checkpoint.save_interval is None and "--save-interval (without --save nothing is saved)" in \
        cfg.ignored_flags
    assert parse(["--save", "ckpt", "--save-interval", "0"]).checkpoint.save_interval == 0  # only at the end
    flex = parse(["--model", "moe-tiny", "--moe-token-dispatcher-type", "flex"])
    assert flex.moe.moe_token_dispatcher_type == "alltoall"
    assert any(note.startswith("--moe-token-dispatcher-type flex") for note in flex.ignored_flags)


def test_kv_channels_sets_the_heads_width_and_mla_keeps_its_own():
    assert C.model_config(parse([])).head_dim == 32  # gpt-tiny: 128 / 4
    assert C.model_config(parse(["--kv-channels", "64"])).head_dim == 64
    # 100 / 3 is no width at all: with --kv-channels the hidden size need not divide by the heads
    assert C.model_config(parse(["--hidden-size", "100", "--num-attention-heads", "3", "--kv-channels", "32"])
                          ).head_dim == 32
    with pytest.raises(UsageError, match=r"not divisible by num_attention_heads \(3\): set kv_channels"):
        C.model_config(parse(["--hidden-size", "100", "--num-attention-heads", "3"]))
    # Megatron-LM's DeepSeek scripts pass --kv-channels, which MLA never reads
    assert C.model_config(parse(["--model", "deepseek-tiny", "--kv-channels", "128"])).kv_channels is None


def test_max_position_embeddings_is_kept_and_bounds_the_sequence():
    cfg = parse(["--max-position-embeddings", "256", "--seq-length", "64"])
    assert C.model_config(cfg).max_position_embeddings == 256
    assert parse(["--max-position-embeddings", "96"]).model.seq_length == 96
    with pytest.raises(UsageError, match="--seq-length 512 is above --max-position-embeddings 256"):
        C.model_config(parse(["--max-position-embeddings", "256", "--seq-length", "512"]))


def test_init_method_std_and_zero_centred_norms_reach_the_model():
    assert C.model_config(parse(["--init-method-std", "0.006"])).init_method_std == 0.006
    assert C.model_config(parse(["--apply-layernorm-1p"])).layernorm_zero_centered_gamma


def _lrs(cfg):
    warmup, decay, wsd = C.lr_schedule_lengths(cfg)
    o = cfg.optimizer
    s = LRSchedule(o.lr, o.min_lr, warmup, decay, o.lr_decay_style, wsd, o.lr_wsd_decay_style)
    return [s(i) for i in range(cfg.training.train_iters)]


def test_sample_based_schedules_equal_the_iteration_ones_when_the_batch_divides():
    by_samples = parse(["--train-samples", "800", "--lr-decay-samples", "640", "--lr-warmup-samples", "80"])
    by_iters = parse(["--train-iters", "50", "--lr-decay-iters", "40", "--lr-warmup-iters", "5"])
    assert by_samples.training.train_iters == 50
    assert _lrs(by_samples) == _lrs(by_iters)
    # A length in samples that is not a whole number of steps: the steps round down, the decay does not.
    cfg = parse(["--train-samples", "170"])
    assert cfg.training.train_iters == 10 and C.lr_schedule_lengths(cfg)[1] == 170 / 16


def test_a_warmup_shorter_than_a_step_never_exceeds_the_peak():
    lrs = _lrs(parse(["--train-iters", "3", "--lr-warmup-fraction", "0.001", "--lr", "6e-5", "--min-lr", "6e-6"]))
    assert max(lrs) == lrs[0] == 6e-5


def test_warmup_fraction_is_of_the_decay_length():
    cfg = parse(["--train-iters", "100", "--lr-decay-iters", "80", "--lr-warmup-fraction", "0.1"])
    assert C.lr_schedule_lengths(cfg)[:2] == (8.0, 80)
    assert _lrs(cfg) == _lrs(parse(["--train-iters", "100", "--lr-decay-iters", "80", "--lr-warmup-iters", "8"]))


@pytest.mark.parametrize("shape, at_half", [("linear", 0.5), ("cosine", 0.5), ("exponential", 2 * 0.5 ** 0.5 - 1),
                                            ("minus_sqrt", 1 - 0.5 ** 0.5)])
def test_wsd_holds_the_peak_then_decays_over_its_last_steps(shape, at_half):
    cfg = parse(["--train-iters", "40", "--lr-warmup-iters", "4", "--lr", "1.0", "--min-lr", "0.0",
                 "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "10", "--lr-wsd-decay-style", shape])
    lrs = _lrs(cfg)
    assert lrs[3:31] == [1.0] * 28  # stable until decay - wsd = 30
    assert lrs[35] == pytest.approx(at_half)
    assert lrs[39] < lrs[35]


@pytest.mark.parametrize("argv, message", [
    (["--lr-warmup-iters", "3", "--lr-warmup-fraction", "0.1"], "--lr-warmup-iters and --lr-warmup-fraction"),
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs the length of its final decay"),
    (["--bf16", "--fp16"], "--bf16 and --fp16 exclude each other"),
])
def test_conflicting_settings_name_both(argv, message):
    with pytest.raises(UsageError, match=message):
        C.model_config(parse(argv))


def _print_config(argv, world, entry="pretrain_gpt.py", here=None):
    """`python entry argv --print-config` launched as rank 0 of `world`; or, given `here` (pytest's
    monkeypatch and capsys), the entry point's main in this process with that environment: the same
    parse, checks and printing, without a Python start-up."""
    env = {"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0", "PATH": "/usr/bin:/bin"}
    if here is None:
        return subprocess.run([sys.executable, str(ROOT / entry), *argv, "--print-config"], capture_output=True,
                              text=True, timeout=120, cwd=ROOT, env=env)
    return _main_here(entry, [*argv, "--print-config"], {k: v for k, v in env.items() if k != "PATH"}, *here)


def _main_here(entry, argv, env, monkeypatch, capsys):
    """The entry point's main(argv) in this process, with `env` set: as a finished process would say it."""
    import importlib

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MEGALITE_QUIET", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    code = importlib.import_module(Path(entry).stem).main(argv)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([entry, *argv], code, out, err)


def test_print_config_checks_the_world_size_and_prints_a_file_config_reads(tmp_path, monkeypatch, capsys):
    """The file is printed by a launched process (stdout is the file alone); the refusal runs in this one."""
    run = _print_config(["--tp", "2", "--pp", "2", "--data-path", "/nonexistent/prefix", "--tokenizer", "x.model"], 8)
    assert run.returncode == 0, run.stderr
    assert "checked for 8 ranks (data-parallel size 2)" in run.stdout
    path = tmp_path / "run.toml"
    path.write_text(run.stdout)
    cfg = parse(["--config", str(path)])
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.data.data_path) == (2, 2, ["/nonexistent/prefix"])
    bad = _print_config(["--tp", "3"], 8, here=(monkeypatch, capsys))
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip() == ("megalite: error: --tp 3 does not divide the number of ranks (8): use a --tp among "
                                  "the divisors of 8, or launch a multiple of 3 ranks")


def test_help_is_grouped_by_section():
    text = C.build_parser("x", "gpt-tiny").format_help()
    for name in C.SECTIONS:
        assert f"[{name}]" in text
    assert "--tensor-model-parallel-size" in text and "Megatron-LM flags accepted without effect" in text


def test_the_configuration_page_is_generated_from_the_sections():
    from megalite.config.docs import reference_markdown

    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == reference_markdown(), "regenerate: python -m megalite.config docs > docs/configuration.md"
    for name, cls in C.SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in page


LOSSES_BEFORE = json.loads((ROOT / "tests" / "fixtures" / "losses_before_config.json").read_text())["runs"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp2vpp", "bert"])
def test_runs_train_with_the_losses_recorded_before_the_typed_configuration(name, tmp_path):
    """pp2vpp runs under torchrun; bert runs its entry point's main on the ranks of one spawn (same flags)."""
    from cli import losses, torchrun
    from helpers import rel_err

    import torch

    from training_ranks import entry_main

    from megalite.testing import run_ranks

    run = LOSSES_BEFORE[name]
    path = tmp_path / "m.jsonl"
    argv = ["--mock-data", "--train-iters", "6", "--log-interval", "1", "--seq-length", "32", "--eval-interval", "0",
            *run["flags"], "--metrics-file", str(path)]
    if name == "pp2vpp":
        done = torchrun(run["entry"], run["nproc"], *argv)
        assert done.returncode == 0, done.stderr[-3000:]
    else:
        ranks = run_ranks(entry_main, run["nproc"], args=(argv, Path(run["entry"]).stem))
        assert [code for code, *_ in ranks] == [0] * run["nproc"]
    assert rel_err(torch.tensor(losses(path)), torch.tensor(run["losses"])) <= 1e-5


def test_a_printed_file_writes_derived_values_as_comments_so_flags_over_it_derive_them_again(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(C.to_toml(parse(["--zero-stage", "3", "--train-samples", "1600"])))
    text = path.read_text()
    assert "# lr_warmup_iters = 10  (derived)" in text and "# train_iters = 100  (derived)" in text
    assert parse(["--config", str(path), "--zero-stage", "2"]).data_parallel.zero_reshard_after_forward is None
    assert parse(["--config", str(path), "--lr-warmup-fraction", "0.1"]).optimizer.lr_warmup_iters is None
    again = parse(["--config", str(path), "--global-batch-size", "32"])
    assert again.training.train_iters == 50 and C.lr_schedule_lengths(again)[1] == 50.0
    plain = tmp_path / "plain.toml"
    plain.write_text(C.to_toml(parse([])))
    assert parse(["--config", str(plain), "--use-distributed-optimizer"]).data_parallel.zero_stage == 1


def test_an_explicit_zero_decoupled_floor_is_kept():
    cfg = parse(["--lr", "1e-2", "--min-lr", "1e-3", "--decoupled-lr", "1e-4", "--decoupled-min-lr", "0"])
    C.model_config(cfg)
    assert cfg.optimizer.decoupled_min_lr == 0.0


def test_print_config_refuses_a_world_size_that_is_not_one(tmp_path, monkeypatch, capsys):
    """WORLD_SIZE=abc in a launched process; WORLD_SIZE=0 through the entry point's main in this one."""
    for world in ("abc", "0"):
        if world == "abc":
            run = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), "--print-config"],
                                 capture_output=True, text=True, timeout=120, cwd=ROOT,
                                 env={"WORLD_SIZE": world, "PATH": "/usr/bin:/bin"})
        else:
            run = _main_here("pretrain_gpt.py", ["--print-config"], {"WORLD_SIZE": world}, monkeypatch, capsys)
        assert run.returncode == 2 and f"WORLD_SIZE={world}" in run.stderr and "Traceback" not in run.stderr
