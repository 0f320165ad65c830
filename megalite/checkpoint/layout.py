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
                "layernorm_position", "activation", "normalization", "add_binary_head")
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


# A MoE layer's experts are stored one tensor per expert, named by its global index (whatever the EP
# size): the model's [local experts, rows, cols] parameter is that many 2-D tensors in the file.
EXPERT_TENSOR = re.compile(r"^((?:layers\.\d+|mtp\.\d+\.layer)\.mlp\.experts)\.(\d+)\.(fc[12]_(?:weight|bias))$")


def split_experts(state_dict: dict) -> dict:
    """A single-device state dict with each MoE layer's [experts, rows, cols] weights split into the
    2-D tensors checkpoints store (`layers.L.mlp.experts.E.fc1_weight`, see EXPERT_TENSOR; biases:
    [experts, width] into 1-D ones)."""
    out = {}
    for name, t in state_dict.items():
        module, _, leaf = name.rpartition(".")
        if module.endswith(".mlp.experts") and leaf in ("fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias"):
            out.update({f"{module}.{e}.{leaf}": t[e] for e in range(t.shape[0])})
        else:
            out[name] = t
    return out


@dataclasses.dataclass(frozen=True)
class Stored:
    """One tensor as the checkpoint names and places it: a parameter, or one expert of a MoE layer's
    experts parameter (`view` = param[e], `offset` its first element in the parameter)."""
    chunk: object
    local: str
    param: torch.Tensor
    name: str
    view: torch.Tensor
    offset: int
    dim: int | None  # the sharded dimension of `view` (None: replicated)
    start: int
    full: int | None  # the full size along `dim`
    keep: int | None  # rows to keep (vocabulary padding)

    @property
    def blocks(self) -> int:
        return partition_blocks(self.param)


def stored_tensors(model_chunks):
    """Every tensor of this rank's chunks as the checkpoint stores it (see `Stored`)."""
    for chunk, local, p, name in named_params(model_chunks):
        if not getattr(p, "expert_parallel", False):
            dim, start, keep = placement(chunk, local, p)
            yield Stored(chunk, local, p, name, p, 0, dim, start, full_size(chunk, local, p), keep)
            continue
        views = _expert_views(p)
        local_experts, (prefix, leaf) = len(views), name.rsplit(".", 1)
        first = parallel.get_expert_model_parallel_rank() * local_experts
        etp, etp_rank = parallel.get_expert_tensor_parallel_world_size(), parallel.get_expert_tensor_parallel_rank()
        dim = p.partition_dim - 1  # of one expert's 2-D weight (a bias: its one dim)
        size = views[0].shape[dim]
        for e, view in enumerate(views):
            yield Stored(chunk, local, p, f"{prefix}.{first + e}.{leaf}", view, e * view.numel(), dim,
                         etp_rank * (size // partition_blocks(p)), size * etp, None)


def _expert_views(p) -> tuple:
    """p[e] for each local expert e. Under ZeRO-3 the views taken while the unit's storage existed
    (`ShardedParamBuffer`: torch refuses to slice a freed or parked parameter), unless the parameter
    has moved to another storage since."""
    views = getattr(p, "expert_views", None)
    if views is not None and (p.numel() == 0 or p.untyped_storage()._cdata == views[0].untyped_storage()._cdata):
        return views
    return p.unbind(0)


def stored_by_param(model_chunks) -> dict:
    """id(parameter) -> its `Stored` tensors, in order."""
    out: dict = {}
    for st in stored_tensors(model_chunks):
        out.setdefault(id(st.param), []).append(st)
    return out


@dataclasses.dataclass(frozen=True)
class PiecePart:
    """The part of an optimizer piece that falls in one stored tensor: elements [lo, hi) of
    `stored.view` (flattened), at offset `start` of the piece's flat elements."""
    stored: Stored
    lo: int
    hi: int
    start: int

    def of(self, piece_tensor: torch.Tensor) -> torch.Tensor:
        """This part of a tensor laid out like the piece (its master, its Adam moments)."""
        return piece_tensor.reshape(-1)[self.start:self.start + self.hi - self.lo]


def piece_parts(owners: dict, piece):
    """The `PiecePart`s of an optimizer piece (`owners`: `stored_by_param`)."""
    p_lo, _ = piece.buffer.param_range(piece.param)
    lo, hi = piece.lo - p_lo, piece.hi - p_lo
    for st in owners[id(piece.param)]:
        a, b = max(lo, st.offset), min(hi, st.offset + st.view.numel())
        if a < b:
            yield PiecePart(st, a - st.offset, b - st.offset, a - lo)


def expert_biases(model_chunks):
    """(layout-free name, tensor) of every router's expert bias (aux-loss-free balancing): state
    that is not a parameter, saved and loaded with the model."""
    for chunk in model_chunks:
        for local, b in chunk.named_buffers():
            if local.endswith("router.expert_bias"):
                yield global_name(chunk, local), b


FP8_STATE_SUFFIXES = ("fp8_history", "fp8_scale")


def fp8_named_scalings(model_chunks, experts: bool = False):
    """(layout-free name, DelayedScaling) of FP8 delayed scaling's state: per linear layer, replicated
    over the stage (reduced there each step); with `experts`, per expert of this rank instead, by its
    global number (replicated over its expert-data-parallel and expert-tensor ranks)."""
    for chunk in model_chunks:
        for local, m in chunk.named_modules():
            if experts and getattr(m, "fc1_fp8", None) is not None and m.fc1_fp8[0].scaling is not None:
                for e, states in enumerate(zip(m.fc1_fp8, m.fc2_fp8)):
                    for fc, st in zip(("fc1", "fc2"), states):
                        yield global_name(chunk, f"{local}.{m.first_expert + e}.{fc}_fp8"), st.scaling
            scaling = getattr(getattr(m, "fp8", None), "scaling", None)
            if scaling is not None and not experts:
                yield global_name(chunk, f"{local}.fp8"), scaling


def fp8_scaling_state(model_chunks, experts: bool = False):
    """(layout-free name, tensor) of those states' amax histories and scales: saved and loaded with
    the model."""
    for base, scaling in fp8_named_scalings(model_chunks, experts):
        for key, t in scaling.state_dict().items():
            yield f"{base}_{key}", t


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
    from TP rank 0; the last stage's tied-embedding copy never; experts from every rank of the
    expert grid (each holds its own shard)."""
    if getattr(p, "expert_parallel", False):
        return True
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
