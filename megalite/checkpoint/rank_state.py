"""This rank's state as (key, tensor) entries plus a JSON structure, and its RNG streams restored.

The structure is what a rank file's header holds under "megalite" (see the package docstring):
model slices, optimizer ranges, the step, the loss scaler and the RNG streams, every tensor named
by its key among the entries.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megalite import parallel
from megalite.checkpoint.layout import full_size, is_writer, named_params, param_owners, piece_place, placement
from megalite.parallel.layers import partition_blocks
from megalite.parallel.random import get_rng_tracker

if TYPE_CHECKING:
    from megalite.checkpoint.reader import CheckpointReader


def encode_plain(obj, key: str, add):
    """Nested dicts/lists of tensors and plain values -> JSON, tensors replaced by {"tensor": key}."""
    if torch.is_tensor(obj):
        return {"tensor": add(key, obj)}
    if isinstance(obj, dict):
        return {"dict": {str(k): encode_plain(v, f"{key}/{k}", add) for k, v in obj.items()}}
    if isinstance(obj, (list, tuple)):
        return {"list": [encode_plain(v, f"{key}/{i}", add) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"value": obj}
    raise TypeError(f"{key}: a checkpoint holds tensors and plain data, not {type(obj).__name__}")


def decode_plain(obj, tensor):
    """The inverse of `encode_plain`; `tensor(key)` supplies each stored tensor."""
    kind, value = next(iter(obj.items()))
    if kind == "tensor":
        return tensor(value)
    if kind == "dict":
        return {k: decode_plain(v, tensor) for k, v in value.items()}
    if kind == "list":
        return [decode_plain(v, tensor) for v in value]
    return value


def master_is_the_param(piece) -> bool:
    """fp32 training: the master is the parameter's own memory, already stored with the model."""
    return (piece.master.dtype == piece.param.dtype
            and piece.master.data_ptr() == piece.buffer.param_slice(piece.lo, piece.hi).data_ptr())


def _first_replica() -> bool:
    """Whether this rank writes what every data- and context-parallel replica holds alike."""
    return parallel.get_data_parallel_rank(with_context_parallel=True) == 0


def collect_rank_state(model_chunks, optimizer=None, iteration: int = 0, with_rng: bool = True,
                       replica: dict | None = None):
    """This rank's slices: ([(key, tensor)], structure). The tensors are the live ones (no copies):
    write them before training goes on, or snapshot them. `replica`: state of this rank's own that
    no other rank holds (local SGD's replicas), stored as it is under "replica"."""
    tensors: list[tuple[str, torch.Tensor]] = []

    def add(key: str, t: torch.Tensor) -> str:
        tensors.append((key, t.detach()))
        return key

    model: dict = {}
    if _first_replica():
        for chunk, local, p, name in named_params(model_chunks):
            if not is_writer(p):
                continue
            dim, start, keep = placement(chunk, local, p)
            t = p.detach() if keep is None else p.detach().narrow(dim, 0, keep)
            model.setdefault(name, []).append({"tensor": add(f"model/{name}", t), "dim": dim, "start": start,
                                               "full": full_size(chunk, local, p), **_blocks(p)})
    meta: dict = {"iteration": iteration, "model": model}
    if optimizer is not None:
        meta.update(_collect_optimizer(model_chunks, optimizer, add))
    if with_rng:
        rng = {"cpu": torch.get_rng_state(), "tracker": get_rng_tracker().get_states(),
               "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
        meta["rng"] = encode_plain(rng, "rng", add)
    if replica is not None:
        meta["replica"] = encode_plain(replica, "replica", add)
    return tensors, meta


def _blocks(p) -> dict:
    """A slice's "blocks" entry: only for a parameter stacking blocks (a gated MLP's fc1)."""
    k = partition_blocks(p)
    return {"blocks": k} if k > 1 else {}


def _collect_optimizer(model_chunks, optimizer, add) -> dict:
    owners = param_owners(model_chunks)
    optim: dict = {}
    for piece in optimizer.pieces:
        p = piece.param
        if not is_writer(p) or (not optimizer.distributed and not _first_replica()):
            continue
        name, dim, start, lo, hi = piece_place(owners, piece)
        st = optimizer.inner.state.get(piece.master, {})
        values = {"master": "model" if master_is_the_param(piece)
                  else add(f"optim/{name}/master", piece.master.reshape(-1))}
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                values[k] = add(f"optim/{name}/{k}", st[k].reshape(-1))
        tp = parallel.get_tensor_model_parallel_world_size()
        optim.setdefault(name, []).append({
            "dim": dim, "start": start, "shard": list(p.shape), "full": None if dim is None else p.shape[dim] * tp,
            "lo": lo, "hi": hi, "values": values, **_blocks(p)})
    # Fused AdamW keeps each step count on the device: one read for all of them, not one per tensor.
    steps = [torch.as_tensor(s["step"]).float().reshape(()) for s in optimizer.inner.state.values() if "step" in s]
    step = int(torch.stack(steps).max()) if steps else 0
    return {"optim": optim, "step": step, "loss_scaler": optimizer.loss_scaler.state_dict()}


def restore_rng(reader: CheckpointReader, layout: dict) -> bool:
    """Each rank's RNG streams, when the layout is unchanged (else the seed's streams stand)."""
    saved = reader.metadata["layout"]
    if any(saved.get(k, 1 if k == "cp" else None) != layout.get(k, 1 if k == "cp" else None)
           for k in ("tp", "cp", "pp", "dp", "vpp", "world")):
        return False
    rng = reader.rng(dist.get_rank())
    if rng is None:
        return False
    torch.set_rng_state(rng["cpu"])
    get_rng_tracker().set_states(rng["tracker"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return True
