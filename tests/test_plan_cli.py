"""The layout planner's command line (megalite.tools.plan): the table, its rejections and a command megalite
accepts, JSON, custom shapes, one message for a model too large, `python -m`, a pretrain configuration
checked, and pretrain's --plan warning before training."""
import json
import shlex
import subprocess
import sys

import pytest

from megalite import arguments
from megalite.testing import run_ranks
from megalite.tools import plan as P
from training_ranks import parse


def run_cli(argv, capsys):
    code = P.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_table_rejections_and_a_command_megalite_accepts(capsys):
    code, out, _ = run_cli(["--model", "gpt-1.3b", "--gpus", "16", "--gpu-memory-gib", "24", "--global-batch-size",
                            "64", "--seq-length", "2048", "--top", "3", "--explain"], capsys)
    assert code == 0
    assert "step s" in out and "rejected" in out and "does not fit" in out
    lines = out.splitlines()
    table = [ln for ln in lines if ln[:3].strip().isdigit() and "|" in ln]
    assert len(table) == 3
    cmd = next(ln.strip() for ln in lines if ln.strip().startswith("torchrun"))
    assert "compute" in out and "bubble" in out  # --explain
    words = shlex.split(cmd)
    flags = words[words.index("pretrain_gpt.py") + 1:]
    args = arguments.build_parser("x", default_model="gpt-tiny").parse_args(flags)
    config = arguments.model_config(args)
    assert arguments.validate(args, 16, config) == 16 // (args.parallel.tp * args.parallel.pp)


def test_cli_json_and_custom_shape(capsys):
    code, out, _ = run_cli(["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8",
                            "--vocab-size", "32000", "--gpus", "4", "--global-batch-size", "16", "--seq-length", "512",
                            "--json", "--top", "2"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["feasible"] > 0 and len(data["best"]) == 2 and data["rejected"] is not None
    b = data["best"][0]
    assert b["fits"] and b["time_s"]["total"] > 0 and b["memory_bytes"]["total"] > 0
    assert "--num-layers 8" in data["command"] and "--vocab-size 32000" in data["command"]


def test_cli_model_too_large_fails_with_one_message(capsys):
    code, out, err = run_cli(["--model", "gpt-175b", "--gpus", "8", "--global-batch-size", "8",
                              "--seq-length", "2048"], capsys)
    assert code != 0 and out == ""
    assert err.count("\n") == 1 and "no layout of gpt-175b fits 8 GPUs" in err


def test_cli_as_a_module(capsys):
    proc = subprocess.run([sys.executable, "-m", "megalite.tools.plan", "--model", "gpt2-124m", "--gpus", "2",
                           "--global-batch-size", "8", "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["best"][0]["layout"]["tp"] in (1, 2)
    # A missing required flag: the module's main exits 2 naming it (argparse's exit, the module's exit
    # code: `python -m` above runs sys.exit(main())); checked in this process.
    with pytest.raises(SystemExit) as stop:
        P.main(["--model", "gpt2-124m", "--gpus", "2"])
    assert stop.value.code == 2 and "--global-batch-size" in capsys.readouterr().err


def test_check_run_takes_a_pretrain_configuration():
    from megalite.training.plan_check import check_run

    args = parse(["--model", "gpt2-350m", "--tp", "2", "--micro-batch-size", "4", "--global-batch-size", "64",
                  "--seq-length", "1024", "--bf16", "--recompute", "selective", "--sequence-parallel"])
    fits, pred = check_run(args, world_size=4, gpu_memory_bytes=80 * P.GIB)
    assert fits and pred.layout == P.Layout(2, 1, 2, None, 4, "selective", True, False)
    fits, pred = check_run(args, world_size=4, gpu_memory_bytes=4 * P.GIB)
    assert not fits and pred.reason.startswith("does not fit")
    assert not pred.run.tp_comm_overlap and not pred.run.overlap_moe_ep_comm
    # the overlaps the run asks for are the ones its exposed communication is predicted with
    argv = ["--model", "gpt2-350m", "--tp", "2", "--micro-batch-size", "4", "--global-batch-size", "64",
            "--seq-length", "1024", "--bf16", "--sequence-parallel"]
    _, plain = check_run(parse(argv), 4, gpu_memory_bytes=80 * P.GIB)
    _, overlapped = check_run(parse([*argv, "--tp-comm-overlap"]), 4, gpu_memory_bytes=80 * P.GIB)
    assert overlapped.run.tp_comm_overlap and not plain.run.tp_comm_overlap
    assert overlapped.exposed["tp"].exposed < plain.exposed["tp"].exposed


def pretrain_gpt_runs(rank, world, runs):
    """pretrain_gpt.main on each argv of `runs` in turn, one process: (exit code, stdout) of each."""
    import contextlib
    import io

    import pretrain_gpt

    out = []
    for argv in runs:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = pretrain_gpt.main(argv)
        out.append((code, printed.getvalue()))
    return out


def test_pretrain_plan_flag_warns_before_training(tmp_path):
    run = ["--mock-data", "--train-iters", "1", "--seq-length", "32", "--plan", "--plan-gpu-memory-gib"]
    # Both runs in one rank process (pretrain_gpt.main tears its process group down after each run).
    [[(code, small), (_, roomy)]] = run_ranks(pretrain_gpt_runs, 1, args=([run + ["0.5"], run + ["80"]],),
                                             env={"MEGALITE_QUIET": ""}, timeout=300)
    assert code == 0, small[-2000:]
    assert "warning: the planner predicts this layout will not fit: does not fit" in small
    before, after = small.split("will not fit", 1)
    assert "iter " not in before and "iter " in after  # before training, which then runs
    assert "plan: this layout needs about" in roomy
