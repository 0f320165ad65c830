"""Checkpoints: exact resume, resharding to other layouts (distributed optimizer included),
atomic saves that survive a crash, clean exits on SIGTERM, guards and clear errors."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cli import ROOT, records
from helpers import rel_err
from megalite import checkpoint
from megalite.runtime import UsageError
from megalite.testing import RankFailure, run_ranks
from training_ranks import several, train_losses, train_with_inf_at

# 6 iterations, saved or stopped at 3: a resume shows at any length (3 optimizer steps on each side of
# it), the steps after it are the cost.
BASE = ["--train-iters", "6", "--log-interval", "1", "--seq-length", "32", "--global-batch-size", "8",
        "--micro-batch-size", "2"]


def layout(tp, pp):
    return ["--tp", str(tp), "--pp", str(pp)]


@pytest.fixture(scope="module")
def unbroken():
    return run_ranks(train_losses, 1, args=(BASE,))[0]


def test_resume_is_bitwise_exact(tmp_path):
    argv = BASE + layout(2, 1) + ["--hidden-dropout", "0.1", "--attention-dropout", "0.1",
                                  "--use-distributed-optimizer"]
    # (tp, pp, dp) = (2, 1, 2): the unbroken run and the first half in one spawn; the resume in fresh processes
    whole, first = run_ranks(several, 4, args=(train_losses, [argv, argv + ["--save", str(tmp_path),
                                                                            "--exit-interval", "3"]]))[0]
    assert (tmp_path / "latest").read_text().strip() == "iter_0000003"
    second = run_ranks(train_losses, 4, args=(argv + ["--load", str(tmp_path)],))[0]
    assert len(whole) == 6
    assert first + second == whole, "3 + 3 resumed iterations must equal 6 unbroken ones, bit for bit"


# (tp, pp, extra flags) saved at 4 ranks, then loaded as (tp, pp, world, extra flags).
@pytest.mark.parametrize("saved,loads", [
    ((2, 2, []), [(1, 1, 1, []), (4, 1, 4, []), (1, 2, 4, ["--use-distributed-optimizer"])]),
    ((1, 2, ["--use-distributed-optimizer"]), [(2, 1, 2, [])]),
], ids=["from-221", "from-122-zero1"])
def test_reshard_to_other_layouts_continues_the_unbroken_run(tmp_path, unbroken, saved, loads):
    """The loads at the saving world size run in the saving spawn, after the save; the others in a spawn each."""
    tp, pp, extra = saved
    save = BASE + layout(tp, pp) + extra + ["--save", str(tmp_path), "--exit-interval", "3"]
    argvs = [BASE + layout(tp2, pp2) + extra2 + ["--load", str(tmp_path)] for tp2, pp2, _, extra2 in loads]
    same_world = [argv for argv, (_, _, world2, _) in zip(argvs, loads) if world2 == 4]
    after_save = iter(run_ranks(several, 4, args=(train_losses, [save, *same_world]))[0][1:])
    for argv, (tp2, pp2, world2, _) in zip(argvs, loads):
        losses = next(after_save) if world2 == 4 else run_ranks(train_losses, world2, args=(argv,))[0]
        assert len(losses) == 3
        assert rel_err(torch.tensor(losses), torch.tensor(unbroken[3:])) <= 1e-5, (tp2, pp2, world2, losses)


def test_async_save_is_committed_and_resumes(tmp_path, unbroken):
    run_ranks(train_losses, 2, args=(BASE + ["--save", str(tmp_path), "--save-async", "--exit-interval", "3"],))
    assert (tmp_path / "latest").read_text().strip() == "iter_0000003"
    losses = run_ranks(train_losses, 2, args=(BASE + ["--load", str(tmp_path)],))[0]
    assert rel_err(torch.tensor(losses), torch.tensor(unbroken[3:])) <= 1e-5


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_intact(tmp_path):
    argv = BASE + layout(2, 1) + ["--save", str(tmp_path), "--save-interval", "2", "--distributed-timeout-minutes", "0.3"]
    with pytest.raises(RankFailure, match="exited with code 17"):
        run_ranks(train_losses, 2, args=(argv,), timeout=120, env={"MEGALITE_TEST_CRASH_IN_SAVE": "1@4"})
    assert (tmp_path / "latest").read_text().strip() == "iter_0000002"
    assert (tmp_path / "iter_0000004.tmp").exists() and not (tmp_path / "iter_0000004").exists()
    config, kind, sd = checkpoint.load_full_state_dict(tmp_path)
    assert kind == "gpt" and config.num_layers == 4 and sd["word_embeddings.weight"].shape[0] % 128 == 0
    losses = run_ranks(train_losses, 2, args=(BASE + layout(2, 1) + ["--load", str(tmp_path)],))[0]
    assert len(losses) == 4  # resumed from iteration 2


def test_bad_checkpoints_get_one_clear_message(tmp_path):
    run_ranks(train_losses, 1, args=(BASE + ["--save", str(tmp_path), "--exit-interval", "2"],))
    rank_file = tmp_path / "iter_0000002" / "rank_00000.safetensors"
    data = rank_file.read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10  # read straight into a parameter or Adam moment: checked there too
    rank_file.write_bytes(bytes(flipped))
    with pytest.raises(RankFailure, match="rank_00000.safetensors is corrupt: tensor .* fails its CRC-32 check"):
        run_ranks(train_losses, 1, args=(BASE + ["--load", str(tmp_path)],))
    rank_file.write_bytes(data[:-100])
    with pytest.raises(UsageError, match="corrupt or truncated"):
        checkpoint.CheckpointReader(tmp_path)
    rank_file.write_bytes(data[:50] + b"\0" * (len(data) - 50))  # same size, garbage inside
    with pytest.raises(UsageError, match="rank_00000.safetensors is corrupt"):
        checkpoint.CheckpointReader(tmp_path).files
    rank_file.unlink()
    with pytest.raises(UsageError, match="rank_00000.safetensors is missing"):
        checkpoint.CheckpointReader(tmp_path)
    (tmp_path / "latest").write_text("iter_0000099\n")
    with pytest.raises(UsageError, match="iter_0000099 named by .*latest is missing"):
        checkpoint.CheckpointReader(tmp_path)


def test_another_model_shape_is_refused_from_the_command_line(tmp_path):
    from cli import torchrun

    run_ranks(train_losses, 1, args=(BASE + ["--save", str(tmp_path), "--exit-interval", "1"],))
    run = torchrun("pretrain_gpt.py", 1, "--mock-data", "--train-iters", "2", "--seq-length", "32",
                   "--hidden-size", "64", "--load", str(tmp_path))
    assert run.returncode != 0  # the rank exits 2; torchrun reports any failure as 1
    assert "holds a model of another shape: hidden_size 128 (checkpoint) vs 64 (now)" in run.stderr
    assert 'pretrain_gpt.py", line' not in run.stderr and 'megalite/checkpoint/' not in run.stderr


def test_repeated_inf_gradients_stop_training_with_a_clear_message():
    argv = BASE + ["--train-iters", "10", "--max-skipped-iters", "3"]
    with pytest.raises(RankFailure, match="3 iterations in a row had inf/NaN gradients"):
        run_ranks(train_with_inf_at, 1, args=(argv, 4, 10))


def _launch_ranks(world, argv, env_extra=None):
    """Ranks started directly (as srun does), not through torchrun."""
    port = 29000 + os.getpid() % 1000
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1", **(env_extra or {})}
        env.pop("MEGALITE_QUIET", None)
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "pretrain_gpt.py"), *argv], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT))
    return procs


def _wait_for_iterations(path: Path, n: int, procs, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(records(path)) >= n:
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError("a rank ended early: " + "\n".join(p.communicate()[1][-2000:] for p in procs))
        time.sleep(0.2)
    raise AssertionError("training did not get going")


def test_sigterm_makes_every_rank_save_and_exit_zero(tmp_path):
    metrics = tmp_path / "m.jsonl"
    procs = _launch_ranks(2, ["--mock-data", "--tp", "2", "--train-iters", "100000", "--log-interval", "1",
                              "--seq-length", "32", "--save", str(tmp_path / "ckpt"), "--metrics-file", str(metrics)])
    _wait_for_iterations(metrics, 3, procs)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    saved = int((tmp_path / "ckpt" / "latest").read_text().strip().split("_")[1])
    meta = json.loads((tmp_path / "ckpt" / f"iter_{saved:07d}" / "metadata.json").read_text())
    assert meta["iteration"] == saved == records(metrics)[-1]["iteration"] >= 3
    assert "stopping after iteration" in outs[0][0] and "signal SIGTERM" in outs[0][0]


def test_a_lost_rank_ends_the_others_with_a_message_naming_the_phase(tmp_path):
    metrics = tmp_path / "m.jsonl"
    procs = _launch_ranks(2, ["--mock-data", "--pp", "2", "--train-iters", "100000", "--log-interval", "1",
                              "--seq-length", "32", "--metrics-file", str(metrics),
                              "--distributed-timeout-minutes", "0.25"])
    _wait_for_iterations(metrics, 2, procs)
    procs[1].kill()
    out, err = procs[0].communicate(timeout=90)
    assert procs[0].returncode == 4, err[-3000:]
    line = [x for x in err.splitlines() if x.startswith("megalite: error:")]
    assert line and "rank 0" in line[0] and "iteration" in line[0], err[-3000:]
    assert "(lost: rank 1)" in line[0], line[0]
    procs[1].communicate()


def test_full_state_dict_of_a_tp4_checkpoint_has_single_device_padding(tmp_path):
    """Vocabulary 100 at tp=4: three TP ranks hold padding only; the single-device table is 128 rows."""
    run_ranks(train_losses, 4, args=(BASE + ["--tp", "4", "--vocab-size", "100", "--save", str(tmp_path),
                                             "--exit-interval", "1"],))
    _, _, sd = checkpoint.load_full_state_dict(tmp_path)
    assert sd["word_embeddings.weight"].shape[0] == 128
    assert torch.count_nonzero(sd["word_embeddings.weight"][100:]) == 0


def test_a_bf16_checkpoint_resumes_under_fp16_with_a_fresh_loss_scaler(tmp_path):
    run_ranks(train_losses, 1, args=(BASE + ["--bf16", "--save", str(tmp_path), "--exit-interval", "2"],))
    out = run_ranks(train_params_fp16, 1, args=(BASE + ["--fp16", "--load", str(tmp_path), "--train-iters", "4",
                                                        "--initial-loss-scale", "1024"],))[0]
    assert [r["iteration"] for r in out["records"]] == [3, 4]
    assert out["records"][0]["loss_scale"] == 1024


def train_params_fp16(rank, world, argv):
    from training_ranks import train_params

    return train_params(rank, world, argv)
