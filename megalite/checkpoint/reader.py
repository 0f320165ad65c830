"""Reading: find and validate a checkpoint (`latest`, metadata, format version, rank files and their
sizes), then serve its tensors checksum-verified (in helper threads) and each full tensor assembled
from every rank file's slices, which must cover it exactly."""
from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from megalite.checkpoint.fileformat import RankFile, RankFileError, all_finite, decode_plain
from megalite.checkpoint.layout import (GLU_FC1, ITER_NAME, RANK_FILE_NAME, READABLE_VERSIONS,
                                        SHAPE_FIELDS, VOCAB_PARAMS, rank_file_name, shard_of)
from megalite.checkpoint.sealed import check_seal, typed_config
from megalite.models.config import TransformerConfig
from megalite.runtime import UsageError, say

_VERIFY_THREADS = max(2, min(8, os.cpu_count() or 1))


def _resolve(path: Path) -> Path:
    """The iter_NNNNNNN directory of a save directory (via `latest`) or of itself."""
    if not path.exists():
        raise UsageError(f"checkpoint path {path} does not exist: give a --save directory or one of its "
                         f"iter_NNNNNNN directories")
    if not path.is_dir():
        raise UsageError(f"checkpoint path {path} is a file, not a directory: give a --save directory or one "
                         f"of its iter_NNNNNNN directories")
    if ITER_NAME.match(path.name) and not (path / "latest").exists():
        return path
    latest = path / "latest"
    if not latest.is_file():
        raise UsageError(f"no checkpoint in {path} (no 'latest' file): give a directory written by --save "
                         f"or by `python -m megalite.tools.convert_hf import`")
    name = latest.read_text().strip()
    if not ITER_NAME.match(name):
        raise UsageError(f"{latest} names {name[:80]!r}, not a checkpoint of this directory (iter_NNNNNNN): "
                         f"the file was damaged or tampered with; point --load at an intact checkpoint")
    return path / name


def _read_metadata(path: Path, directory: Path) -> dict:
    """The checkpoint's metadata.json, refused unless it is of the format this megalite reads."""
    meta_path = path / "metadata.json"
    if not meta_path.is_file():
        raise UsageError(f"checkpoint {path} named by {directory / 'latest'} is missing or has no "
                         f"metadata.json: the directory was damaged; point --load at an intact checkpoint")
    try:
        metadata = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"checkpoint metadata {meta_path} is corrupt ({e})") from None
    version = metadata.get("format_version")
    if version not in READABLE_VERSIONS:
        raise UsageError(f"checkpoint {path} has format version {version}, this megalite reads versions "
                         f"{', '.join(map(str, READABLE_VERSIONS))} (safetensors rank files; version 1's pickled "
                         f"files are not loaded because unpickling can run code): load it with the megalite "
                         f"that wrote it")
    check_seal(metadata, meta_path)
    return metadata


def _check_files(path: Path, metadata: dict) -> list[str]:
    """The rank files' names, once the metadata lists exactly one per rank and each is present with
    its recorded size."""
    files = metadata.get("files")
    world = metadata.get("layout", {}).get("world")
    if not isinstance(files, dict) or not files:
        raise UsageError(f"checkpoint metadata {path / 'metadata.json'} lists no rank files")
    for fname in files:
        if not RANK_FILE_NAME.match(str(fname)):
            raise UsageError(f"checkpoint metadata {path / 'metadata.json'} names a file {str(fname)[:80]!r}, "
                             f"not rank_NNNNN.safetensors: it was damaged or tampered with")
    expected = [rank_file_name(r) for r in range(world if isinstance(world, int) else -1)]
    if sorted(files) != expected:
        raise UsageError(f"checkpoint {path} was written by {world} ranks but its metadata lists "
                         f"{len(files)} rank files: the metadata was damaged")
    for fname in expected:
        f, size = path / fname, files[fname].get("bytes") if isinstance(files[fname], dict) else None
        if not f.is_file():
            raise UsageError(f"checkpoint file {f} is missing: the checkpoint is incomplete")
        if f.stat().st_size != size:
            raise UsageError(f"checkpoint file {f} has {f.stat().st_size} bytes, the metadata says {size}: "
                             f"it is corrupt or truncated")
    return expected


def describe_writer(writer: dict) -> str:
    """'rank 2 (tp 0, pp 1, dp 0, cp 0, ep 0)'."""
    coords = ", ".join(f"{k} {v}" for k, v in writer.get("coords", {}).items())
    return f"rank {writer.get('rank')}" + (f" ({coords})" if coords else "")


def _check_writer(f: RankFile, index: int, metadata: dict) -> None:
    """Refuse a rank file that another rank, save or iteration wrote (files swapped, copied over one
    another, or mixed from two checkpoints: equal sizes hide it). Files written before they recorded
    their writer pass."""
    writer = f.meta.get("writer")
    fix = "restore the checkpoint's own files, or --load an earlier checkpoint"
    if writer is None:
        if metadata.get("save") is not None:  # this save's files all record their writer
            raise UsageError(f"checkpoint file {f.path} records no writer, but every file of this checkpoint does: "
                             f"it comes from an older checkpoint; {fix}")
        return
    if writer.get("save") != metadata.get("save") or f.meta.get("iteration") != metadata.get("iteration"):
        raise UsageError(f"checkpoint file {f.path} was written by another save (iteration {f.meta.get('iteration')}, "
                         f"save {str(writer.get('save'))[:8]}) than this checkpoint's (iteration "
                         f"{metadata.get('iteration')}, save {str(metadata.get('save'))[:8]}): files were mixed "
                         f"from two checkpoints; {fix}")
    if writer.get("rank") != index:
        raise UsageError(f"checkpoint file {f.path} holds the state {describe_writer(writer)} wrote, not rank "
                         f"{index}'s: files were swapped or copied over one another; {fix}")


def _corrupt(path: Path, problem) -> UsageError:
    return UsageError(f"checkpoint file {path} is corrupt: {problem}")


class CheckpointReader:
    """A complete checkpoint (a save directory's newest, or an iter_NNNNNNN directory), validated,
    with lazily opened rank files."""

    def __init__(self, directory):
        self.directory = Path(directory)
        self.path = _resolve(self.directory)
        self.metadata = _read_metadata(self.path, self.directory)
        self._file_names = _check_files(self.path, self.metadata)
        self.config = typed_config(self.metadata.get("config"), self.path / "metadata.json")
        self.model_kind = self.metadata["model_kind"]
        # Version 2 stored a gated fc1's rows interleaved (gate_i, up_i): read, then put in halves.
        self._interleaved_glu = self.metadata["format_version"] == 2 and self.config.gated_linear_unit
        self._files: list[RankFile] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._checks: dict = {}  # (file, key) -> future of its checksum check
        self._direct_checks: list = []  # (file, future) of tensors read straight into their place

    @staticmethod
    def exists(path) -> bool:
        """True for a save directory holding a checkpoint, and for an iter_NNNNNNN directory."""
        path = Path(path)
        return (path / "latest").is_file() or (ITER_NAME.match(path.name) is not None
                                               and (path / "metadata.json").is_file())

    @property
    def files(self) -> list[RankFile]:
        if self._files is None:
            self._files = []
            for index, fname in enumerate(self._file_names):
                try:
                    f = RankFile(self.path / fname)
                except RankFileError as e:
                    raise _corrupt(self.path / fname, e) from None
                _check_writer(f, index, self.metadata)
                self._files.append(f)
        return self._files

    def rank_file(self, rank: int) -> RankFile:
        return self.files[rank]

    def tensor(self, f: RankFile, key: str, name: str | None = None) -> torch.Tensor:
        """A stored tensor, checksum-verified; refused if it held NaN/inf when saved (`name` says
        which model tensor it belongs to)."""
        check = self._checks.pop((f.path, key), None)
        error = check.result() if check is not None else None
        if check is not None and not self._checks and not self._direct_checks:  # all checked: let the threads go
            self._pool.shutdown(wait=False)
            self._pool = None
        try:
            if error is not None:
                raise RankFileError(error)
            t = f.tensor(key)
        except RankFileError as e:
            raise _corrupt(f.path, e) from None
        if not f.is_finite(key):
            raise _non_finite(self, name or key)
        return t

    def verify(self, names=None, wait: bool = False) -> None:
        """Start checking, in background threads and in this order, the checksums of every stored
        tensor of `names` (model and optimizer; None: all); `tensor()` waits for its own check, so
        the copies overlap the checks of the tensors after them. `wait`: finish now (and raise)."""
        if names is None:
            names = self.model_names() + sorted({n for f in self.files for n in f.meta.get("optim", {})})
        todo = []
        for name in dict.fromkeys(names):  # ordered, each once
            for f in self.files:
                todo += [(f, s["tensor"]) for s in f.meta.get("model", {}).get(name, [])]
                todo += [(f, ref) for p in f.meta.get("optim", {}).get(name, [])
                         for ref in p["values"].values() if ref != "model"]
        todo = [(f, key) for f, key in todo if not f.is_verified(key) and (f.path, key) not in self._checks]
        if not todo:
            return
        for f, key in todo:
            self._checks[(f.path, key)] = self._submit(_verify_one, f, key)
        if wait:
            for f, key in todo:
                self.tensor(f, key)

    def _submit(self, fn, *args):
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=_VERIFY_THREADS, thread_name_prefix="megalite-crc")
        return self._pool.submit(fn, *args)

    # -- the same layout's fast path: a stored slice that is exactly a destination tensor

    def fits(self, f: RankFile, key, dst: torch.Tensor) -> bool:
        """Whether stored tensor `key` can be read straight into `dst` (same dtype and shape)."""
        info = f.info(key)
        return (info is not None and info == (dst.dtype, list(dst.shape)) and dst.device.type == "cpu"
                and dst.is_contiguous())

    def _stored_as_halves(self, name: str) -> bool:
        """False for a version 2 gated fc1 tensor, whose stored rows interleave gate and up."""
        return not (self._interleaved_glu and GLU_FC1.match(name))

    def direct_model(self, name: str, dim, start: int, dst: torch.Tensor, blocks: int = 1):
        """(file, key) of the one stored slice that is exactly `dst`'s piece, or None."""
        if not self._stored_as_halves(name):
            return None
        hits = [(f, s["tensor"]) for f in self.files for s in f.meta.get("model", {}).get(name, [])
                if s["dim"] == dim and (dim is None or s["start"] == start) and self.fits(f, s["tensor"], dst)
                and _same_blocks(s, blocks, dst.shape[dim] if dim is not None else None)]
        return hits[0] if len(hits) == 1 else None

    def direct_optim(self, name: str, dim, start: int, shape, lo: int, hi: int, blocks: int = 1):
        """(file, values) of the one stored optimizer range that is exactly this piece, or None."""
        if not self._stored_as_halves(name):
            return None
        hits = [(f, p["values"]) for f in self.files for p in f.meta.get("optim", {}).get(name, [])
                if p["dim"] == dim and (dim is None or p["start"] == start) and p["shard"] == list(shape)
                and (p["lo"], p["hi"]) == (lo, hi) and _same_blocks(p, blocks, shape[dim] if dim is not None else None)]
        return hits[0] if len(hits) == 1 else None

    def read_direct(self, f: RankFile, key: str, dst: torch.Tensor, name: str) -> None:
        """Read a stored tensor straight into `dst`; its checksum is checked by a helper thread
        (`finish_direct()` waits) while the next tensors are read."""
        if not f.is_finite(key):
            raise _non_finite(self, name)
        try:
            f.read_into(key, dst)
        except (RankFileError, OSError) as e:
            raise _corrupt(f.path, e) from None
        self._direct_checks.append((f, self._submit(f.verify_copy, key, dst)))

    def finish_direct(self) -> None:
        checks, self._direct_checks = self._direct_checks, []
        for f, check in checks:
            error = check.result()
            if error is not None:
                raise _corrupt(f.path, error)

    # -- full tensors, from every rank's slices

    def model_names(self) -> list[str]:
        return sorted({n for f in self.files for n in f.meta.get("model", {})})

    def full_tensor(self, name: str) -> torch.Tensor:
        """The whole (unpadded) model tensor `name`, from every rank's slices."""
        t = self._stored_full_tensor(name)
        return t if self._stored_as_halves(name) else _halves(t)

    def _stored_full_tensor(self, name: str) -> torch.Tensor:
        """`full_tensor` as stored (a version 2 gated fc1 interleaved)."""
        slices = [sl for f in self.files for s in f.meta.get("model", {}).get(name, [])
                  for sl in _blocks_placed(s["dim"], s["start"], s.get("full"), self.tensor(f, s["tensor"], name),
                                           s.get("blocks", 1))]
        if not slices:
            raise UsageError(f"checkpoint {self.path} has no tensor {name!r}: it holds another model")
        return _assemble(self.path, name, slices)

    def master_is_the_weight(self, name: str) -> bool:
        """True when every stored piece of `name` keeps its fp32 master as the model weight."""
        pieces = [p for f in self.files for p in f.meta.get("optim", {}).get(name, [])]
        return bool(pieces) and all(p["values"].get("master") == "model" for p in pieces)

    def full_optimizer_state(self, name: str, skip=()) -> dict[str, torch.Tensor] | None:
        pieces = [(f, p) for f in self.files for p in f.meta.get("optim", {}).get(name, [])]
        if not pieces:
            return None
        shards: dict[tuple, list] = {}
        for f, p in pieces:
            key = (p["dim"], p["start"], tuple(p["shard"]), p.get("full"), p.get("blocks", 1))
            shards.setdefault(key, []).append((f, p))
        out = {}
        for k in pieces[0][1]["values"]:
            if k in skip:
                continue
            slices = []
            for (dim, start, shape, full, blocks), parts in shards.items():
                flat = self._flat_shard(name, k, dim, start, shape, parts, blocks)
                t = flat.view(shape)
                if name in VOCAB_PARAMS and dim is not None:
                    t = t.narrow(dim, 0, max(0, min(shape[dim], self.config.vocab_size - start)))
                    full = self.config.vocab_size
                slices += _blocks_placed(dim, start, full, t, blocks)
            whole = _assemble(self.path, f"{name} ({k})", slices)
            out[k] = whole if self._stored_as_halves(name) else _halves(whole)
        return out

    def _flat_shard(self, name, k, dim, start, shape, parts, blocks: int = 1) -> torch.Tensor:
        """A TP shard's flat optimizer state `k`, from the DP ranks' ranges, which must tile it."""
        numel = math.prod(shape)
        parts = sorted(parts, key=lambda fp: fp[1]["lo"])
        ends = [0] + [p["hi"] for _, p in parts]
        if [p["lo"] for _, p in parts] != ends[:-1] or ends[-1] != numel:
            raise UsageError(f"checkpoint {self.path} holds the optimizer state of {name} in ranges "
                             f"{[(p['lo'], p['hi']) for _, p in parts]} that do not tile its {numel} elements: "
                             f"rank files are missing or damaged")
        pieces = []
        for f, p in parts:
            ref = p["values"].get(k)
            if ref is None:
                raise UsageError(f"checkpoint file {f.path} lacks the optimizer state {k} of {name}")
            if ref == "model":  # an fp32 master stored once, as the model weight (in the same row order)
                stored = self._stored_full_tensor(name)
                pieces.append(shard_of(stored, dim, start, shape, blocks).reshape(-1)[p["lo"]:p["hi"]])
            else:
                pieces.append(self.tensor(f, ref, f"{name} ({k})"))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def rng(self, rank: int):
        f = self.rank_file(rank)
        return None if "rng" not in f.meta else decode_plain(f.meta["rng"], lambda key: self.tensor(f, key).clone())

    def replica(self, rank: int):
        """Rank `rank`'s own state (local SGD's replicas, see `collect_rank_state`), or None."""
        f = self.rank_file(rank)
        if "replica" not in f.meta:
            return None
        if self._interleaved_glu:  # flat per-rank buffers: the fc1 rows inside them cannot be found again
            raise UsageError(f"checkpoint {self.path} (format version 2) holds local SGD replica state of a gated "
                             f"MLP, whose fc1 rows this megalite orders differently: resume it without --local-sgd "
                             f"(the model and its optimizer state load), or with the megalite that wrote it")
        return decode_plain(f.meta["replica"], lambda key: self.tensor(f, key).clone())


def _verify_one(f: RankFile, key: str) -> str | None:
    try:
        f.verify(key)
    except RankFileError as e:
        return str(e)
    return None


def _same_blocks(stored: dict, blocks: int, rows) -> bool:
    """Whether a stored slice splits its rows into the same blocks as the destination (moot for a
    slice that is the whole tensor: tp 1)."""
    return stored.get("blocks", 1) == blocks or (stored["start"] == 0 and stored.get("full") in (None, rows))


def _blocks_placed(dim, start: int, full, t: torch.Tensor, blocks: int) -> list:
    """(dim, start, full, tensor) slices of a stored slice: itself, or, when it stacks `blocks`
    blocks, each block's part at its place in the full tensor."""
    if blocks == 1 or dim is None:
        return [(dim, start, full, t)]
    return [(dim, i * (full // blocks) + start, full, part) for i, part in enumerate(t.chunk(blocks, dim=dim))]


def _halves(interleaved: torch.Tensor) -> torch.Tensor:
    """A version 2 gated fc1 tensor (rows gate_0, up_0, gate_1, ...) as [gate; up]."""
    return torch.cat((interleaved[0::2], interleaved[1::2]))


def _assemble(path: Path, name: str, slices) -> torch.Tensor:
    """The full tensor from (dim, start, full size, tensor) slices, which must cover it exactly."""
    whole = [t for dim, _, _, t in slices if dim is None]
    if whole:
        return whole[0]
    dim, full = slices[0][0], slices[0][2]
    present = sorted((start, start + t.shape[dim], t) for _, start, _, t in slices if t.shape[dim] > 0)
    end = 0
    for start, stop, _ in present:
        if start != end:
            break
        end = stop
    size = full if full is not None else end
    if end != size or (present and present[-1][1] != size):
        raise UsageError(f"checkpoint {path} holds {name} only in part (rows/columns "
                         f"{[(a, b) for a, b, _ in present]} of {size} along dimension {dim}): rank files are "
                         f"missing or were written by a damaged run; load another checkpoint")
    if len(present) == 1:
        return present[0][2]
    return torch.cat([t for _, _, t in present], dim=dim)


def _non_finite(reader: CheckpointReader, name: str) -> UsageError:
    return UsageError(f"checkpoint {reader.path} holds NaN/inf values in {name}: it was saved after training "
                      f"diverged or was damaged; load an earlier checkpoint")


def check_finite(reader: CheckpointReader, name: str, t: torch.Tensor) -> None:
    """Refuse NaN/inf in a tensor taken from `reader` (else it is blamed on the learning rate much
    later). Loading needs no scan: the writer records each tensor's finiteness under its checksum."""
    if not all_finite(t):
        raise _non_finite(reader, name)


# The Llama-family fields that change which parameters exist or their shapes. A checkpoint written
# before they existed lacks them in its config and reads as their defaults (today's models).
LLAMA_SHAPE_FIELDS = ("position_embedding_type", "num_query_groups", "gated_linear_unit", "add_bias_linear",
                      "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights", "rotary_percent",
                      "layernorm_zero_centered_gamma", "qk_layernorm_full_width", "multi_latent_attention",
                      "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                      "mtp_num_layers", "rotary_interleaved", "window_size", "window_attn_skip_freq", "qk_l2_norm",
                      "no_rope_freq", "softmax_type", "glu_linear_offset", "activation_func_clamp_value")
# Settings a run may change on purpose (a longer context: another rope base or scaling), but which
# change the function the weights compute: said in one line when they differ, never silently.
RETUNABLE_FIELDS = ("rotary_base", "rotary_seq_len_interpolation_factor", "rope_scaling_factor",
                    "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position_embeddings",
                    "layernorm_epsilon", "yarn_factor",
                    "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale",
                    "yarn_mscale_all_dim", "yarn_correction_range_round_to_int")


# What a MoE model computes (a resume that changes one would train another function).
MOE_SHAPE_FIELDS = ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
                    "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
                    "moe_router_num_groups", "moe_router_group_topk", "moe_shared_expert_intermediate_size",
                    "moe_shared_expert_gate", "moe_router_enable_expert_bias", "moe_apply_probs_on_input")


def check_compatible(reader: CheckpointReader, config: TransformerConfig, model_kind: str) -> None:
    if reader.model_kind != model_kind:
        raise UsageError(f"checkpoint {reader.path} holds a {reader.model_kind} model, not a {model_kind} model")
    diffs = [f"{k} {getattr(reader.config, k)} (checkpoint) vs {getattr(config, k)} (now)"
             for k in SHAPE_FIELDS + LLAMA_SHAPE_FIELDS + MOE_SHAPE_FIELDS
             if getattr(reader.config, k) != getattr(config, k)]
    if diffs:
        raise UsageError(f"checkpoint {reader.path} holds a model of another shape: {'; '.join(diffs)}; "
                         f"use the same model flags, or another --load")
    changed = [f"{k} {getattr(reader.config, k)} (checkpoint) -> {getattr(config, k)} (now)"
               for k in RETUNABLE_FIELDS if getattr(reader.config, k) != getattr(config, k)]
    if changed:
        say(f"megalite: note: this run changes settings the checkpoint {reader.path} was trained with: "
            f"{'; '.join(changed)} (give the checkpoint's values to keep its function)")
