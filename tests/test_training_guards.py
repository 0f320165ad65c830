"""The loop and its inputs: numbers that are right at every layout, flags checked before anything
starts, --load that never silently starts from scratch, --finetune, and errors classified by what
happened (not by a word in their text)."""
from __future__ import annotations

import pytest

from cli import records, torchrun
from megalite import arguments
from megalite.runtime import UsageError, _lost_peer, run_main
from megalite.testing import RankFailure, run_ranks
from training_ranks import parse, train_losses

BASE = ["--train-iters", "4", "--log-interval", "1", "--seq-length", "16", "--global-batch-size", "8"]


def _valid_losses(path) -> list[float]:
    return [r["valid_loss"] for r in records(path, split="valid")]


@pytest.mark.parametrize("world,layout", [(2, []), (4, ["--tp", "2"]), (4, ["--pp", "2"])],
                         ids=["dp2", "tp2-dp2", "pp2-dp2"])
def test_validation_loss_is_the_same_at_every_layout(tmp_path, world, layout):
    argv = BASE + ["--eval-interval", "2", "--eval-iters", "2"]
    one, many = tmp_path / "one.jsonl", tmp_path / "many.jsonl"
    run_ranks(train_losses, 1, args=(argv + ["--metrics-file", str(one)],))
    run_ranks(train_losses, world, args=(argv + layout + ["--metrics-file", str(many)],))
    want, got = _valid_losses(one), _valid_losses(many)
    assert len(want) == 2 and len(got) == 2
    assert got == pytest.approx(want, rel=1e-5), (got, want)
    train = [r["loss"] for r in records(one)]
    assert 0.5 * train[-1] < want[-1] < 2 * train[0], "validation loss must be on the training loss's scale"


def _check(argv, world=1):
    args = parse(argv)
    config = arguments.model_config(args)
    return arguments.validate(args, world, config)


@pytest.mark.parametrize("argv,message", [
    (["--recompute", "full", "--recompute-num-layers", "-1"], "--recompute-num-layers must be an integer >= 1, got -1"),
    (["--recompute-num-layers", "2"], "--recompute-num-layers 2 applies to --recompute full only"),
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size must be an integer >= 1, got 0"),
    (["--fp16", "--loss-scale", "0"], "--loss-scale must be > 0, got 0.0"),
    (["--lr", "0"], "--lr must be > 0, got 0.0"),
    (["--lr", "nan"], "--lr must be > 0, got nan"),
    (["--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr 0.01 is above --lr 0.001"),
    (["--adam-beta1", "1.0"], "--adam-beta1 must be in [0, 1), got 1.0"),
    (["--adam-beta2", "-0.1"], "--adam-beta2 must be in [0, 1), got -0.1"),
    (["--adam-eps", "0"], "--adam-eps must be > 0, got 0.0"),
    (["--weight-decay", "-1"], "--weight-decay must be >= 0, got -1.0"),
    (["--clip-grad", "inf"], "--clip-grad must be >= 0, got inf"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be > 0, got 0.0"),
    (["--hidden-dropout", "1.0"], "--hidden-dropout must be in [0, 1), got 1.0"),
    (["--lr-warmup-iters", "-5"], "--lr-warmup-iters must be >= 0, got -5"),
    (["--fp16", "--min-loss-scale", "1e9"], "--min-loss-scale 1000000000.0 is above --initial-loss-scale"),
    (["--hysteresis", "0"], "--hysteresis must be an integer >= 1, got 0"),
    (["--timeline-iters", "0"], "--timeline-iters must be an integer >= 1, got 0"),
    (["--seed", "-1"], "--seed must be in [0, 2**63), got -1"),
    (["--num-layers", "0"], "--num-layers must be an integer >= 1, got 0"),
    (["--pipeline-layers", "5,-1", "--pp", "2"], "--pipeline-layers: stage 1 gets -1 layers; a stage holds 0 or more"),
    (["--finetune"], "--finetune needs --load DIR"),
], ids=lambda v: v if isinstance(v, str) and v.startswith("-") else None)
def test_bad_numbers_are_refused_before_anything_starts(argv, message):
    with pytest.raises(UsageError) as e:
        _check(argv, world=2 if "--pp" in argv else 1)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_the_defaults_and_sane_settings_pass():
    assert _check([]) == 1
    assert _check(["--fp16", "--loss-scale", "128", "--recompute", "full", "--recompute-num-layers", "1"]) == 1


def test_an_error_that_only_mentions_a_peer_is_not_a_lost_rank():
    assert _lost_peer(TypeError("unsupported operand for peer")) is None
    assert _lost_peer(KeyError("peer")) is None
    assert _lost_peer(NotImplementedError("socket")) is None

    def bug():
        raise TypeError("compare() got an unexpected keyword argument 'peer'")

    with pytest.raises(TypeError, match="peer"):  # its own traceback, not exit 4
        run_main(bug)


# Texts PyTorch's gloo, NCCL and store raise when a rank is gone or a collective hangs.
REAL_ERRORS = [
    ("RuntimeError", "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                     "[127.0.0.1]:29971", "lost contact with another rank"),
    ("RuntimeError", "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                     "600000ms for recv operation to complete", "timed out"),
    ("DistBackendError", "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, remote "
                         "process exited or there was a network error, NCCL version 2.21.5\nncclRemoteError: A call "
                         "failed possibly due to a network error or a remote process exiting prematurely.",
     "lost contact with another rank"),
    ("DistBackendError", "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42, "
                         "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600085 milliseconds "
                         "before timing out.", "timed out"),
    ("DistBackendError", "NCCL communicator was aborted on rank 3.", "lost contact with another rank"),
    ("DistBackendError", "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error (run with "
                         "NCCL_DEBUG=INFO for details), NCCL version 2.20.5\nncclSystemError: System call (e.g. "
                         "socket, malloc) or external library call failed or device error.",
     "lost contact with another rank"),
    ("DistStoreError", "Socket Timeout", "timed out"),
    ("DistNetworkError", "Connection reset by peer", "lost contact with another rank"),
]


@pytest.mark.parametrize("kind,text,what", REAL_ERRORS, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(REAL_ERRORS)])
def test_real_gloo_nccl_and_store_errors_are_recognised(kind, text, what):
    import torch.distributed as dist

    cls = RuntimeError if kind == "RuntimeError" else getattr(dist, kind)
    assert _lost_peer(cls(text)) == what


def test_a_command_line_error_is_printed_once_under_torchrun():
    run = torchrun("pretrain_gpt.py", 2, "--mock-data", "--no-such-flag", timeout=120)
    assert run.returncode != 0
    ours = [line for line in run.stderr.splitlines() if line.startswith("pretrain_gpt.py: error: unknown flag")]
    assert len(ours) == 1 and "usage: " not in run.stderr, run.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# --load and --finetune


def test_load_of_a_path_that_does_not_exist_is_an_error(tmp_path):
    with pytest.raises(RankFailure, match=r"--load \S+typo does not exist"):
        run_ranks(train_losses, 1, args=(BASE + ["--load", str(tmp_path / "typo")],))


def test_load_of_a_plain_file_is_an_error(tmp_path):
    f = tmp_path / "model.pt"
    f.write_bytes(b"not a checkpoint")
    with pytest.raises(RankFailure, match=r"--load \S+model.pt is a file"):
        run_ranks(train_losses, 1, args=(BASE + ["--load", str(f)],))


def test_load_of_an_empty_directory_is_an_error(tmp_path):
    with pytest.raises(RankFailure, match="holds no checkpoint"):
        run_ranks(train_losses, 1, args=(BASE + ["--load", str(tmp_path)],))


def test_the_restart_idiom_still_starts_from_scratch(tmp_path):
    ckpt = tmp_path / "ckpt"
    fresh = run_ranks(train_losses, 1, args=(BASE,))[0]
    again = run_ranks(train_losses, 1, args=(BASE + ["--save", str(ckpt), "--load", str(ckpt)],))[0]
    assert again == fresh


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt")
    losses = run_ranks(train_losses, 1, args=(BASE + ["--save", str(ckpt)],))[0]
    return ckpt, losses


def test_a_checkpoint_past_train_iters_is_refused_with_the_fix(saved_at_4):
    ckpt, _ = saved_at_4
    with pytest.raises(RankFailure, match=r"is at iteration 4, past --train-iters 2: raise --train-iters .* --finetune"):
        run_ranks(train_losses, 1, args=(BASE[2:] + ["--train-iters", "2", "--load", str(ckpt)],))


def test_finetune_starts_a_new_run_from_the_loaded_weights(saved_at_4, tmp_path):
    ckpt, first = saved_at_4
    argv = BASE[2:] + ["--train-iters", "3", "--load", str(ckpt), "--finetune"]
    tuned = run_ranks(train_losses, 1, args=(argv,))[0]
    assert len(tuned) == 3, "three new iterations, counted from 0"
    assert tuned[0] < first[0] - 1e-3, "the first loss starts from the trained weights, not from scratch"
    # Requeued with --save: the run's own checkpoint wins over the weights it started from.
    out = tmp_path / "out"
    run_ranks(train_losses, 1, args=(argv + ["--save", str(out)],))
    again = run_ranks(train_losses, 1, args=(argv + ["--save", str(out)],))[0]
    assert again == [], "already at --train-iters: nothing left to train"
    assert (out / "latest").read_text().strip() == "iter_0000003"


# ---------------------------------------------------------------------------------------------
# BERT logs its two losses and the MLM perplexity


def bert_run(rank, world, argv):
    import pretrain_bert
    from megalite.training import pretrain

    return pretrain(parse(argv + ["--model", "bert-tiny"]), pretrain_bert.task()).records


@pytest.mark.parametrize("world,layout", [(1, []), (2, ["--pp", "2"])], ids=["single", "pp2"])
def test_bert_logs_mlm_and_sop_losses_and_the_mlm_perplexity(tmp_path, world, layout):
    import math

    path = tmp_path / "m.jsonl"
    argv = BASE + ["--vocab-size", "300", "--eval-interval", "4", "--eval-iters", "1", "--metrics-file", str(path)]
    run_ranks(bert_run, world, args=(argv + layout,))
    train = records(path)
    assert len(train) == 4
    for r in train:
        assert r["mlm_loss"] > 0 and r["sop_loss"] > 0
        assert r["mlm_loss"] + r["sop_loss"] == pytest.approx(r["loss"], rel=1e-6)
        assert r["mlm_ppl"] == pytest.approx(math.exp(r["mlm_loss"]), rel=1e-6)
    (valid,) = records(path, split="valid")
    assert valid["valid_mlm_loss"] + valid["valid_sop_loss"] == pytest.approx(valid["valid_loss"], rel=1e-6)
    assert valid["valid_ppl"] == pytest.approx(math.exp(valid["valid_mlm_loss"]), rel=1e-6)


def fails_with(rank, world, seed):
    raise ValueError("boom")


def test_a_multi_rank_failure_names_the_arguments_and_so_the_seed():
    with pytest.raises(RankFailure, match=r"failed running fails_with\(987654321,\)"):
        run_ranks(fails_with, 1, args=(987654321,))


def test_a_lost_peer_line_names_the_last_collective_launched():
    """Issue #34: a rank lost during a ZeRO-3 gather at PP 1 was reported as a pipeline send/recv; the
    line now names the last collective megalite launched (its kind and group size)."""
    from megalite.parallel import traffic
    from megalite.runtime import set_phase

    def gather_then_lose():
        set_phase("iteration 3: the forward/backward schedule")
        traffic.gather_or_scatter("dp", 1024, 4)  # ZeRO-3's parameter all-gather, as zero3.py counts it
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")

    import io
    from contextlib import redirect_stderr

    err = io.StringIO()
    with redirect_stderr(err):
        assert run_main(gather_then_lose) == 4
    line = err.getvalue().strip()
    assert line.startswith("megalite: error: rank 0 lost contact with another rank in iteration 3: the "
                           "forward/backward schedule, the last collective launched a data-parallel collective "
                           "(gradient reduction, or the optimizer's or ZeRO's parameter gather) over 4 ranks"), line
    assert "pipeline" not in line


_HANGING_TEARDOWN = """
import datetime, os, sys, threading, time
import torch.distributed as dist
from megalite import runtime
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
runtime.TEARDOWN_AFTER_LOSS_S = 1.0
dist.destroy_process_group = lambda *a, **k: threading.Event().wait()  # a transfer to a dead host
def lose():
    raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer")
print("returned", runtime.run_main(lose))
"""


def test_a_rank_that_lost_a_peer_ends_even_when_tearing_down_its_groups_hangs(tmp_path):
    """CI saw both ranks of the surviving host print their line and then hang in
    destroy_process_group (gloo waiting out transfers to the cut-off host): the teardown after a lost
    peer is bounded, and the rank still exits with code 4."""
    import subprocess
    import sys
    import time

    from megalite.runtime import _free_port

    started = time.monotonic()
    run = subprocess.run([sys.executable, "-c", _HANGING_TEARDOWN, str(_free_port())], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 4, run.stderr[-3000:]
    assert "returned" not in run.stdout  # it did not wait for the hung teardown to come back
    assert "megalite: error: rank 0 lost contact with another rank" in run.stderr, run.stderr[-3000:]
    assert time.monotonic() - started < 60


_HANGING_EXIT = """
import datetime, os, sys, threading
import torch.distributed as dist
from megalite import runtime
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
threading.Thread(target=threading.Event().wait).start()  # what the interpreter's exit would wait for
def lose():
    raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer")
runtime.exit_process(runtime.run_main(lose))
"""


def test_a_rank_that_lost_a_peer_exits_even_when_the_interpreters_exit_would_hang():
    """CI saw both ranks of the surviving host print their line and tear their groups down, then
    not exit in 90 s (the interpreter's exit waiting on what was left of the groups): after a lost
    peer the entry points end the process without Python's shut-down (runtime.exit_process)."""
    import subprocess
    import sys
    from pathlib import Path

    from megalite.runtime import _free_port

    run = subprocess.run([sys.executable, "-c", _HANGING_EXIT, str(_free_port())], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 4, run.stderr[-3000:]
    assert "megalite: error: rank 0 lost contact with another rank" in run.stderr, run.stderr[-3000:]
    # any other code goes through sys.exit: the interpreter's usual exit (here: it would wait, so a
    # finished thread instead)
    ok = _HANGING_EXIT.replace("threading.Event().wait", "lambda: None").replace(
        "runtime.run_main(lose)", "runtime.run_main(lambda: None)")
    assert subprocess.run([sys.executable, "-c", ok, str(_free_port())], timeout=60).returncode == 0
    root = Path(__file__).resolve().parent.parent  # every entry point ends through it
    for entry in ("pretrain_gpt.py", "pretrain_bert.py", "megalite/tools/generate.py", "megalite/tools/lm_eval.py"):
        assert "exit_process(main())" in (root / entry).read_text(), entry
