"""`--load` of a Megatron-LM `torch_dist` checkpoint, read with `torch.distributed.checkpoint` and
never with Megatron-LM (docs/megatron-checkpoints.md).

Megatron-LM's save directory holds `latest_checkpointed_iteration.txt` (the iteration, or
"release") and `iter_NNNNNNN/` (or `release/`): the dist checkpoint's `.metadata`, its `*.distcp`
files and `metadata.json` ({"sharded_backend": "torch_dist"}). The non-tensor state (`args`,
`iteration`, ...) is a pickled object `common_state` inside the distcp files (megatron-core >= 0.17),
or `common.pt` beside them (earlier). It is unpickled by a restricted unpickler: plain containers,
tensors, dtypes and argparse.Namespace are themselves; any other class (megatron's enums and
configs) becomes an inert `Foreign` stand-in, so no code from the file runs and megatron is never
imported.

`MegatronCheckpoint` answers what `--load` asks of megalite's own `CheckpointReader`: the model's
configuration (from `args`, via megalite's Megatron-LM flags), the iteration and samples consumed,
and each of megalite's layout-free tensors whole, read through DCP's resharding: only the region a
tensor occupies in the saved global tensor (one layer of a stacked [layers, ...] tensor, one expert)
is read, from whichever files hold it, at any tp/pp/ep the checkpoint was saved at. Optimizer state
is not read (megalite's optimizer starts fresh, said at load); the RNG streams start from --seed.
"""
from __future__ import annotations

import io
import json
import pickle
import re
import types
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megalite.checkpoint.megatron_dist_map import (EXPERT_KEYS, LAYER_KEYS, TOP_KEYS, config_of, expected_names,
                                                   qkv_part, translate_args)
from megalite.errors import UsageError

TRACKER = "latest_checkpointed_iteration.txt"
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(fc[12]_(?:weight|bias))$")


# --- finding the checkpoint ---------------------------------------------------------------------

def _is_dist_dir(path: Path) -> bool:
    meta = path / "metadata.json"
    if not (path / ".metadata").is_file() or not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text()).get("sharded_backend") == "torch_dist"
    except (ValueError, UnicodeDecodeError, AttributeError):
        return False


def is_megatron_checkpoint(path) -> bool:
    """A Megatron-LM save directory (its tracker file), or one torch_dist iteration directory."""
    path = Path(path)
    return (path / TRACKER).is_file() or _is_dist_dir(path)


def resolve(path) -> Path:
    """The iteration directory `--load` names (the save directory's latest, or itself)."""
    path = Path(path)
    if not (path / TRACKER).is_file():
        if not _is_dist_dir(path):
            raise UsageError(f"{path} is not a Megatron-LM torch_dist checkpoint (no {TRACKER}, no .metadata with a "
                             f"metadata.json saying torch_dist): point --load at Megatron-LM's --save directory")
        return path
    text = (path / TRACKER).read_text().strip()
    name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
    if name is None:
        raise UsageError(f"{path / TRACKER} holds {text[:40]!r}, not an iteration: the file is damaged; write the "
                         f"iteration of the iter_NNNNNNN directory to load into it")
    it = path / name
    if not it.is_dir():
        raise UsageError(f"{path / TRACKER} names iteration {text}, but {it} is missing: the checkpoint is "
                         f"incomplete; point --load at an intact one (or at one iter_NNNNNNN directory)")
    for needed in (".metadata", "metadata.json"):
        if not (it / needed).is_file():
            raise UsageError(f"{it} has no {needed}: it is not a complete torch_dist checkpoint (another "
                             f"--ckpt-format, or the save was cut short); load one saved with --ckpt-format torch_dist")
    return it


# --- the common state, unpickled without running anything ---------------------------------------

class Foreign:
    """A stand-in for a class megalite does not know (a megatron enum or config): what the pickle
    gave it, kept as data. `value` is an enum's value."""
    qualname = "?"

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state):
        self.state = state

    @property
    def value(self):
        return self.args[0] if self.args else None

    def __repr__(self):
        return f"<{self.qualname}{self.args!r}>"


_SAFE = {("argparse", "Namespace"), ("collections", "OrderedDict"), ("torch", "Size"), ("torch", "device"),
         ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor"),
         ("torch._utils", "_rebuild_parameter"), ("builtins", "set"), ("builtins", "frozenset"),
         ("builtins", "slice"), ("builtins", "complex"), ("builtins", "bytearray"), ("builtins", "range")}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _SAFE:
            return getattr(__import__(module, fromlist=[name]), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        return type(name, (Foreign,), {"qualname": f"{module}.{name}", "__module__": __name__})


_RESTRICTED = types.SimpleNamespace(__name__="megalite_restricted_pickle", Unpickler=_Unpickler,
                                    load=lambda f, **kw: _Unpickler(f, **kw).load())


def _unpickle(data, where: str):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = torch.load(data, map_location="cpu", weights_only=False, pickle_module=_RESTRICTED)
    except Exception as e:  # a damaged file: any of pickle's, zipfile's or torch's errors
        raise UsageError(f"{where} cannot be read ({type(e).__name__}: {str(e)[:120]}): it is damaged; "
                         f"restore it from the saved checkpoint") from None
    if isinstance(out, list) and len(out) == 1:  # megatron-core's common_state object holds [state]
        out = out[0]
    if not isinstance(out, dict):
        raise UsageError(f"{where} holds a {type(out).__name__}, not Megatron-LM's common state (a dict)")
    return out


class _BytesPlanner(DefaultLoadPlanner):
    """DCP's own planner, keeping an object's bytes as they are (DCP would torch.load them)."""

    def __init__(self):
        super().__init__()
        self.raw: dict[str, bytes] = {}

    def load_bytes(self, read_item, value):
        self.raw[read_item.dest_index.fqn] = value.read()


def _read_common(path: Path, reader) -> dict:
    legacy = path / "common.pt"
    if legacy.is_file():
        return _unpickle(str(legacy), str(legacy))
    keys = [k for k in reader.read_metadata().state_dict_metadata if k.startswith("common_state/")]
    if not keys:
        raise UsageError(f"{path} has neither common.pt nor a common_state object: its args and iteration are "
                         f"missing; it was not written by Megatron-LM's save_checkpoint")
    planner = _BytesPlanner()
    _dcp_load({keys[0]: io.BytesIO()}, reader, planner, path)
    return _unpickle(io.BytesIO(planner.raw[keys[0]]), f"{path} (common_state)")


# --- tensors through DCP's resharding -------------------------------------------------------------

class _CachedReader(dcp.FileSystemReader):
    """The metadata read once, not once per tensor."""
    _metadata = None

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


class _RegionPlanner(DefaultLoadPlanner):
    """Reads `dest` from the region at `offsets` of the saved global tensor `key`: DCP's read items
    for a local chunk, as when it loads a DTensor's shard."""

    def __init__(self, key: str, offsets: tuple, dest: torch.Tensor):
        super().__init__()
        self.key, self.offsets, self.dest = key, offsets, dest

    def create_local_plan(self) -> LoadPlan:
        chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.dest.shape)
        return LoadPlan(create_read_items_for_chunk_list(self.key, self.metadata.state_dict_metadata[self.key],
                                                         [chunk]))

    def resolve_tensor(self, read_item):
        t = self.dest
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(dim, start, length)
        return t

    def commit_tensor(self, read_item, tensor):
        pass  # resolve_tensor's views are written in place


def _dcp_load(state: dict, reader, planner, path: Path) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    except UsageError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        failures = getattr(e, "failures", None) or {}
        first = next(iter(failures.values()), e)
        first = getattr(first, "exc", first)
        raise UsageError(f"{path}: reading its torch_dist files failed ({type(first).__name__}: "
                         f"{' '.join(str(first).split())[:160]}): a .distcp file is damaged; restore the checkpoint's "
                         f"files") from None


def _check_files(path: Path, metadata) -> None:
    """Every .distcp file the metadata names, present and as long as the bytes it places there."""
    ends: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        f = path / name
        if not f.is_file():
            raise UsageError(f"checkpoint file {f} is missing: the checkpoint is incomplete; restore it, or --load "
                             f"another")
        if f.stat().st_size < end:
            raise UsageError(f"checkpoint file {f} has {f.stat().st_size} bytes, its metadata places {end}: it is "
                             f"truncated; restore it, or --load another")


class MegatronCheckpoint:
    """What `--load` reads from a Megatron-LM torch_dist checkpoint, in the terms of megalite's own
    `CheckpointReader` (see the module's docstring)."""

    model_kind = "gpt"
    files: list = []  # no megalite rank files: no optimizer state or RNG streams to restore

    def __init__(self, directory):
        self.directory = Path(directory)
        self.path = resolve(self.directory)
        self._reader = _CachedReader(str(self.path))
        try:
            metadata = self._reader.read_metadata()
            self._tensors = {k: v for k, v in metadata.state_dict_metadata.items()
                             if isinstance(v, TensorStorageMetadata)}
        except Exception as e:
            raise UsageError(f"{self.path / '.metadata'} cannot be read ({type(e).__name__}): it is damaged; "
                             f"restore the checkpoint's files") from None
        _check_files(self.path, metadata)
        self.common = _read_common(self.path, self._reader)
        args = self.common.get("args")
        self.translation = translate_args(args, str(self.path))
        self.config, run_config = config_of(self.translation, str(self.path))
        iteration = self.common.get("iteration", getattr(args, "iteration", 0)) or 0
        self.optimizer_saved = any(k.startswith("optimizer.") for k in self._tensors)
        self.metadata = {"iteration": int(iteration),
                         "consumed_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
                         "run_config": run_config, "format": "megatron torch_dist", "layout": {}}
        self._names = self._expected_names()

    def load_note(self) -> str:
        """The line `--load` says of what it took (megalite.training.resume)."""
        optimizer = ("its optimizer state is not read (megalite's optimizer keeps other state)" if self.optimizer_saved
                     else "it holds no optimizer state")
        notes = "".join(f"; {n}" for n in self.translation.notes)
        return (f"megalite: note: {self.path} is a Megatron-LM torch_dist checkpoint: its weights, args and iteration "
                f"are taken; {optimizer}: the optimizer starts fresh from these weights, the RNG streams from "
                f"--seed{notes}")

    # -- what load_model_weights asks of a reader

    def model_names(self) -> list[str]:
        return list(self._names)

    def verify(self, names=None, wait: bool = False) -> None:
        pass  # DCP's files carry no checksums; shapes are checked as each tensor is read

    def direct_model(self, *args, **kwargs):
        return None  # every tensor goes through full_tensor

    def finish_direct(self) -> None:
        pass

    def rng(self, rank: int):
        return None

    def full_tensor(self, name: str) -> torch.Tensor:
        """megalite's whole (unpadded) tensor `name`, read from its region of Megatron's tensors."""
        c = self.config
        if name in ("word_embeddings.weight", "output_layer.weight"):
            return self._region(TOP_KEYS[name], (0, 0), (self.translation.vocab_size, c.hidden_size), name)
        if name in TOP_KEYS:
            key = TOP_KEYS[name]
            return self._region(key, (0,) * len(self._meta(key, name).size), tuple(self._meta(key, name).size), name)
        m = _EXPERT.match(name)
        if m:
            layer, expert, leaf = int(m.group(1)), int(m.group(2)), m.group(3)
            stacked, per_expert = (f"decoder.layers.{k}" for k in EXPERT_KEYS[leaf])
            if stacked in self._tensors:
                return self._layer_slice(stacked, (layer, expert), name)
            return self._layer_slice(per_expert.format(e=expert), (layer,), name)
        m = _LAYER.match(name)
        if not m or m.group(2) not in LAYER_KEYS:
            raise UsageError(f"{self.path}: megalite's tensor {name} has no place in a Megatron-LM checkpoint")
        layer, leaf = int(m.group(1)), m.group(2)
        keys = [f"decoder.layers.{k}" for k in LAYER_KEYS[leaf]]
        key = next((k for k in keys if k in self._tensors), keys[0])
        t = self._layer_slice(key, (layer,), name)
        if leaf.startswith("attention.") and leaf.split(".")[1] in ("qkv", "q", "kv"):
            t = qkv_part(t, leaf.split(".")[1], c.num_attention_heads, c.query_groups)
        return t

    def _meta(self, key: str, name: str) -> TensorStorageMetadata:
        md = self._tensors.get(key)
        if md is None:
            raise UsageError(f"{self.path} has no tensor {key} (megalite's {name}): the checkpoint holds another "
                             f"model than its args describe, or was cut short; --load a complete checkpoint")
        return md

    def _layer_slice(self, key: str, lead: tuple, name: str) -> torch.Tensor:
        """The region of `key` at the leading indices `lead` (layer, then expert), those axes dropped."""
        md = self._meta(key, name)
        size = tuple(md.size)
        if len(size) <= len(lead) or any(i >= n for i, n in zip(lead, size)):
            raise UsageError(f"{self.path}: tensor {key} has shape {size}, with no place for megalite's {name}: the "
                             f"checkpoint holds another model than its args describe")
        return self._region(key, lead + (0,) * (len(size) - len(lead)), (1,) * len(lead) + size[len(lead):],
                            name).reshape(size[len(lead):])

    def _region(self, key: str, offsets: tuple, sizes: tuple, name: str) -> torch.Tensor:
        md = self._meta(key, name)
        if len(sizes) != len(md.size) or any(o + s > n for o, s, n in zip(offsets, sizes, md.size)):
            raise UsageError(f"{self.path}: tensor {key} has shape {tuple(md.size)}, too small for megalite's {name} "
                             f"{tuple(sizes)}: the checkpoint holds another model than its args describe")
        covered = [c for c in md.chunks if all(co < o + s and o < co + cs for co, cs, o, s
                                                in zip(c.offsets, c.sizes, offsets, sizes))]
        if sum(_overlap(c, offsets, sizes) for c in covered) < _numel(sizes):
            raise UsageError(f"{self.path}: tensor {key} is not saved whole (no rank wrote part of megalite's {name}): "
                             f"the checkpoint was cut short; --load a complete one")
        dest = torch.empty(sizes, dtype=md.properties.dtype)
        _dcp_load({}, self._reader, _RegionPlanner(key, offsets, dest), self.path)
        return dest

    def _expected_names(self) -> list[str]:
        """Every layout-free tensor of the model `config` describes (what model_names() lists)."""
        return expected_names(self.config)


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _overlap(chunk, offsets, sizes) -> int:
    n = 1
    for co, cs, o, s in zip(chunk.offsets, chunk.sizes, offsets, sizes):
        n *= max(0, min(co + cs, o + s) - max(co, o))
    return n


# --- which reader `--load` gets ---------------------------------------------------------------------

def checkpoint_exists(path) -> bool:
    """A megalite checkpoint (CheckpointReader.exists) or a Megatron-LM torch_dist one."""
    from megalite.checkpoint.reader import CheckpointReader

    return CheckpointReader.exists(path) or is_megatron_checkpoint(path)


def open_checkpoint(path):
    """megalite's own reader for its checkpoints (its `latest` wins: a run that saved into a Megatron-LM
    directory resumes its own checkpoints), else a MegatronCheckpoint."""
    from megalite.checkpoint.reader import CheckpointReader

    if _is_dist_dir(Path(path)) and not (Path(path) / "latest").is_file():  # torch_dist's iteration directory
        return MegatronCheckpoint(path)                                       # (its metadata.json is its own)
    if CheckpointReader.exists(path) or not is_megatron_checkpoint(path):
        return CheckpointReader(path)
    return MegatronCheckpoint(path)
