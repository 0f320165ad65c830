"""Layout-free names and placements: where this rank's piece sits in the full tensor, and where a
checkpoint's directories lie."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from megalite import parallel
from megalite.models.config import TransformerConfig
from megalite.parallel.layers import partition_blocks

# Version 3 stores a gated MLP's fc1 as [gate; up] (slices with "blocks": 2); version 2 stored its
# rows interleaved (gate_i, up_i) and is still read, converted on the way in (see reader).
FORMAT_VERSION = 3
READABLE_VERSIONS = (2, 3)
GLU_FC1 = re.compile(r"^layers\.\d+\.mlp\.fc1\.(weight|bias)$")
VOCAB_PARAMS = ("word_embeddings.weight", "lm_bias", "output_layer.weight")  # rows past the vocabulary are padding
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                "layernorm_position", "activation", "normalization")
ITER_NAME = re.compile(r"^iter_\d{7}$")
RANK_FILE_NAME = re.compile(r"^rank_(\d{5})\.safetensors$")


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def iter_dir(directory, iteration: int) -> Path:
    return Path(directory) / iter_name(iteration)


def tmp_dir(directory, iteration: int) -> Path:
    """Where the ranks write a save of `iteration` until its commit renames it to `iter_dir`."""
    return iter_dir(directory, iteration).with_suffix(".tmp")


def global_name(model, local: str) -> str:
    """'layers.3.mlp.fc1.weight' of a stage holding layers [8, 12) -> 'layers.11.mlp.fc1.weight'."""
    if local.startswith("layers."):
        _, i, rest = local.split(".", 2)
        return f"layers.{model.layer_numbers[int(i)]}.{rest}"
    return local


def named_params(model_chunks):
    """(chunk, local name, parameter, layout-free name) of every parameter of this rank's chunks."""
    for chunk in model_chunks:
        for local, p in chunk.named_parameters():
            yield chunk, local, p, global_name(chunk, local)


def param_owners(model_chunks) -> dict:
    """id(parameter) -> (chunk, local name): how an optimizer piece finds its model parameter."""
    return {id(p): (chunk, local) for chunk, local, p, _ in named_params(model_chunks)}


def piece_place(owners: dict, piece):
    """(layout-free name, dim, start, lo, hi) of an optimizer piece: its parameter's placement and
    the piece's flat range [lo, hi) within that parameter."""
    chunk, local = owners[id(piece.param)]
    dim, start, _ = placement(chunk, local, piece.param)
    p_lo, _ = piece.buffer.param_range(piece.param)
    return global_name(chunk, local), dim, start, piece.lo - p_lo, piece.hi - p_lo


def placement(model, local: str, p: torch.Tensor):
    """(dim, start, rows to keep) of this rank's piece of the full tensor; dim None if replicated.
    A parameter of k blocks (`partition_blocks`): `start` is within each block, of size full / k."""
    if not getattr(p, "tensor_model_parallel", False):
        return None, 0, None
    dim = p.partition_dim
    start = parallel.get_tensor_model_parallel_rank() * (p.shape[dim] // partition_blocks(p))
    keep = None
    if local in VOCAB_PARAMS:
        keep = max(0, min(p.shape[dim], model.config.vocab_size - start))
    return dim, start, keep


def full_size(model, local: str, p: torch.Tensor) -> int | None:
    """Size of the full (unpadded) tensor along the TP dimension; None if replicated."""
    if not getattr(p, "tensor_model_parallel", False):
        return None
    if local in VOCAB_PARAMS:
        return model.config.vocab_size
    return p.shape[p.partition_dim] * parallel.get_tensor_model_parallel_world_size()


def shard_of(full: torch.Tensor, dim, start: int, shape, blocks: int = 1) -> torch.Tensor:
    """The TP shard of `shape` at `start` along `dim`, zero-padded past the vocabulary; with
    `blocks` > 1, the pieces at `start` of each of the full tensor's blocks, concatenated."""
    if dim is None:
        return full
    if blocks > 1:
        block_shape = list(shape)
        block_shape[dim] //= blocks
        return torch.cat([shard_of(b, dim, start, block_shape) for b in full.chunk(blocks, dim=dim)], dim=dim)
    n = shape[dim]
    have = max(0, min(n, full.shape[dim] - start))
    if have == n:
        return full.narrow(dim, start, n)
    out = torch.zeros(shape, dtype=full.dtype)
    if have:
        out.narrow(dim, 0, have).copy_(full.narrow(dim, start, have))
    return out


def is_writer(p) -> bool:
    """One copy of each tensor per DP replica: TP-sharded ones from every TP rank, replicated ones
    from TP rank 0; the last stage's tied-embedding copy never."""
    if getattr(p, "shared_embedding", False):
        return False
    return getattr(p, "tensor_model_parallel", False) or parallel.get_tensor_model_parallel_rank() == 0


def config_dict(config: TransformerConfig) -> dict:
    d = dataclasses.asdict(config)
    d["params_dtype"] = str(config.params_dtype).replace("torch.", "")
    return d


def config_from_dict(d: dict) -> TransformerConfig:
    d = dict(d)
    d["params_dtype"] = getattr(torch, d.get("params_dtype", "float32"))
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    return TransformerConfig(**{k: v for k, v in d.items() if k in known})
