"""Issue #48: on resume nothing changes silently. Every configuration field is in one class of
megalite.training.resume_policy.POLICY (docs/checkpoints.md prints it); a change is said in one line
or refused in one line naming the field, where its value came from and the flag that overrides it.

The checkpoints here hold metadata only (no tensors: the policy reads the configuration), written as a
training run writes it (its `run_config`), so each case takes milliseconds; one slow test trains."""
import dataclasses
import json
import re
from pathlib import Path

import pytest

from megalite import checkpoint
from megalite.checkpoint.sealed import SEAL, sealed
from megalite.config import build_parser, model_config, validate
from megalite.config.fields import spec_of
from megalite.config.run import FIELD_SECTION, SECTIONS
from megalite.errors import UsageError
from megalite.training import resume_policy
from megalite.training.build import lr_schedules
from megalite.training.checkpoint_shape import adopt_checkpoint_shape

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16"]
MOE = ["--num-experts", "4", "--moe-expert-capacity-factor", "1.0", "--moe-aux-loss-coeff", "0.01"]
SAVED = [*SMALL, *MOE, "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "2e-3", "--min-lr", "1e-4",
         "--lr-warmup-iters", "2", "--train-iters", "20"]


def parse(argv):
    return build_parser("test", "gpt-tiny").parse_args(argv)


def saved_checkpoint(directory: Path, argv, iteration: int = 10) -> Path:
    """A checkpoint as the run `argv` saves it at `iteration` (its model config and run_config)."""
    cfg = parse(argv)
    checkpoint.save_model_checkpoint(directory, model_config(cfg), "gpt", {}, iteration=iteration)
    meta_path = directory / f"iter_{iteration:07d}" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta.pop(SEAL)
    meta["run_config"] = cfg.to_dict()  # what training.saving writes
    meta_path.write_text(json.dumps(sealed(meta)))
    return directory


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return saved_checkpoint(tmp_path_factory.mktemp("moe"), SAVED)


@pytest.fixture
def said(monkeypatch, capsys):
    """Resume with these flags: (the configuration, the lines said)."""
    monkeypatch.delenv("MEGALITE_QUIET", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def resume(ckpt, *argv):
        cfg = adopt_checkpoint_shape(parse(["--mock-data", "--load", str(ckpt), *argv]))
        return cfg, [line for line in capsys.readouterr().out.splitlines() if not line.startswith("megalite: model")]
    return resume


def test_every_field_is_in_exactly_one_class_and_the_docs_print_the_table():
    names = [n for kind in resume_policy.CLASSES for n in resume_policy._TABLE[kind].split()]
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    assert set(names) == set(FIELD_SECTION), ("classify every field in resume_policy._TABLE: missing "
                                              f"{sorted(set(FIELD_SECTION) - set(names))}, unknown "
                                              f"{sorted(set(names) - set(FIELD_SECTION))}")
    shape = {f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls) if not spec_of(f).resume}
    # --openai-gelu is no shape flag of the command line (it keeps --load's model adoption), but the built
    # model's activation is compared as its shape: a change is refused, so it is classed with them.
    assert {n for n, kind in resume_policy.POLICY.items() if kind == "shape"} == shape | {"openai_gelu"}
    page = (ROOT / "docs" / "checkpoints.md").read_text()
    for kind in resume_policy.CLASSES:
        row = next(line for line in page.splitlines() if line.startswith(f"| {kind} |"))
        documented = set(re.findall(r"`(\w+)`", row.split("|")[2]))
        assert documented == {n for n, k in resume_policy.POLICY.items() if k == kind}, kind


def test_the_same_command_again_says_nothing_and_changes_nothing(moe_ckpt, said):
    cfg, lines = said(moe_ckpt, *SAVED)
    assert lines == []
    assert cfg.flat() == parse(["--load", str(moe_ckpt), *SAVED]).flat()


def test_load_alone_takes_the_batch_schedule_and_experts_and_says_so_once(moe_ckpt, said):
    cfg, lines = said(moe_ckpt, "--train-iters", "20")
    assert (cfg.training.global_batch_size, cfg.optimizer.lr, cfg.optimizer.min_lr, cfg.optimizer.lr_warmup_iters) == \
        (4, 2e-3, 1e-4, 2)
    assert (cfg.moe.num_experts, cfg.moe.moe_expert_capacity_factor, cfg.moe.moe_aux_loss_coeff) == (4, 1.0, 0.01)
    assert len(lines) == 1 and lines[0].startswith(f"megalite: from the checkpoint {moe_ckpt}/iter_0000010 (not "
                                                   f"given here): ")
    for item in ("moe_expert_capacity_factor 1", "lr 0.002", "lr_warmup_iters 2", "global_batch_size 4"):
        assert item in lines[0]


@pytest.mark.parametrize("argv", [["--num-experts", "4"], ["--moe-aux-loss-coeff", "0.01"]])
def test_a_dropped_capacity_factor_stays_the_checkpoints(moe_ckpt, said, argv):
    """Before: any MoE flag given dropped the checkpoint's whole [moe] section, token dropping too."""
    cfg, _ = said(moe_ckpt, "--train-iters", "20", *argv)
    assert cfg.moe.moe_expert_capacity_factor == 1.0 and model_config(cfg).moe_expert_capacity_factor == 1.0
    assert cfg.moe.num_experts == 4 and cfg.moe.moe_aux_loss_coeff == 0.01


@pytest.mark.parametrize("flag,value,old", [("--moe-expert-capacity-factor", "2.0", "1"),
                                            ("--moe-token-dispatcher-type", "allgather", "alltoall"),
                                            ("--moe-aux-loss-coeff", "0.02", "0.01"),
                                            ("--moe-token-drop-policy", "position", "probs")])
def test_a_changed_router_setting_is_said_in_one_line_and_the_experts_stay(moe_ckpt, said, flag, value, old):
    """Before: refused with the wrong advice "add --num-experts N"."""
    cfg, lines = said(moe_ckpt, "--train-iters", "20", flag, value)
    assert cfg.moe.num_experts == 4 and model_config(cfg).num_moe_experts == 4
    name = flag[2:].replace("-", "_")
    new = f"{float(value):g}" if value[0].isdigit() else value
    assert [line for line in lines if "note" in line] == [
        f"megalite: note: on resume {name} {old} (the checkpoint's) -> {new} ({flag})"]


@pytest.mark.parametrize("argv,says", [
    (["--num-experts", "8"], "--num-experts 8: the checkpoint {p} holds experts of another shape: num_experts 4 "
                             "(checkpoint) vs 8 (now); drop the flag"),
    (["--moe-ffn-hidden-size", "128"], "moe_ffn_hidden_size 256 (checkpoint) vs 128 (now)"),
    (["--moe-layer-freq", "[1,0]"], "moe_layer_freq [1,1] (checkpoint) vs [1,0] (now)"),
    (["--moe-router-topk", "3"], "moe_router_topk 2 (checkpoint) vs 3 (now)"),
])
def test_a_changed_expert_shape_is_refused_in_one_line(moe_ckpt, said, argv, says):
    with pytest.raises(UsageError) as e:
        said(moe_ckpt, *argv)
    assert says.format(p=f"{moe_ckpt}/iter_0000010") in str(e.value) and "\n" not in str(e.value)


def test_moe_flags_on_a_dense_checkpoint_are_refused_naming_the_checkpoint(tmp_path, said):
    ckpt = saved_checkpoint(tmp_path, SMALL)
    with pytest.raises(UsageError, match=r"^--moe-aux-loss-coeff: the checkpoint .* holds a dense model \(no "
                                         r"experts\): drop it to train it, or --load a mixture-of-experts checkpoint$"):
        said(ckpt, "--moe-aux-loss-coeff", "0.1")


def test_a_layer_pattern_without_experts_is_refused():
    with pytest.raises(UsageError, match=r"^--moe-layer-freq \[0,0\] gives no layer experts \(--num-experts 8\)"):
        model_config(parse([*SMALL, "--num-experts", "8", "--moe-layer-freq", "[0,0]"]))


@pytest.mark.parametrize("argv,item", [
    (["--lr", "0.01"], "lr 0.01 (--lr) vs the checkpoint's 0.002"),
    (["--min-lr", "0"], "min_lr 0 (--min-lr) vs the checkpoint's 0.0001"),
    (["--lr-warmup-iters", "5"], "warm-up 5 iterations (--lr-warmup-iters) vs the checkpoint's 2"),
    (["--lr-decay-style", "linear"], "lr_decay_style linear (--lr-decay-style) vs the checkpoint's cosine"),
    (["--lr-decay-iters", "50"], "decay 50 iterations (--lr-decay-iters) vs the checkpoint's 20"),
    (["--weight-decay", "0"], "weight_decay 0 (--weight-decay) vs the checkpoint's 0.1"),
])
def test_a_changed_schedule_is_refused_naming_both_scheduler_flags(moe_ckpt, said, argv, item):
    with pytest.raises(UsageError) as e:
        said(moe_ckpt, "--train-iters", "20", *argv)
    message = str(e.value)
    assert message.startswith(f"this run's learning-rate schedule differs from the checkpoint "
                              f"{moe_ckpt}/iter_0000010's")
    assert item in message and "\n" not in message
    assert "add --override-opt_param-scheduler" in message and "--use-checkpoint-opt_param-scheduler" in message


def test_override_trains_on_the_command_lines_schedule_and_use_checkpoint_on_the_checkpoints(moe_ckpt, said):
    new, lines = said(moe_ckpt, *SAVED, "--lr", "0.01", "--override-opt_param-scheduler")
    assert lines == ["megalite: note: --override-opt_param-scheduler: lr 0.002 (the checkpoint's) -> 0.01 (--lr)"]
    # Megatron-LM's meaning: the whole schedule of the command line, its defaults too, each change said
    _, lines = said(moe_ckpt, "--train-iters", "20", "--lr", "0.01", "--override-opt_param-scheduler")
    assert lines[-2:] == ["megalite: note: --override-opt_param-scheduler: lr 0.002 (the checkpoint's) -> 0.01 (--lr)",
                          "megalite: note: --override-opt_param-scheduler: warm-up 2 iterations (the checkpoint's) "
                          "-> 10 (derived)"]
    old, lines = said(moe_ckpt, "--train-iters", "20", "--lr", "0.01", "--use-checkpoint-opt_param-scheduler")
    assert lines[-1] == ("megalite: note: --use-checkpoint-opt_param-scheduler: lr stays the checkpoint's 0.002 "
                         "(--lr 0.01 set aside)")
    saved = parse(SAVED)
    for at in (0, 1, 5, 12, 19):  # warm-up, then the cosine decay
        assert lr_schedules(old)[0](at) == lr_schedules(saved)[0](at)
        assert lr_schedules(new)[0](at) == pytest.approx(lr_schedules(saved)[0](at) * 0.01 / 2e-3 if at < 2 else
                                                         lr_schedules(parse([*SAVED, "--lr", "0.01"]))[0](at))
    assert lr_schedules(new)[0](1) == 0.01


def test_a_longer_run_keeps_the_checkpoints_decay_unless_overridden(moe_ckpt, said):
    cfg, lines = said(moe_ckpt, "--train-iters", "40")
    assert cfg.optimizer.lr_decay_iters == 20 and "lr_decay_iters 20" in lines[0]
    assert lr_schedules(cfg)[0](30) == 1e-4  # trains on at the checkpoint's floor
    assert lines[1] == "megalite: note: on resume train_iters 20 (the checkpoint's) -> 40 (--train-iters)"
    longer, _ = said(moe_ckpt, "--train-iters", "40", "--override-opt_param-scheduler")
    assert longer.optimizer.lr_decay_iters is None and lr_schedules(longer)[0](30) > 1e-4


def test_the_two_scheduler_flags_are_one_choice_and_need_load():
    with pytest.raises(UsageError, match="disagree: keep one"):
        model_config(parse(["--load", "x", "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"]))
    with pytest.raises(UsageError, match=r"^--override-opt_param-scheduler needs --load DIR"):
        model_config(parse(["--override-opt_param-scheduler"]))


def test_finetuning_is_a_new_run_with_the_command_lines_schedule_and_batch(moe_ckpt, said):
    cfg, lines = said(moe_ckpt, "--finetune", "--lr", "0.01", "--train-iters", "5")
    assert (cfg.optimizer.lr, cfg.training.global_batch_size, cfg.moe.num_experts) == (0.01, 16, 4)
    assert not any("note" in line for line in lines)


def test_other_changes_are_said_once_each_with_their_source(moe_ckpt, said):
    cfg, lines = said(moe_ckpt, "--train-iters", "20", "--seed", "7", "--hidden-dropout", "0.1", "--clip-grad", "0.5")
    assert [line for line in lines if "note" in line] == [
        "megalite: note: on resume hidden_dropout 0 (the checkpoint's) -> 0.1 (--hidden-dropout)",
        "megalite: note: on resume seed 1234 (the checkpoint's) -> 7 (--seed)",
        "megalite: note: on resume clip_grad 1 (the checkpoint's) -> 0.5 (--clip-grad)"]
    assert cfg.training.seed == 7


def test_an_error_about_a_value_from_the_checkpoint_names_the_checkpoint(moe_ckpt, said, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UsageError, match=r"^the checkpoint's num_experts 4 is not divisible by --ep 3"):
        said(moe_ckpt, "--train-iters", "20", "--ep", "3", "--global-batch-size", "6")
    with pytest.raises(UsageError, match=r"^the checkpoint's global_batch_size 4 is not divisible by "
                                         r"--micro-batch-size 2 x data-parallel size 3"):
        said(moe_ckpt, "--train-iters", "20", "--micro-batch-size", "2")
    cfg, _ = said(moe_ckpt, "--train-iters", "20", "--global-batch-size", "5")  # given: the run's own check says it
    with pytest.raises(UsageError, match=r"^--global-batch-size 5 is not divisible"):
        validate(cfg, 3, model_config(cfg))


@pytest.mark.slow
def test_a_resumed_run_trains_on_the_schedule_the_scheduler_flags_choose(tmp_path):
    from megalite.testing import run_ranks

    base = ["--train-iters", "4", "--log-interval", "1", "--seq-length", "16", "--global-batch-size", "4",
            "--micro-batch-size", "2", "--num-layers", "2", "--hidden-size", "64", "--eval-interval", "0",
            "--lr-warmup-iters", "1", "--lr", "2e-3"]
    lrs = run_ranks(_save_then_resume, 1, args=(str(tmp_path), base))[0]
    assert lrs["checkpoint's"] == pytest.approx(lrs["unbroken"][2:])
    new = lr_schedules(parse(["--mock-data", *base, "--lr", "1e-2"]))[0]
    assert lrs["override"] == pytest.approx([new(2), new(3)]) and lrs["override"][0] > 3 * lrs["unbroken"][2]


def _save_then_resume(rank, world, directory, base):
    from training_ranks import gpt_run

    out = {"unbroken": [r["lr"] for r in gpt_run(base).records]}
    gpt_run([*base, "--save", directory, "--exit-interval", "2"])
    out["checkpoint's"] = [r["lr"] for r in gpt_run([*base, "--load", directory, "--lr", "1e-2",
                                                     "--use-checkpoint-opt_param-scheduler"]).records]
    out["override"] = [r["lr"] for r in gpt_run([*base, "--load", directory, "--lr", "1e-2",
                                                 "--override-opt_param-scheduler"]).records]
    return out
