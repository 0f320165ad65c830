"""The conversion engine every family shares: name tables, the tensor moves they name, refusals,
and reading save_pretrained directories.

A table is a list of rows (megalite name, Hugging Face name or names, how). `how` says what
happens to the tensor on the way in; the way out undoes it:
  same   copied;
  t      transposed (GPT-2's Conv1D stores [in, out], nn.Linear [out, in]);
  vocab  rows padded with zeros to the padded vocabulary (tp = 1), cut to the vocabulary on export;
  qkv    q, k, v interleaved into rows [head, (q, k, v), head_dim]: from three Hugging Face tensors
         (a tuple of names), or from GPT-2's packed c_attn (one name; transposed first when a weight);
  kv     k, v interleaved into rows [group, (k, v), head_dim] (grouped-query attention);
  glu    gate, up stacked: [gate; up] (one interleaved set); the layer splits each half over TP.
Interleaving keeps what belongs together (a head's q, k, v; a group's k, v) in neighbouring rows, so
any tensor-parallel rank's contiguous block of rows holds whole sets.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

import torch

from megalite.runtime import UsageError

Row = tuple[str, "str | tuple[str, ...]", str]
INTERLEAVED = ("qkv", "kv", "glu")


class ConversionError(UsageError):
    """A model, setting or file megalite cannot convert (a ValueError; the CLI prints it as one line)."""


class ConversionNote(UserWarning):
    """Something the user should know about a conversion that went through (the CLI prints it)."""


def interleave(parts: Sequence[torch.Tensor], groups: int) -> torch.Tensor:
    """n tensors [rows, ...] whose rows are `groups` blocks each -> [n * rows, ...] ordered
    [group, part, rows of the block]."""
    stacked = torch.stack(list(parts))  # [n, rows, ...]
    rest = stacked.shape[2:]
    return stacked.view(len(parts), groups, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def deinterleave(t: torch.Tensor, n: int, groups: int) -> list[torch.Tensor]:
    """The inverse of interleave: n tensors [rows / n, ...]."""
    rest = t.shape[1:]
    parts = t.view(groups, n, -1, *rest).transpose(0, 1)  # [n, groups, block, ...]
    return [p.reshape(-1, *rest) for p in parts.unbind(0)]


def own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy, sharing no storage with the source model."""
    return t.detach().clone(memory_format=torch.contiguous_format)


def import_tensors(theirs: Mapping[str, torch.Tensor], table: list[Row], groups: Mapping[str, int],
                   padded_vocab: int) -> dict[str, torch.Tensor]:
    """megalite's tensors from a Hugging Face state dict. `groups[how]`: the number of interleaved
    sets for qkv (heads), kv (query groups) and glu (1: gate and up stacked)."""
    out = {}
    for ours_name, theirs_name, how in table:
        if isinstance(theirs_name, tuple):  # q, k, v / k, v / gate, up: separate Linear layers
            t = interleave([theirs[n] for n in theirs_name], groups[how])
        elif how == "qkv":  # GPT-2: packed Conv1D [in, 3h] (weight) or [3h] (bias)
            packed = theirs[theirs_name]
            packed = packed.t() if packed.ndim == 2 else packed
            t = interleave(packed.chunk(3, dim=0), groups[how])
        elif how == "t":
            t = theirs[theirs_name].t()
        elif how in ("gate_up", "experts_t"):
            t = _experts_from_hf(theirs[theirs_name], how)
        elif how == "vocab":
            real = theirs[theirs_name]
            t = real.new_zeros((padded_vocab, *real.shape[1:]))
            t[: real.shape[0]] = real
        else:
            t = theirs[theirs_name]
        out[ours_name] = own(t)
    return out


def export_tensors(ours: Mapping[str, torch.Tensor], table: list[Row], groups: Mapping[str, int],
                   vocab: int) -> dict[str, torch.Tensor]:
    """The inverse of import_tensors: Hugging Face names and layouts, vocabulary padding cut."""
    out = {}
    for ours_name, theirs_name, how in table:
        t = ours[ours_name]
        if isinstance(theirs_name, tuple):
            for name, part in zip(theirs_name, deinterleave(t, len(theirs_name), groups[how])):
                out[name] = own(part)
        elif how == "qkv":  # GPT-2's packed c_attn
            packed = torch.cat(deinterleave(t, 3, groups[how]), dim=0)
            out[theirs_name] = own(packed.t() if packed.ndim == 2 else packed)
        elif how == "t":
            out[theirs_name] = own(t.t())
        elif how in ("gate_up", "experts_t"):
            out[theirs_name] = own(_experts_to_hf(t, how))
        elif how == "vocab":
            out[theirs_name] = own(t[:vocab])
        else:
            out[theirs_name] = own(t)
    return out


def _experts_from_hf(t: torch.Tensor, how: str) -> torch.Tensor:
    """Stacked experts held as x @ W (gpt-oss): `experts_t` [E, in, out] -> megalite's [E, out, in];
    `gate_up` [E, H, 2F] (or a bias [E, 2F]) whose last dim interleaves gate and up -> [E, 2F, H] (or
    [E, 2F]) with the gate rows first, then the up rows."""
    if how == "gate_up":
        t = torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)
    return t.transpose(1, 2) if t.ndim == 3 else t


def _experts_to_hf(t: torch.Tensor, how: str) -> torch.Tensor:
    """The inverse of _experts_from_hf."""
    t = t.transpose(1, 2) if t.ndim == 3 else t
    if how == "gate_up":
        gate, up = t.chunk(2, dim=-1)
        t = torch.stack([gate, up], dim=-1).flatten(-2)
    return t


def pairs(modules, params=("weight", "bias")) -> list[Row]:
    """'same' rows for each (ours, theirs) module and parameter."""
    return [(f"{a}.{p}", f"{b}.{p}", "same") for a, b in modules for p in params]


def listed(names, limit: int = 6) -> str:
    names = list(names)
    return f"{', '.join(names[:limit])}{' ...' if len(names) > limit else ''}"


def refuse(what: str, problems: list[str], to: str = "megalite") -> None:
    """Every problem found, in one message."""
    if problems:
        raise ConversionError(f"cannot convert {what} to {to}: " + "; ".join(problems))


def table_problems(state_dict: Mapping[str, torch.Tensor], table: list[Row], vocab_size: int) -> list[str]:
    """Names the table expects but the state dict lacks, names it does not expect, a short vocabulary."""
    problems = []
    known = [ours for ours, _, _ in table]
    missing = [name for name in known if name not in state_dict]
    if missing:
        problems.append(f"the state dict lacks {listed(missing)}")
    extra = [k for k in state_dict if k not in set(known)]
    if extra:
        problems.append(f"unexpected entries {listed(extra)}")
    rows = state_dict.get("word_embeddings.weight")
    if rows is not None and rows.shape[0] < vocab_size:
        problems.append(f"word_embeddings has {rows.shape[0]} rows, fewer than vocab_size ({vocab_size})")
    return problems


def load_into(model, theirs: dict[str, torch.Tensor]):
    """Hugging Face `model` (its parameters' dtype set) holding `theirs`, in eval mode. A name the
    model lacks, or a parameter left out, is a bug in a table, not the user's input."""
    missing_keys, unexpected = model.load_state_dict(theirs, strict=False)
    parameters = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    if unexpected or parameters & set(missing_keys):
        raise RuntimeError(f"to_hf: unmatched names: missing {sorted(parameters & set(missing_keys))}, "
                           f"unexpected {sorted(unexpected)}")
    return model.eval()


def transformers():
    try:
        import transformers as tf
    except ImportError as e:  # pragma: no cover - transformers is a test dependency
        raise ImportError("Hugging Face interop needs `transformers`: pip install 'megalite[hf]'") from e
    return tf


def load_hf_config(directory):
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a directory saved with save_pretrained (no config.json)")
    try:
        return transformers().AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers' own checks of the file (rope parameters, field types)
        if not isinstance(e, (KeyError, OSError, ValueError, TypeError)) and "Validation" not in type(e).__name__:
            raise
        text = " ".join(str(e).split())[:300]  # its report spans lines: one line here
        raise ConversionError(f"{path / 'config.json'} cannot be read by transformers: {text}") from None


def stored_tensor_shapes(directory) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a save_pretrained directory's safetensors files, from their
    headers (no tensor is read); {} for other formats."""
    from safetensors import safe_open  # installed with transformers

    shapes = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


def stored_tensor_names(directory) -> list[str]:
    """The tensor names in a save_pretrained directory's weight files, from their index or headers (no
    tensor is read); [] when it has none."""
    path = Path(directory)
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / index).is_file():
            return list(json.loads((path / index).read_text())["weight_map"])
    from safetensors import safe_open  # installed with transformers

    names = []
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            names += list(f.keys())
    if not names and (path / "pytorch_model.bin").is_file():
        try:
            names = list(torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True, mmap=True))
        except Exception as e:  # noqa: BLE001 - a pickle holding more than tensors: one line, not a traceback
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise ConversionError(f"cannot read {path / 'pytorch_model.bin'}: {type(e).__name__}: {first} (megalite "
                                  f"reads safetensors, or pytorch_model.bin files that hold tensors only)") from None
    return names


# Buffers older transformers saved with the weights and today's rebuild from the config.
_REBUILT_BUFFERS = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def load_hf_weights(cls, directory, arch: str, names_checked: bool = False):
    """cls.from_pretrained(directory), refusing in one line a checkpoint that does not fit its config:
    weights it lacks (e.g. one saved from the base model without its head; tied weights may be
    absent), tensors the config does not make (more layers than num_hidden_layers, unknown names;
    unless the family checked the names itself, `names_checked`), shapes the config contradicts, files
    that cannot be read as weights (a pickle holding more than tensors), and NaN/inf values."""
    where = f"{directory} ({arch})"
    try:
        model, info = cls.from_pretrained(directory, local_files_only=True, output_loading_info=True,
                                          ignore_mismatched_sizes=True)
    except Exception as e:  # noqa: BLE001 - an unreadable file (OSError, a pickle's error): one line, not a traceback
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise ConversionError(f"cannot read the {arch} weights in {directory}: {type(e).__name__}: {first} (megalite "
                              f"reads safetensors, or pytorch_model.bin files that hold tensors only)") from None
    tied = set(getattr(cls, "_tied_weights_keys", None) or ())
    if getattr(model.config, "tie_word_embeddings", False):
        tied.add("lm_head.weight")
    problems = []
    mismatched = list(info.get("mismatched_keys", ()))
    if mismatched:
        shapes = ", ".join(f"{k} {tuple(stored)} (the config makes {tuple(made)})" for k, stored, made in mismatched[:5])
        problems.append(f"the weight files' shapes contradict config.json: {shapes}"
                        f"{f' and {len(mismatched) - 5} more' if len(mismatched) > 5 else ''} (use the config "
                        f"saved with these weights)")
    shaped = {k for k, _, _ in mismatched}
    missing = [k for k in info.get("missing_keys", ()) if k not in tied and k not in shaped]
    if missing:
        problems.append(f"the checkpoint lacks {listed(sorted(missing))}")
    unexpected = [k for k in info.get("unexpected_keys", ()) if not k.endswith(_REBUILT_BUFFERS)]
    if unexpected and not names_checked:
        problems.append(f"the weight files hold tensors {arch} with this config.json does not have: "
                        f"{listed(sorted(unexpected))} (a config of another model, e.g. fewer layers: use the config "
                        f"saved with these weights)")
    refuse(where, problems)
    bad = [k for k, t in model.state_dict().items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise ConversionError(f"cannot convert {where} to megalite: the weights hold NaN or inf in {listed(bad)} "
                              f"(damaged files, or a model that diverged before it was saved)")
    return model.eval()
