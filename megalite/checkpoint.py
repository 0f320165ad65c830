"""Checkpoints that load at any layout and never lose work.

Format: `DIR/latest` names the newest complete checkpoint `DIR/iter_NNNNNNN/`, which holds
`metadata.json` and one `rank_NNNNN.pt` per rank. Every tensor is stored as a slice of its *full*
tensor: the one a single-device model would hold, under a layout-free name (layers by global
number, vocabulary without padding). A rank file holds

  "model": {name: [(dim, start, tensor), ...]}    slices of model weights (dim None: the whole)
  "optim": {name: [(dim, start, shard_shape, lo, hi, {master, exp_avg, exp_avg_sq}), ...]}
           flat ranges [lo, hi) of a TP shard (placed at `start` along `dim` of the full tensor)
  "step", "loss_scaler", "rng" (this rank's RNG streams)

Loading assembles, for each tensor this rank needs, its full tensor from every rank's slices and
cuts out the new layout's piece: any (tp, pp, dp) reads any other, with the distributed optimizer's
shards too. Each replica writes once: model weights from DP rank 0, replicated (non-TP) tensors from
TP rank 0, the tied embedding from the first stage only.

Writing is atomic: ranks write into `iter_N.tmp/` (each file fsynced), then rank 0 writes the
metadata, renames the directory into place and updates `latest` last (write-and-rename, fsynced), so
a crash at any moment leaves the previous checkpoint loadable. `--save-async` takes a CPU snapshot
and writes in a background thread; the collective commit happens at the next save or at exit.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from megalite import parallel
from megalite.models.config import TransformerConfig
from megalite.parallel.random import get_rng_tracker
from megalite.runtime import UsageError

FORMAT_VERSION = 1
_VOCAB_PARAMS = ("word_embeddings.weight", "lm_bias")  # rows past the vocabulary are padding
_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                 "layernorm_position", "activation", "normalization")


# ---------------------------------------------------------------------------------------------
# names and slices


def global_name(model, local: str) -> str:
    """'layers.3.mlp.fc1.weight' of a stage holding layers [8, 12) -> 'layers.11.mlp.fc1.weight'."""
    if local.startswith("layers."):
        _, i, rest = local.split(".", 2)
        return f"layers.{model.layer_numbers[int(i)]}.{rest}"
    return local


def _placement(model, local: str, p: torch.Tensor):
    """(dim, start, rows to keep) of this rank's piece of the full tensor; dim None if replicated."""
    if not getattr(p, "tensor_model_parallel", False):
        return None, 0, None
    dim = p.partition_dim
    start = parallel.get_tensor_model_parallel_rank() * p.shape[dim]
    keep = None
    if local in _VOCAB_PARAMS:
        keep = max(0, min(p.shape[dim], model.config.vocab_size - start))
    return dim, start, keep


def _is_writer(p) -> bool:
    """One copy of each tensor per DP replica: TP-sharded ones from every TP rank, replicated ones
    from TP rank 0; the last stage's tied-embedding copy never."""
    if getattr(p, "shared_embedding", False):
        return False
    return getattr(p, "tensor_model_parallel", False) or parallel.get_tensor_model_parallel_rank() == 0


def _config_dict(config: TransformerConfig) -> dict:
    d = dataclasses.asdict(config)
    d["params_dtype"] = str(config.params_dtype).replace("torch.", "")
    return d


def config_from_dict(d: dict) -> TransformerConfig:
    d = dict(d)
    d["params_dtype"] = getattr(torch, d.get("params_dtype", "float32"))
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    return TransformerConfig(**{k: v for k, v in d.items() if k in known})


# ---------------------------------------------------------------------------------------------
# collecting this rank's state


def collect_rank_state(model_chunks, optimizer=None, iteration: int = 0, with_rng: bool = True) -> dict:
    """This rank's slices (CPU copies, safe to write while training goes on)."""
    write_model = parallel.get_data_parallel_rank() == 0
    model: dict = {}
    for chunk in model_chunks:
        for local, p in chunk.named_parameters():
            if not write_model or not _is_writer(p):
                continue
            dim, start, keep = _placement(chunk, local, p)
            t = p.detach()
            if keep is not None:
                t = t.narrow(dim, 0, keep)
            model.setdefault(global_name(chunk, local), []).append((dim, start, t.to("cpu", copy=True)))
    state = {"model": model, "iteration": iteration}
    if optimizer is not None:
        names = {id(p): (chunk, local) for chunk in model_chunks for local, p in chunk.named_parameters()}
        distributed = optimizer.distributed
        optim: dict = {}
        for piece in optimizer.pieces:
            p = piece.param
            if not _is_writer(p) or (not distributed and parallel.get_data_parallel_rank() != 0):
                continue
            chunk, local = names[id(p)]
            dim, start, _ = _placement(chunk, local, p)
            p_lo, _ = piece.buffer.param_range(p)
            st = optimizer.inner.state.get(piece.master, {})
            values = {"master": piece.master.detach().reshape(-1)}
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    values[k] = st[k].detach().reshape(-1)
            optim.setdefault(global_name(chunk, local), []).append(
                (dim, start, tuple(p.shape), piece.lo - p_lo, piece.hi - p_lo,
                 {k: v.to("cpu", copy=True) for k, v in values.items()}))
        steps = [int(s["step"]) for s in optimizer.inner.state.values() if "step" in s]
        state.update(optim=optim, step=max(steps) if steps else 0, loss_scaler=optimizer.loss_scaler.state_dict())
    if with_rng:
        state["rng"] = {"cpu": torch.get_rng_state(), "tracker": get_rng_tracker().get_states(),
                        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    return state


# ---------------------------------------------------------------------------------------------
# writing


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, obj) -> int:
    partial = path.with_suffix(path.suffix + ".partial")
    with open(partial, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    return path.stat().st_size


def _iter_dir(directory: Path, iteration: int) -> Path:
    return directory / f"iter_{iteration:07d}"


def commit(directory: Path, iteration: int, metadata: dict) -> None:
    """Rank 0, after every rank wrote its file into iter_N.tmp: metadata, rename, `latest`."""
    tmp, final = _iter_dir(directory, iteration).with_suffix(".tmp"), _iter_dir(directory, iteration)
    with open(tmp / "metadata.json", "w") as f:
        json.dump(metadata, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    old = None
    if final.exists():  # saving the same iteration again: keep the old one until the new is in place
        old = final.with_suffix(".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(directory)
    latest_tmp = directory / "latest.tmp"
    latest_tmp.write_text(final.name + "\n")
    with open(latest_tmp) as f:
        os.fsync(f.fileno())
    os.replace(latest_tmp, directory / "latest")
    _fsync_dir(directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class Checkpointer:
    """Saves (synchronously or in the background) and commits collectively."""

    def __init__(self, directory: str, async_save: bool = False):
        self.directory = Path(directory)
        self.async_save = async_save
        self._pending: tuple | None = None  # (iteration, metadata, thread, result)

    def save(self, model_chunks, optimizer, iteration: int, metadata: dict) -> None:
        self.finalize()
        rank = dist.get_rank()
        tmp = _iter_dir(self.directory, iteration).with_suffix(".tmp")
        if rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that crashed
            tmp.mkdir()
        dist.barrier()
        state = collect_rank_state(model_chunks, optimizer, iteration)
        result: dict = {}

        def write():
            try:
                result["size"] = _write_file(tmp / f"rank_{rank:05d}.pt", state)
                _crash_hook(rank, iteration)
            except BaseException as e:  # reported at commit time, on every rank
                result["error"] = f"{type(e).__name__}: {e}"

        if self.async_save:
            thread = threading.Thread(target=write, daemon=True, name="megalite-checkpoint")
            thread.start()
        else:
            thread = None
            write()
        self._pending = (iteration, metadata, thread, result)
        if not self.async_save:
            self.finalize()

    def finalize(self) -> None:
        """Wait for this rank's file, agree that every rank wrote its own, then commit."""
        if self._pending is None:
            return
        iteration, metadata, thread, result = self._pending
        self._pending = None
        if thread is not None:
            thread.join()
        outcome = [None] * dist.get_world_size()
        dist.all_gather_object(outcome, (result.get("size"), result.get("error")))
        errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(outcome) if e]
        if errors:
            raise RuntimeError("checkpoint at iteration %d was not written (the previous one stays): %s"
                               % (iteration, "; ".join(errors)))
        if dist.get_rank() == 0:
            files = {f"rank_{r:05d}.pt": size for r, (size, _) in enumerate(outcome)}
            commit(self.directory, iteration, {**metadata, "files": files})
        dist.barrier()


def _crash_hook(rank: int, iteration: int) -> None:
    """Tests kill a rank in the middle of a save: MEGALITE_TEST_CRASH_IN_SAVE=<rank>@<iteration>."""
    if os.environ.get("MEGALITE_TEST_CRASH_IN_SAVE") == f"{rank}@{iteration}":
        os._exit(17)


def build_metadata(config: TransformerConfig, model_kind: str, iteration: int, consumed_samples: int,
                   layout: dict) -> dict:
    return {"format_version": FORMAT_VERSION, "iteration": iteration, "consumed_samples": consumed_samples,
            "model_kind": model_kind, "config": _config_dict(config), "layout": layout}


def save_model_checkpoint(directory, config: TransformerConfig, model_kind: str, state_dict: dict,
                          iteration: int = 0) -> None:
    """A checkpoint from a single-device state dict (names as the tp=1 model's; vocabulary padded or
    not) that `--load` accepts at any layout. Model weights only; no process group needed."""
    directory = Path(directory)
    model = {}
    for name, t in state_dict.items():
        t = t.detach().cpu()
        if name in _VOCAB_PARAMS:
            t = t.narrow(0, 0, config.vocab_size)
        model[name] = [(None, 0, t.clone())]
    tmp = _iter_dir(directory, iteration).with_suffix(".tmp")
    directory.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    size = _write_file(tmp / "rank_00000.pt", {"model": model, "iteration": iteration})
    meta = build_metadata(config, model_kind, iteration, 0, {"tp": 1, "pp": 1, "dp": 1, "vpp": None, "world": 1})
    commit(directory, iteration, {**meta, "files": {"rank_00000.pt": size}})


# ---------------------------------------------------------------------------------------------
# reading


class CheckpointReader:
    """The newest complete checkpoint of a directory, validated, with lazily loaded rank files."""

    def __init__(self, directory):
        self.directory = Path(directory)
        latest = self.directory / "latest"
        if not latest.is_file():
            raise UsageError(f"no checkpoint in {self.directory} (no 'latest' file): give a directory "
                             f"written by --save or by `python -m megalite.tools.convert_hf import`")
        name = latest.read_text().strip()
        self.path = self.directory / name
        meta_path = self.path / "metadata.json"
        if not meta_path.is_file():
            raise UsageError(f"checkpoint {self.path} named by {latest} is missing or has no metadata.json: "
                             f"the directory was damaged; point --load at an intact checkpoint")
        try:
            self.metadata = json.loads(meta_path.read_text())
        except json.JSONDecodeError as e:
            raise UsageError(f"checkpoint metadata {meta_path} is corrupt ({e})") from None
        if self.metadata.get("format_version") != FORMAT_VERSION:
            raise UsageError(f"checkpoint {self.path} has format version {self.metadata.get('format_version')}, "
                             f"this megalite reads version {FORMAT_VERSION}")
        for fname, size in self.metadata["files"].items():
            f = self.path / fname
            if not f.is_file():
                raise UsageError(f"checkpoint file {f} is missing: the checkpoint is incomplete")
            if f.stat().st_size != size:
                raise UsageError(f"checkpoint file {f} has {f.stat().st_size} bytes, the metadata says {size}: "
                                 f"it is corrupt or truncated")
        self.config = config_from_dict(self.metadata["config"])
        self.model_kind = self.metadata["model_kind"]
        self._files: list[dict] | None = None

    @staticmethod
    def exists(directory) -> bool:
        return (Path(directory) / "latest").is_file()

    @property
    def files(self) -> list[dict]:
        if self._files is None:
            self._files = []
            for fname in sorted(self.metadata["files"]):
                try:
                    self._files.append(torch.load(self.path / fname, map_location="cpu", mmap=True,
                                                  weights_only=False))
                except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
                    raise UsageError(f"checkpoint file {self.path / fname} is corrupt: {type(e).__name__}: {e}") from None
        return self._files

    def rank_file(self, rank: int) -> dict:
        return self.files[rank]

    def full_tensor(self, name: str) -> torch.Tensor:
        """The whole (unpadded) model tensor `name`, from every rank's slices."""
        slices = [s for f in self.files for s in f["model"].get(name, [])]
        if not slices:
            raise UsageError(f"checkpoint {self.path} has no tensor {name!r}: it holds another model")
        return _assemble(slices)

    def full_optimizer_state(self, name: str) -> dict[str, torch.Tensor] | None:
        pieces = [s for f in self.files for s in f.get("optim", {}).get(name, [])]
        if not pieces:
            return None
        shards: dict[tuple, dict] = {}
        for dim, start, shape, lo, hi, values in pieces:
            key = (dim, start, tuple(shape))
            bufs = shards.setdefault(key, {k: torch.zeros(int(torch.tensor(shape).prod()), dtype=torch.float32)
                                           for k in values})
            for k, v in values.items():
                bufs.setdefault(k, torch.zeros_like(next(iter(bufs.values()))))[lo:hi] = v
        out = {}
        vocab = self.config.vocab_size if name in _VOCAB_PARAMS else None
        for k in next(iter(shards.values())):
            slices = []
            for (dim, start, shape), bufs in shards.items():
                t = bufs[k].view(shape)
                if vocab is not None and dim is not None:
                    t = t.narrow(dim, 0, max(0, min(shape[dim], vocab - start)))
                slices.append((dim, start, t))
            out[k] = _assemble(slices)
        return out


def _assemble(slices) -> torch.Tensor:
    whole = [t for dim, _, t in slices if dim is None]
    if whole:
        return whole[0]
    dim = slices[0][0]
    # Empty slices (TP ranks holding only vocabulary padding) say nothing about the size.
    size = max((start + t.shape[dim] for _, start, t in slices if t.shape[dim] > 0), default=0)
    shape = list(slices[0][2].shape)
    shape[dim] = size
    full = torch.zeros(shape, dtype=slices[0][2].dtype)
    for _, start, t in slices:
        if t.shape[dim] > 0:
            full.narrow(dim, start, t.shape[dim]).copy_(t)
    return full


def _local_piece(model, local: str, p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a full tensor, padded with zeros where the vocabulary is padded."""
    dim, start, _ = _placement(model, local, p)
    if dim is None:
        return full
    n = p.shape[dim]
    have = max(0, min(n, full.shape[dim] - start))
    out = torch.zeros(p.shape, dtype=full.dtype)
    if have:
        out.narrow(dim, 0, have).copy_(full.narrow(dim, start, have))
    return out


def check_compatible(reader: CheckpointReader, config: TransformerConfig, model_kind: str) -> None:
    if reader.model_kind != model_kind:
        raise UsageError(f"checkpoint {reader.path} holds a {reader.model_kind} model, not a {model_kind} model")
    diffs = [f"{k} {getattr(reader.config, k)} (checkpoint) vs {getattr(config, k)} (now)"
             for k in _SHAPE_FIELDS if getattr(reader.config, k) != getattr(config, k)]
    if diffs:
        raise UsageError(f"checkpoint {reader.path} holds a model of another shape: {'; '.join(diffs)}; "
                         f"use the same model flags, or another --load")


def load_model_weights(directory, model_chunks, reader: CheckpointReader | None = None) -> CheckpointReader:
    """Load the checkpoint's weights into this rank's chunks, resharded to the current layout."""
    reader = reader or CheckpointReader(directory)
    with torch.no_grad():
        for chunk in model_chunks:
            for local, p in chunk.named_parameters():
                full = reader.full_tensor(global_name(chunk, local))
                piece = _local_piece(chunk, local, p, full)
                if piece.shape != p.shape:
                    raise UsageError(f"checkpoint tensor {global_name(chunk, local)} has shape {tuple(full.shape)}, "
                                     f"which does not fit this model's {local} ({tuple(p.shape)} per rank)")
                p.copy_(piece.to(p.dtype))
    return reader


def load_optimizer_state(reader: CheckpointReader, model_chunks, optimizer) -> bool:
    """Masters and Adam moments, resharded to this rank's pieces. False if the checkpoint has none."""
    names = {id(p): (chunk, local) for chunk in model_chunks for local, p in chunk.named_parameters()}
    step = max((f.get("step", 0) for f in reader.files), default=0)
    if not any(f.get("optim") for f in reader.files):
        return False
    with torch.no_grad():
        # A parameter lies in one bucket, so this rank holds at most one piece of it: assemble its
        # full state, copy the piece, and let the full tensors go before the next parameter.
        for piece in optimizer.pieces:
            chunk, local = names[id(piece.param)]
            name = global_name(chunk, local)
            full = reader.full_optimizer_state(name)
            if full is None:
                raise UsageError(f"checkpoint {reader.path} has no optimizer state for {name}")
            p_lo, _ = piece.buffer.param_range(piece.param)
            lo, hi = piece.lo - p_lo, piece.hi - p_lo
            local_values = {k: _local_piece(chunk, local, piece.param, v).reshape(-1)[lo:hi] for k, v in full.items()}
            del full
            piece.master.view(-1).copy_(local_values["master"])
            if "exp_avg" in local_values:
                st = optimizer.inner.state[piece.master]
                st["exp_avg"] = local_values["exp_avg"].view_as(piece.master).clone().to(piece.master.device)
                st["exp_avg_sq"] = local_values["exp_avg_sq"].view_as(piece.master).clone().to(piece.master.device)
                fused = bool(optimizer.inner.defaults.get("fused"))
                st["step"] = torch.tensor(float(step), device=piece.master.device if fused else "cpu")
    scaler = next((f["loss_scaler"] for f in reader.files if "loss_scaler" in f), None)
    # Only a dynamic scaler carries state worth resuming; a constant one (bf16, fp32, or an explicit
    # --loss-scale) keeps what this run asked for, and an fp16 <-> bf16 switch starts the scaler anew.
    if scaler is not None and set(scaler) == set(optimizer.loss_scaler.state_dict()) and len(scaler) > 1:
        optimizer.loss_scaler.load_state_dict(scaler)
    optimizer.publish()
    return True


def restore_rng(reader: CheckpointReader, layout: dict) -> bool:
    """Each rank's RNG streams, when the layout is unchanged (else the seed's streams stand)."""
    saved = reader.metadata["layout"]
    if any(saved.get(k) != layout.get(k) for k in ("tp", "pp", "dp", "vpp", "world")):
        return False
    rng = reader.rank_file(dist.get_rank()).get("rng")
    if rng is None:
        return False
    torch.set_rng_state(rng["cpu"])
    get_rng_tracker().set_states(rng["tracker"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return True


def load_full_state_dict(directory) -> tuple[TransformerConfig, str, dict[str, torch.Tensor]]:
    """The single-device state dict (tp=1 vocabulary padding) of a checkpoint saved at any layout."""
    from megalite.parallel.layers import pad_vocab_size

    reader = CheckpointReader(directory)
    names = sorted({n for f in reader.files for n in f["model"]})
    padded = pad_vocab_size(reader.config.vocab_size, 1, reader.config.make_vocab_size_divisible_by)
    sd = {}
    for name in names:
        t = reader.full_tensor(name)
        if name in _VOCAB_PARAMS and t.shape[0] < padded:
            t = torch.cat([t, torch.zeros((padded - t.shape[0], *t.shape[1:]), dtype=t.dtype)])
        sd[name] = t
    return reader.config, reader.model_kind, sd
