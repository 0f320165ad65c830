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
from megalite.checkpoint.fileformat import encode_plain
from megalite.checkpoint.layout import expert_biases, fp8_scaling_state, is_writer, piece_parts, stored_by_param, stored_tensors
from megalite.parallel.layers import partition_blocks
from megalite.parallel.random import get_rng_tracker

if TYPE_CHECKING:
    from megalite.checkpoint.reader import CheckpointReader


def master_is_the_param(piece) -> bool:
    """fp32 training: the master is the parameter's own memory, already stored with the model."""
    return (piece.master.dtype == piece.param.dtype
            and piece.master.data_ptr() == piece.buffer.param_slice(piece.lo, piece.hi).data_ptr())


def _first_replica() -> bool:
    """Whether this rank writes what every data- and context-parallel replica holds alike."""
    return parallel.get_data_parallel_rank(with_context_parallel=True) == 0


def _first_replica_of(p) -> bool:
    """`_first_replica`, for `p`: an expert's copies are its expert-data-parallel group."""
    if getattr(p, "expert_parallel", False):
        return parallel.get_expert_data_parallel_rank() == 0
    return _first_replica()


def writer_identity() -> dict:
    """Who writes this rank's file: its global rank and coordinates in the layout (the save's token
    is added by the saver). The reader checks them against the file's place (files swapped or copied
    over one another are refused, not loaded as another rank's state)."""
    if not (dist.is_available() and dist.is_initialized()):
        return {"rank": 0, "coords": {}}
    coords = {"tp": parallel.get_tensor_model_parallel_rank(), "pp": parallel.get_pipeline_model_parallel_rank(),
              "dp": parallel.get_data_parallel_rank(), "cp": parallel.get_context_parallel_rank(),
              "ep": parallel.get_expert_model_parallel_rank()}
    return {"rank": dist.get_rank(), "coords": coords}


def collect_rank_state(model_chunks, optimizer=None, iteration: int = 0, with_rng: bool = True,
                       replica: dict | None = None, with_optim: bool = True):
    """This rank's slices: ([(key, tensor)], structure). The tensors are the live ones (no copies):
    write them before training goes on, or snapshot them. `replica`: state of this rank's own that
    no other rank holds (local SGD's replicas), stored as it is under "replica"."""
    if hasattr(optimizer, "finish_param_gather"):  # --overlap-param-gather: the update's gathers in first
        optimizer.finish_param_gather()
    tensors: list[tuple[str, torch.Tensor]] = []

    def add(key: str, t: torch.Tensor) -> str:
        tensors.append((key, t.detach()))
        return key

    model: dict = {}
    for st in stored_tensors(model_chunks):
        if not (is_writer(st.param) and _first_replica_of(st.param)):
            continue
        t = st.view.detach() if st.keep is None else st.view.detach().narrow(st.dim, 0, st.keep)
        model.setdefault(st.name, []).append({"tensor": add(f"model/{st.name}", t), "dim": st.dim, "start": st.start,
                                              "full": st.full, **_blocks(st.param)})
    if _first_replica():
        for name, b in [*expert_biases(model_chunks), *fp8_scaling_state(model_chunks)]:  # replicated: one copy
            if parallel.get_tensor_model_parallel_rank() == 0:
                model[name] = [{"tensor": add(f"model/{name}", b), "dim": None, "start": 0, "full": None}]
    if parallel.get_expert_data_parallel_rank() == 0 and parallel.get_expert_tensor_parallel_rank() == 0:
        for name, t in fp8_scaling_state(model_chunks, experts=True):  # each expert's, from one of its holders
            model[name] = [{"tensor": add(f"model/{name}", t), "dim": None, "start": 0, "full": None}]
    meta: dict = {"iteration": iteration, "writer": writer_identity(), "model": model}
    if optimizer is not None and with_optim:
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
    owners = stored_by_param(model_chunks)
    optim: dict = {}
    for piece in optimizer.pieces:
        p = piece.param
        if not is_writer(p) or (not optimizer.distributed and not _first_replica_of(p)):
            continue
        st = optimizer.inner.state.get(piece.master, {})
        for part in piece_parts(owners, piece):  # one, or one per expert the piece covers
            stored, name = part.stored, part.stored.name
            values = {"master": "model" if master_is_the_param(piece)
                      else add(f"optim/{name}/master", part.of(piece.master))}
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    values[k] = add(f"optim/{name}/{k}", part.of(st[k]))
            optim.setdefault(name, []).append({
                "dim": stored.dim, "start": stored.start, "shard": list(stored.view.shape), "full": stored.full,
                "lo": part.lo, "hi": part.hi, "values": values, **_blocks(p)})
    # Fused AdamW keeps each step count on the device: one read for all of them, not one per tensor.
    steps = [torch.as_tensor(s["step"]).float().reshape(()) for s in optimizer.inner.state.values() if "step" in s]
    step = int(torch.stack(steps).max()) if steps else 0
    return {"optim": optim, "step": step, "loss_scaler": optimizer.loss_scaler.state_dict()}


def layout_changed(reader: CheckpointReader, layout: dict) -> bool:
    saved = reader.metadata["layout"]
    return any(saved.get(k, 1 if k == "cp" else None) != layout.get(k, 1 if k == "cp" else None)
               for k in ("tp", "cp", "pp", "dp", "vpp", "placement", "world"))


def restore_rng(reader: CheckpointReader, layout: dict) -> bool:
    """Each rank's RNG streams, when the layout is unchanged (else the seed's streams stand) and the
    checkpoint holds them (not saved with --no-save-rng)."""
    if layout_changed(reader, layout):
        return False
    rng = reader.rng(dist.get_rank())
    if rng is None:
        return False
    torch.set_rng_state(rng["cpu"])
    get_rng_tracker().set_states(rng["tracker"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return True
