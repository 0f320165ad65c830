#!/usr/bin/env python
"""Checkpoint save/load speed on one rank: megalite against torch.save and torch.distributed.checkpoint.

    python scripts/bench_checkpoint.py --size 350m --repeat 2 --json bench_checkpoint.json   # the docs figure
    python scripts/bench_checkpoint.py --size tiny                                 # a smoke run

Builds a GPT of the preset size (world 1, gloo), trains one iteration so AdamW state exists (fp32:
the masters are the parameters), then, in the same process and on the same state, times:
- save: megalite's Checkpointer (sync), torch.save of the model and optimizer-state tensors (one
  file, fsynced like the others), DCP's `save` (FileSystemWriter, fsync on);
- load into the live model and optimizer: megalite's load_model_weights + load_optimizer_state,
  torch.load + copy_, DCP's in-place `load`; each right after its save (page cache warm for all);
- bytes on disk of each checkpoint, and the time of megalite's checksum pass alone;
- async: how long `save()` blocks the caller for megalite's --save-async and DCP's `async_save`, at
  the first save and the longest of the later ones (3 saves, each issued once the previous one is
  complete), and how long until the first checkpoint is complete. megalite prepares its host
  buffer first, as the training loop does (also timed: how long that takes in the background, and
  what a first save issued at once after it blocks).
Prints a table and writes JSON with every figure and the ratios (megalite / other); with
--repeat N each figure is the best of N runs.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megalite import arguments, checkpoint  # noqa: E402
from megalite.training import pretrain  # noqa: E402

SIZES = {"tiny": "gpt-tiny", "124m": "gpt2-124m", "350m": "gpt2-350m", "1.3b": "gpt-1.3b"}


def train_one_step(preset: str):
    import pretrain_gpt

    argv = ["--mock-data", "--model", preset, "--train-iters", "1", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--seq-length", "32", "--log-interval", "1", "--no-progress-bar"]
    args = arguments.build_parser("bench_checkpoint", default_model=preset).parse_args(argv)
    run = pretrain(args, pretrain_gpt.task())
    return args, run


def bytes_on_disk(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def flat_state(run) -> dict[str, torch.Tensor]:
    """Model weights and Adam moments under string keys (DCP wants string keys; torch.save the same)."""
    state = {f"model.{i}.{n}": t for i, c in enumerate(run.model_chunks) for n, t in c.state_dict().items()}
    for i, st in enumerate(run.optimizer.inner.state.values()):
        for k, v in st.items():
            state[f"optim.{i}.{k}"] = v
    return state


def timed(fn) -> float:
    gc.collect()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def megalite_save(run, meta, directory, async_save=False):
    saver = checkpoint.Checkpointer(directory, async_save)
    blocked = timed(lambda: saver.save(run.model_chunks, run.optimizer, 1, meta))
    saver.close()
    return blocked


def megalite_load(run, directory):
    reader = checkpoint.CheckpointReader(directory)
    checkpoint.load_model_weights(directory, run.model_chunks, reader)
    checkpoint.load_optimizer_state(reader, run.model_chunks, run.optimizer)


def megalite_checksums(directory):
    """The checksum pass alone (what megalite's load does beyond copying bytes)."""
    checkpoint.CheckpointReader(directory).verify(wait=True)


def torch_save(state, path: Path):
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def torch_load(state, path: Path):
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    with torch.no_grad():
        for k, v in loaded.items():
            state[k].copy_(v)


def _best(into: dict, figures: dict) -> None:
    """Keep the smallest of each figure over the repeats (other jobs share the machine)."""
    for k, v in figures.items():
        into[k] = min(into.get(k, v), v)


def measure_sync(run, meta, state, work: Path, out: dict) -> None:
    import torch.distributed.checkpoint as dcp

    dirs = {"megalite": work / "megalite", "torch.save": work / "torch_save", "dcp": work / "dcp"}
    dirs["torch.save"].mkdir()
    methods = {
        "megalite": (lambda: megalite_save(run, meta, dirs["megalite"]), lambda: megalite_load(run, dirs["megalite"])),
        "torch.save": (lambda: torch_save(state, dirs["torch.save"] / "state.pt"),
                       lambda: torch_load(state, dirs["torch.save"] / "state.pt")),
        "dcp": (lambda: dcp.save(state, checkpoint_id=str(dirs["dcp"])),
                lambda: dcp.load(state, checkpoint_id=str(dirs["dcp"]))),
    }
    for name, (save, load) in methods.items():
        figures = {"save_s": timed(save), "load_s": timed(load), "bytes": bytes_on_disk(dirs[name])}
        if name == "megalite":
            figures["load_checksums_s"] = timed(lambda: megalite_checksums(dirs["megalite"]))
        _best(out["methods"].setdefault(name, {}), figures)
    for d in dirs.values():
        shutil.rmtree(d)


def measure_async(run, meta, state, work: Path, out: dict, saves: int = 3) -> None:
    """Blocked time of `saves` async saves in a row, each issued once the previous one is complete
    (as a loop's save interval leaves it), for megalite and DCP's `async_save`; megalite prepares
    its host buffer first, as the training loop does right after building the model and optimizer."""
    import torch.distributed.checkpoint as dcp

    figures = {}
    directory = work / "megalite_async"
    # Issued at once after prepare(): the first save waits for the rest of the preparation.
    saver = checkpoint.Checkpointer(directory, async_save=True)
    saver.prepare(run.model_chunks, run.optimizer)
    figures["first_at_once_blocked_s"] = timed(lambda: saver.save(run.model_chunks, run.optimizer, 1, meta))
    saver.close()
    shutil.rmtree(directory)
    gc.collect()
    # The loop's case: training runs while the buffer is prepared, the first save comes later.
    saver = checkpoint.Checkpointer(directory, async_save=True)
    figures["prepare_s"] = timed(lambda: saver.prepare(run.model_chunks, run.optimizer, wait=True))
    blocked = []
    for i in range(1, saves + 1):
        t = time.perf_counter()
        blocked.append(timed(lambda: saver.save(run.model_chunks, run.optimizer, i, meta)))
        saver.finalize()
        if i == 1:
            figures["total_s"] = time.perf_counter() - t
    saver.close()
    figures.update(blocked_s=blocked[0], first_blocked_s=blocked[0], later_blocked_s=max(blocked[1:], default=0.0))
    _best(out["async"].setdefault("megalite", {}), figures)
    shutil.rmtree(directory)
    gc.collect()
    figures, blocked = {}, []
    for i in range(1, saves + 1):
        t = time.perf_counter()
        started = []
        blocked.append(timed(lambda: started.append(dcp.async_save(state, checkpoint_id=str(work / f"dcp_async{i}")))))
        future = started[0]
        (future.result() if hasattr(future, "result") else future.upload_completion.result())
        if i == 1:
            figures["total_s"] = time.perf_counter() - t
        shutil.rmtree(work / f"dcp_async{i}")
    figures.update(blocked_s=blocked[0], first_blocked_s=blocked[0], later_blocked_s=max(blocked[1:], default=0.0))
    _best(out["async"].setdefault("dcp", {}), figures)


def measure(size: str, work: Path, repeat: int = 1) -> dict:
    args, run = train_one_step(SIZES[size])
    config = arguments.model_config(args)
    meta = checkpoint.build_metadata(config, "gpt", 1, 1, {"tp": 1, "pp": 1, "dp": 1, "vpp": None, "world": 1})
    state = flat_state(run)
    params = sum(p.numel() for c in run.model_chunks for p in c.parameters())
    before = {k: v.detach().double().sum().item() for k, v in state.items()}
    out: dict = {"size": size, "preset": SIZES[size], "params": params, "repeat": repeat, "methods": {}, "async": {}}
    for _ in range(repeat):
        measure_sync(run, meta, state, work, out)
        measure_async(run, meta, state, work, out)
    after = {k: v.detach().double().sum().item() for k, v in flat_state(run).items()}
    out["state_unchanged_by_loads"] = after == before
    return out


def add_ratios(out: dict) -> dict:
    m = out["methods"]
    out["ratios"] = {f"{what}_megalite_over_{other}": m["megalite"][what] / m[other][what]
                     for other in ("torch.save", "dcp") for what in ("save_s", "load_s", "bytes")}
    a = out["async"]
    out["ratios"]["async_blocked_megalite_over_dcp"] = a["megalite"]["blocked_s"] / a["dcp"]["blocked_s"]
    out["ratios"]["async_later_blocked_megalite_over_dcp"] = (a["megalite"]["later_blocked_s"]
                                                              / a["dcp"]["later_blocked_s"])
    for name, r in m.items():
        r["save_GBps"] = r["bytes"] / r["save_s"] / 1e9
        r["load_GBps"] = r["bytes"] / r["load_s"] / 1e9
    return out


def table(out: dict) -> str:
    lines = [f"{out['preset']} ({out['params'] / 1e6:.0f}M parameters, fp32, AdamW state), one rank",
             f"{'':12s} {'save s':>8s} {'load s':>8s} {'GB':>7s} {'save GB/s':>10s} {'load GB/s':>10s}"]
    for name, r in out["methods"].items():
        lines.append(f"{name:12s} {r['save_s']:8.2f} {r['load_s']:8.2f} {r['bytes'] / 1e9:7.3f} "
                     f"{r['save_GBps']:10.2f} {r['load_GBps']:10.2f}")
    lines.append(f"megalite load: its checksum pass alone takes {out['methods']['megalite']['load_checksums_s']:.2f} s "
                 f"(CRC-32, {os.cpu_count()} cores)")
    for name, r in out["async"].items():
        lines.append(f"async {name:8s} blocks {r['first_blocked_s']:.3f} s at the first save (complete after "
                     f"{r['total_s']:.2f} s), at most {r['later_blocked_s']:.3f} s at later ones")
    m = out["async"]["megalite"]
    lines.append(f"megalite's buffer prepared in {m['prepare_s']:.2f} s in the background; a first save issued at once "
                 f"after prepare() blocks {m['first_at_once_blocked_s']:.3f} s")
    lines.append("ratios (megalite / other): " + ", ".join(f"{k} {v:.2f}" for k, v in out["ratios"].items()))
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--repeat", type=int, default=1, help="best of N runs of every figure (busy machines)")
    p.add_argument("--dir", help="where to write the checkpoints (default: a temporary directory)")
    a = p.parse_args(argv)
    os.environ.setdefault("MEGALITE_QUIET", "1")
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-", dir=a.dir) as tmp:
        out = add_ratios(measure(a.size, Path(tmp), a.repeat))
    out["machine"] = os.environ.get("BENCH_MACHINE", f"{os.cpu_count()}-core CPU")
    print(table(out))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
