"""Saves commit as soon as every rank's file is written, failures surface at once on every rank
with one line and leave nothing behind, and one --save directory has one owner."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from megalite import checkpoint, parallel
from megalite.models.config import TransformerConfig
from megalite.runtime import TrainingStopped, UsageError
from megalite.testing import run_ranks


def _chunk(rows: int = 8):
    torch.manual_seed(0)
    return torch.nn.Linear(rows, rows)


def _meta(iteration, world):
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16)
    return checkpoint.build_metadata(config, "gpt", iteration, 0, {"tp": 1, "pp": 1, "dp": world, "world": world})


def _wait(predicate, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def async_save_commits_without_another_call(rank, world, directory):
    parallel.initialize_model_parallel()
    saver = checkpoint.Checkpointer(directory, async_save=True)
    saver.save([_chunk()], None, 5, _meta(5, world))
    latest = os.path.join(directory, "latest")
    committed = _wait(lambda: os.path.exists(latest))  # no save(), finalize() or collective meanwhile
    polled = saver.poll()
    saver.close()
    saver.close()
    return committed, polled


def test_async_save_is_committed_as_soon_as_every_rank_wrote(tmp_path):
    out = run_ranks(async_save_commits_without_another_call, 2, args=(str(tmp_path),))
    assert out == [(True, None), (True, None)]
    assert (tmp_path / "latest").read_text().strip() == "iter_0000005"
    meta = json.loads((tmp_path / "iter_0000005" / "metadata.json").read_text())
    assert sorted(meta["files"]) == ["rank_00000.safetensors", "rank_00001.safetensors"]


def a_second_checkpointer_waits_for_its_own_file(rank, world, directory):
    """Two Checkpointers of one directory in one process save the same iteration: the second one's
    writer is held until its committer had a second to (wrongly) take the first save's reports."""
    import threading

    from megalite.checkpoint import save as save_module

    parallel.initialize_model_parallel()
    first = checkpoint.Checkpointer(directory, async_save=True)
    first.save([_chunk()], None, 1, _meta(1, world))
    first.close()
    release, write_rank = threading.Event(), save_module.write_rank

    def held_write(*args, **kwargs):
        release.wait()
        return write_rank(*args, **kwargs)

    save_module.write_rank = held_write
    second = checkpoint.Checkpointer(directory, async_save=True)
    second.save([_chunk()], None, 1, _meta(1, world))
    tmp = os.path.join(directory, "iter_0000001.tmp")
    committed_before_the_file = _wait(lambda: not os.path.exists(tmp), timeout=1.0)
    release.set()
    second.close()
    save_module.write_rank = write_rank
    return committed_before_the_file


def test_a_save_commits_on_its_own_ranks_reports_never_an_earlier_saves(tmp_path):
    # The reports live in the job's rendezvous store, which outlives a Checkpointer: keyed by
    # directory, iteration and a per-Checkpointer count, the first save's reports once passed for
    # the second's, which then committed (or failed with ENOENT) before its file was written.
    assert run_ranks(a_second_checkpointer_waits_for_its_own_file, 2, args=(str(tmp_path),)) == [False, False]
    assert (tmp_path / "latest").read_text().strip() == "iter_0000001"
    reader = checkpoint.CheckpointReader(tmp_path)
    assert torch.equal(reader.full_tensor("weight"), _chunk().weight.detach())


def save_twice_second_fails(rank, world, directory, async_save):
    parallel.initialize_model_parallel()
    saver = checkpoint.Checkpointer(directory, async_save=async_save)
    saver.save([_chunk()], None, 1, _meta(1, world))
    saver.finalize()
    polled = None
    try:
        saver.save([_chunk()], None, 2, _meta(2, world))
        if async_save:  # the loop polls each iteration: the failure shows there, without finalize()
            _wait(lambda: saver.poll() is not None)
            polled = saver.poll()
        saver.finalize()
        raised = None
    except TrainingStopped as e:
        raised = str(e)
    saver.close()
    return polled, raised


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failed_write_stops_every_rank_with_one_line_and_leaves_nothing_behind(tmp_path, async_save):
    out = run_ranks(save_twice_second_fails, 2, args=(str(tmp_path), async_save),
                    env={"MEGALITE_TEST_FAIL_IN_SAVE": "1@2:28"})
    for polled, raised in out:
        assert raised is not None and "\n" not in raised
        assert raised.startswith("checkpoint of iteration 2 was not saved: writing ")
        assert "iter_0000002.tmp/rank_00001.safetensors failed: [Errno 28] No space left on device" in raised
        assert "the previous checkpoint (iter_0000001) is intact" in raised
        if async_save:
            assert polled is not None and "[Errno 28]" in polled
    assert (tmp_path / "latest").read_text().strip() == "iter_0000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "latest"]  # close() gave the lock up
    checkpoint.CheckpointReader(tmp_path).full_tensor("weight")


def fill_a_small_disk(rank, world, directory):
    parallel.initialize_model_parallel()
    saver = checkpoint.Checkpointer(directory)
    saver.save([_chunk(8)], None, 1, _meta(1, world))
    try:
        saver.save([_chunk(1024)], None, 2, _meta(2, world))  # 4 MiB on a 1 MiB file system
    except TrainingStopped as e:
        return str(e)
    finally:
        saver.close()


def test_a_full_disk_gives_one_line_and_leaves_the_previous_checkpoint(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        message = run_ranks(fill_a_small_disk, 1, args=(str(mount),))[0]
        assert "rank_00000.safetensors failed: [Errno 28] No space left on device" in message
        assert "the previous checkpoint (iter_0000001) is intact" in message
        assert sorted(p.name for p in mount.iterdir()) == ["iter_0000001", "latest"]
    finally:
        subprocess.run(["umount", str(mount)])


_HOLDER = """
import sys, time
from megalite.checkpoint import Checkpointer
Checkpointer(sys.argv[1])
print("locked", flush=True)
time.sleep(120)
"""


def _hold(directory):
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(directory)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "SLURM_JOB_ID": "4242"})
    assert proc.stdout.readline().strip() == "locked"
    return proc


def open_checkpointer(rank, world, directory):
    try:
        checkpoint.Checkpointer(directory).close()
        return None
    except UsageError as e:
        return str(e)


def test_a_second_job_on_the_same_directory_is_refused_on_every_rank_until_the_owner_dies(tmp_path):
    owner = _hold(tmp_path)
    try:
        refusals = run_ranks(open_checkpointer, 2, args=(str(tmp_path),))
        assert refusals[0] == refusals[1] and refusals[0] is not None
        assert f"is in use by another running job (host {os.uname().nodename}, pid {owner.pid}, job 4242" \
            in refusals[0]
        assert "another --save directory, or stop that job" in refusals[0]
    finally:
        owner.kill()
        owner.wait()
    assert (tmp_path / ".megalite.lock").exists()  # a crashed owner leaves its file; its lock is gone
    assert run_ranks(open_checkpointer, 1, args=(str(tmp_path),)) == [None]


def test_without_flock_a_dead_owner_on_this_host_is_stale_and_a_live_one_is_not(tmp_path, monkeypatch):
    import errno
    import socket

    from megalite.checkpoint import lock

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock.fcntl, "flock", no_flock)
    gone = subprocess.Popen(["true"])
    gone.wait()
    record = {"host": socket.gethostname(), "started": "earlier", "job": None}
    (tmp_path / ".megalite.lock").write_text(json.dumps({**record, "pid": os.getppid()}))
    with pytest.raises(lock.DirectoryLocked, match=f"pid {os.getppid()}"):
        lock.acquire(tmp_path)
    (tmp_path / ".megalite.lock").write_text(json.dumps({**record, "pid": gone.pid}))
    held = lock.acquire(tmp_path)
    assert json.loads((tmp_path / ".megalite.lock").read_text())["pid"] == os.getpid()
    held.release()
