"""Loading at any layout: each tensor's piece for this rank's current (tp, pp, dp, vpp) layout cut
from the full tensor the reader assembles (or, when a stored slice is exactly that piece, read
straight into place), for the model weights, the optimizer state and single-device state dicts."""
from __future__ import annotations

import torch

from megalite.checkpoint.fileformat import RankFile
from megalite.checkpoint.layout import (EXPERT_TENSOR, FP8_STATE_SUFFIXES, VOCAB_PARAMS, expert_biases, fp8_named_scalings,
                                        piece_parts, shard_of, stored_by_param, stored_tensors)
from megalite.checkpoint.rank_state import master_is_the_param
from megalite.checkpoint.reader import CheckpointReader
from megalite.models.config import TransformerConfig
from megalite.optim.optimizer import moment_dtype, moment_names
from megalite.precision.scaling import fit_history
from megalite.runtime import UsageError, say


def _copy_local(dst: torch.Tensor, full: torch.Tensor, dim, start: int, shape, lo: int, hi: int,
                blocks: int = 1) -> None:
    """dst (flat, hi - lo elements) <- elements [lo, hi) of the flattened shard of `full` at `start`
    along `dim` (of each of `blocks` blocks), without building the shard when only vocabulary rows
    are missing."""
    n = shape[dim] if dim is not None else None
    have = None if dim is None else max(0, min(n, full.shape[dim] - start))
    if dim == 0 and have < n:  # padded vocabulary rows: copy the real ones, zero the rest
        real = full.narrow(0, start, have).reshape(-1) if have else full.new_empty(0)
        part = real[lo:hi] if lo < real.numel() else real[:0]
        dst[:part.numel()].copy_(part)
        dst[part.numel():].zero_()
        return
    dst.copy_(shard_of(full, dim, start, shape, blocks).reshape(-1)[lo:hi])


def load_model_weights(directory, model_chunks, reader: CheckpointReader | None = None) -> CheckpointReader:
    """Load the checkpoint's weights into this rank's chunks, resharded to the current layout.
    A stored slice that is exactly a parameter (the same layout) is read straight into it."""
    reader = reader or CheckpointReader(directory)
    plan = []
    for st in stored_tensors(model_chunks):
        plan.append((st, reader.direct_model(st.name, st.dim, st.start, st.view, st.blocks)))
    reader.verify(st.name for st, direct in plan if direct is None)
    with torch.no_grad():
        for st, direct in plan:
            if direct is not None:
                reader.read_direct(*direct, st.view, st.name)
                continue
            full = reader.full_tensor(st.name)
            expected = list(st.view.shape)
            if st.dim is not None:
                expected[st.dim] = st.full
            if list(full.shape) != expected:
                raise UsageError(f"checkpoint tensor {st.name} has shape {tuple(full.shape)}, "
                                 f"which does not fit this model's {st.local} ({tuple(st.view.shape)} per rank)")
            _copy_local(st.view.view(-1), full, st.dim, st.start, st.view.shape, 0, st.view.numel(), st.blocks)
        for name, bias in expert_biases(model_chunks):
            if name not in reader.model_names():
                raise UsageError(f"checkpoint {reader.path} has no {name}: it was saved without "
                                 f"--moe-router-enable-expert-bias; resume without it")
            bias.copy_(reader.full_tensor(name))
        _load_fp8_scaling(reader, model_chunks)
        reader.finish_direct()
    return reader


def _load_fp8_scaling(reader, model_chunks) -> None:
    """FP8 delayed scaling's histories (each layer's, each expert's), where the checkpoint has them,
    and scales chosen from them anew (another --fp8-format or --fp8-margin takes effect at once); a
    run that was not in delayed FP8 starts them empty, said once. A history of another length keeps
    its newest amaxes."""
    names = set(reader.model_names())
    scalings = [named for experts in (False, True) for named in fp8_named_scalings(model_chunks, experts)]
    fresh = 0
    for base, scaling in scalings:
        if f"{base}_history" in names and f"{base}_scale" in names:
            scaling.history.copy_(fit_history(reader.full_tensor(f"{base}_history"), scaling.history.shape[-1]))
            scaling.scale.copy_(reader.full_tensor(f"{base}_scale"))
            scaling.rescale()
        else:
            fresh += 1
    if fresh:
        say(f"megalite: note: checkpoint {reader.path} has no FP8 delayed-scaling state for {fresh} of {len(scalings)} "
            f"GEMMs: their amax histories start empty")


def load_optimizer_state(reader: CheckpointReader, model_chunks, optimizer) -> bool:
    """Masters and Adam moments, resharded to this rank's pieces. False if the checkpoint has none."""
    owners = stored_by_param(model_chunks)
    if not any(f.meta.get("optim") for f in reader.files):
        return False
    step = max((f.meta.get("step", 0) for f in reader.files), default=0)
    plan = []
    for piece in optimizer.pieces:
        for part in piece_parts(owners, piece):  # one, or one per expert the piece covers
            stored = part.stored
            direct = reader.direct_optim(stored.name, stored.dim, stored.start, stored.view.shape, part.lo, part.hi,
                                         stored.blocks)
            plan.append((piece, part, direct))
    reader.verify(part.stored.name for _, part, direct in plan if direct is None)
    fused = bool(optimizer.inner.defaults.get("fused"))
    fresh = 0
    with torch.no_grad():
        # A parameter lies in one bucket, so this rank holds at most one piece of it: assemble its
        # full state, copy the piece, and let the full tensors go before the next parameter.
        for piece, part, direct in plan:
            stored, name = part.stored, part.stored.name
            # fp32 masters that are the parameters and were stored as the weights: already loaded.
            skip = ("master",) if master_is_the_param(piece) and reader.master_is_the_weight(name) else ()
            st = optimizer.inner.state[piece.master]
            moments = moment_names(optimizer.inner, piece.master)  # (Muon's matrices: one)
            if direct is not None and _read_optim_direct(reader, piece, part, st, name, skip, moments,
                                                           {k: moment_dtype(optimizer.inner, piece.master, k) for k in moments}, *direct):
                pass
            else:
                full = reader.full_optimizer_state(name, skip)
                if full is None:
                    raise UsageError(f"checkpoint {reader.path} has no optimizer state for {name}")
                args = (stored.dim, stored.start, stored.view.shape, part.lo, part.hi, stored.blocks)
                if "master" in full:
                    _copy_local(part.of(piece.master), full["master"], *args)
                for k in moments:
                    if k in full:
                        st[k] = _state_tensor(st.get(k), piece.master, moment_dtype(optimizer.inner, piece.master, k))
                        _copy_local(part.of(st[k]), full[k], *args)
                del full
            if any(k not in st for k in moments):  # the saving optimizer kept fewer (Muon's or SGD's into
                fresh += 1 if st else 0           # Adam): this master's state starts anew, step count 0
                st.clear()
            elif "exp_avg" in st:
                st["step"] = torch.tensor(float(step), device=piece.master.device if fused else "cpu")
        reader.finish_direct()
    if fresh:
        say(f"megalite: note: {fresh} parameters' optimizer state starts anew: checkpoint {reader.path} holds only their first "
            f"moment (saved by another optimizer), and this one keeps a second")
    scaler = next((f.meta["loss_scaler"] for f in reader.files if "loss_scaler" in f.meta), None)
    # Only a dynamic scaler carries state worth resuming; a constant one (bf16, fp32, or an explicit
    # --loss-scale) keeps what this run asked for, and an fp16 <-> bf16 switch starts the scaler anew.
    if scaler is not None and set(scaler) == set(optimizer.loss_scaler.state_dict()) and len(scaler) > 1:
        optimizer.loss_scaler.load_state_dict(scaler)
    optimizer.publish()
    return True


def _read_optim_direct(reader, piece, part, st: dict, name: str, skip, moments, dtypes: dict, f: RankFile,
                       values: dict) -> bool:
    """The same layout: read this part of the piece's stored state straight into the optimizer's
    tensors. False (nothing read) when a stored tensor does not fit its destination."""
    moments = [k for k in moments if k in values]
    for k in moments:
        st[k] = _state_tensor(st.get(k), piece.master, dtypes.get(k))
    dst = {k: part.of(st[k]) for k in moments}
    if "master" not in skip:
        if values.get("master") in (None, "model"):
            return False
        dst["master"] = part.of(piece.master)
    if not all(reader.fits(f, values[k], t) for k, t in dst.items()):
        return False
    for k, t in dst.items():
        reader.read_direct(f, values[k], t, f"{name} ({k})")
    return True


def _state_tensor(existing, master: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The optimizer's state tensor for `master` (in `dtype`, default the master's: a bf16 moment stays
    bf16): the existing one when it fits (no new memory)."""
    dtype = dtype or master.dtype
    if torch.is_tensor(existing) and existing.shape == master.shape and existing.dtype == dtype \
            and existing.device == master.device:
        return existing
    return torch.empty_like(master, dtype=dtype, memory_format=torch.contiguous_format)


def load_full_state_dict(directory) -> tuple[TransformerConfig, str, dict[str, torch.Tensor]]:
    """The single-device state dict (tp=1 vocabulary padding) of a checkpoint saved at any layout:
    (config, model kind, state dict)."""
    from megalite.parallel.layers import pad_vocab_size

    reader = CheckpointReader(directory)
    padded = pad_vocab_size(reader.config.vocab_size, 1, reader.config.make_vocab_size_divisible_by)
    sd, experts = {}, {}
    for name in reader.model_names():
        if name.endswith(FP8_STATE_SUFFIXES):  # training state, not the model's weights
            continue
        t = reader.full_tensor(name)
        if name in VOCAB_PARAMS and t.shape[0] < padded:
            t = torch.cat([t, torch.zeros((padded - t.shape[0], *t.shape[1:]), dtype=t.dtype)])
        m = EXPERT_TENSOR.match(name)
        if m:  # one tensor per expert on disk: the one-device model's [experts, ...] parameter
            experts.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = t
            continue
        sd[name] = t if t._base is None else t.clone()  # views of the memory map: callers get their own
    for name, per_expert in experts.items():
        if sorted(per_expert) != list(range(len(per_expert))):
            raise UsageError(f"checkpoint {reader.path} holds experts {sorted(per_expert)} of {name}: rank files "
                             f"are missing")
        sd[name] = torch.stack([per_expert[e] for e in range(len(per_expert))])
    return reader.config, reader.model_kind, sd
