"""--save-async allocates its host buffer before the first save is due: every save of a run then
reuses that one buffer (allocated in the background, sized exactly as the saves need), writes the
same bytes as without it, and a save issued while the buffer is still being prepared waits for it."""
import threading
import time

import pytest
import torch

from megalite import checkpoint
from megalite.checkpoint import save as save_module
from megalite.checkpoint import snapshot as snapshot_module
from megalite.models.config import TransformerConfig
from megalite.testing import run_ranks
from training_ranks import gpt_run

BASE = ["--log-interval", "1", "--seq-length", "32", "--global-batch-size", "4", "--micro-batch-size", "2"]
PREPARING = "megalite-checkpoint-buffer"  # the preparing thread's name


def _watch_buffers(delay_s: float = 0.0) -> dict:
    """Record, in this rank, every snapshot-buffer allocation (thread, bytes) and, at each save, the
    bytes its entries need and the buffer it copied into. `delay_s`: slow the background allocation."""
    seen = {"allocations": [], "saves": []}
    allocate, take = snapshot_module._allocate, snapshot_module.Snapshot.take

    def allocate_counted(total, pin, device):
        name = threading.current_thread().name
        if name == PREPARING:
            time.sleep(delay_s)
        seen["allocations"].append((name, total))
        return allocate(total, pin, device)

    def take_watched(self, entries, *args, **kwargs):
        out = take(self, entries, *args, **kwargs)
        seen["saves"].append({"need": snapshot_module._layout(entries)[1], "size": self.buffer.numel(),
                              "ptr": self.buffer.data_ptr()})
        return out

    snapshot_module._allocate, snapshot_module.Snapshot.take = allocate_counted, take_watched
    return seen


def train_watching_buffers(rank, world, argv, prepare=True):
    seen = _watch_buffers()
    if not prepare:
        save_module.Checkpointer.prepare = lambda *a, **k: None
    gpt_run(argv)
    return seen


VARIANTS = {
    "dp2": [],
    "zero1-bf16": ["--use-distributed-optimizer", "--bf16"],
    "zero3": ["--zero-stage", "3"],
    "local-sgd-async": ["--local-sgd-interval", "2", "--local-sgd-async"],
}


@pytest.mark.parametrize("extra", list(VARIANTS.values()), ids=list(VARIANTS))
def test_the_buffer_prepared_before_the_first_step_serves_every_save(tmp_path, extra):
    argv = BASE + extra + ["--train-iters", "2", "--save", str(tmp_path), "--save-async", "--save-interval", "1"]
    for seen in run_ranks(train_watching_buffers, 2, args=(argv,)):
        assert len(seen["saves"]) == 2
        (thread, size), = seen["allocations"]  # one allocation, in the background, none by a save
        assert thread == PREPARING
        assert {s["ptr"] for s in seen["saves"]} == {seen["saves"][0]["ptr"]}
        assert all(s["size"] == size >= s["need"] for s in seen["saves"])
        # Sized as a save after a step needs it: Adam state included, and with --local-sgd-async the
        # averages pending once a round has started (iteration 2 here; the first save has none yet).
        assert size == seen["saves"][-1]["need"]
    assert (tmp_path / "latest").read_text().strip() == "iter_0000002"


def _without_token(data: bytes) -> bytes:
    """A rank file's bytes with its save's token (32 hex digits in the header, new every save) masked."""
    import re
    return re.sub(rb"[0-9a-f]{32}", b"T" * 32, data, count=1)


def _rank_files(directory) -> dict:
    return {p.relative_to(directory).as_posix(): _without_token(p.read_bytes())
            for p in sorted(directory.glob("iter_*/rank_*"))}


def test_a_prepared_run_saves_the_same_bytes_as_an_unprepared_one(tmp_path):
    argv = BASE + ["--train-iters", "2", "--save-async", "--save-interval", "1", "--use-distributed-optimizer"]
    prepared = run_ranks(train_watching_buffers, 2, args=(argv + ["--save", str(tmp_path / "a")],))
    plain = run_ranks(train_watching_buffers, 2, args=(argv + ["--save", str(tmp_path / "b")], False))
    assert all(s["allocations"][0][0] == PREPARING for s in prepared)
    assert all(s["allocations"][0][0] != PREPARING for s in plain)  # the first save allocated it
    a, b = _rank_files(tmp_path / "a"), _rank_files(tmp_path / "b")
    assert len(a) == 4 and a == b


def _meta(iteration):
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16)
    return checkpoint.build_metadata(config, "gpt", iteration, 0, {"tp": 1, "pp": 1, "dp": 1, "world": 1})


def _save_sync(run, directory, iteration, replica=None):
    saver = checkpoint.Checkpointer(directory)
    saver.save(run.model_chunks, run.optimizer, iteration, _meta(iteration), replica)
    saver.close()
    return _without_token((directory / f"iter_{iteration:07d}" / "rank_00000.safetensors").read_bytes())


def save_early_and_with_other_entries(rank, world, directory):
    """An async save issued at once after `prepare` (whose allocation takes 0.5 s longer than it
    would), then one whose entries outgrew the prepared buffer: each rank file against a sync save's."""
    from pathlib import Path

    directory = Path(directory)
    run = gpt_run(BASE + ["--train-iters", "1"])
    seen = _watch_buffers(delay_s=0.5)
    saver = checkpoint.Checkpointer(directory / "async", async_save=True)
    t = time.perf_counter()
    saver.prepare(run.model_chunks, run.optimizer)
    prepare_s = time.perf_counter() - t
    t = time.perf_counter()
    saver.save(run.model_chunks, run.optimizer, 1, _meta(1))
    blocked_s = time.perf_counter() - t
    saver.finalize()
    early = _without_token((directory / "async" / "iter_0000001" / "rank_00000.safetensors").read_bytes())
    bigger = {"extra": torch.arange(50_000, dtype=torch.float32)}  # entries grow: a bigger buffer, as before
    saver.save(run.model_chunks, run.optimizer, 2, _meta(2), bigger)
    saver.close()
    grown = _without_token((directory / "async" / "iter_0000002" / "rank_00000.safetensors").read_bytes())
    return {"prepare_s": prepare_s, "blocked_s": blocked_s, "seen": seen,
            "early_ok": early == _save_sync(run, directory / "sync", 1),
            "grown_ok": grown == _save_sync(run, directory / "sync", 2, bigger)}


def test_a_save_issued_during_preparation_waits_for_it_and_a_grown_one_reallocates(tmp_path):
    out, = run_ranks(save_early_and_with_other_entries, 1, args=(str(tmp_path),))
    assert out["prepare_s"] < 0.25, "prepare returns at once: the allocation runs in the background"
    assert out["blocked_s"] >= 0.4, "the save waited for the preparation under way"
    (first, need), (second, grown) = out["seen"]["allocations"]
    assert first == PREPARING and second != PREPARING and grown > need
    assert [s["size"] for s in out["seen"]["saves"]] == [need, grown]
    assert out["early_ok"] and out["grown_ok"]
