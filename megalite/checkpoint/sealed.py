"""metadata.json under the same guard as the tensors: a CRC-32 of every field (and of every model
config field) written with it, so an edit after the save is refused naming the field, and the model
config typed on read, so a missing or mistyped field is one line, not a traceback.

The seal catches edits and damage, not a forger (who could rewrite the seal too); a checkpoint
written before seals existed has none and is read as before."""
from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path

import torch

from megalite.errors import UsageError
from megalite.models.config import TransformerConfig

SEAL = "field_crc32"


def _fields(metadata: dict) -> dict[str, str]:
    """Dotted field name -> its canonical JSON: the top-level fields, the model config's one by one."""
    out = {}
    for key, value in metadata.items():
        if key == SEAL:
            continue
        if key == "config" and isinstance(value, dict):
            out.update({f"config.{k}": json.dumps(v, sort_keys=True) for k, v in value.items()})
        else:
            out[key] = json.dumps(value, sort_keys=True)
    return out


def _crc(text: str) -> str:
    return f"{zlib.crc32(text.encode()):08x}"


def sealed(metadata: dict) -> dict:
    """`metadata` with the CRC-32 of each of its fields."""
    return {**metadata, SEAL: {k: _crc(v) for k, v in _fields(metadata).items()}}


def check_seal(metadata: dict, meta_path: Path) -> None:
    """Refuse metadata a field of which was edited, deleted or added after the save, naming it."""
    seal = metadata.get(SEAL)
    if seal is None:
        return
    fix = "restore the checkpoint's own metadata.json, or --load an earlier checkpoint"
    if not isinstance(seal, dict):
        raise UsageError(f"checkpoint metadata {meta_path} has a damaged {SEAL} record: {fix}")
    fields = _fields(metadata)
    for name, crc in seal.items():
        if name not in fields:
            raise UsageError(f"checkpoint metadata {meta_path}: field {name} was deleted after the checkpoint was "
                             f"written: {fix}")
        if _crc(fields[name]) != crc:
            raise UsageError(f"checkpoint metadata {meta_path}: field {name} was changed after the checkpoint was "
                             f"written (it fails its CRC-32 check; it now holds {fields[name][:60]}): {fix}")
    added = sorted(set(fields) - set(seal))
    if added:
        raise UsageError(f"checkpoint metadata {meta_path}: field {added[0]} was added after the checkpoint was "
                         f"written: {fix}")


_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "list": (list,), "dict": (dict,)}


def _allowed(annotation: str) -> tuple[tuple[type, ...], bool] | None:
    """(the JSON types a field of this annotation holds, None allowed), or None where it is not plain."""
    kinds, optional = [], False
    for part in annotation.replace(" ", "").split("|"):
        base = part.split("[")[0]
        if base == "None":
            optional = True
        elif base in _TYPES:
            kinds += _TYPES[base]
        else:
            return None
    return tuple(kinds), optional


def typed_config(d, meta_path: Path) -> TransformerConfig:
    """The TransformerConfig of a checkpoint's `config` record; a field missing, of the wrong type or
    of a value the model refuses is one line naming it."""
    if not isinstance(d, dict):
        raise UsageError(f"checkpoint metadata {meta_path} holds no model config: the file was damaged")
    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    values = {}
    for name, f in fields.items():
        if name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise UsageError(f"checkpoint metadata {meta_path}: the model config has no {name}: the file was "
                                 f"damaged; restore it, or --load an earlier checkpoint")
            continue
        value = d[name]
        if name == "params_dtype":
            dtype = getattr(torch, str(value), None)
            if not isinstance(dtype, torch.dtype):
                raise UsageError(f"checkpoint metadata {meta_path}: config.params_dtype {value!r} is not a torch "
                                 f"dtype")
            values[name] = dtype
            continue
        allowed = _allowed(f.type) if isinstance(f.type, str) else None
        if allowed is not None and not (value is None and allowed[1]):
            kinds = allowed[0]
            wrong = not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)
            if wrong:
                raise UsageError(f"checkpoint metadata {meta_path}: config.{name} holds {value!r}, not "
                                 f"{f.type.replace(' | None', '')}: the file was damaged or edited")
        values[name] = value
    try:
        return TransformerConfig(**values)
    except (ValueError, TypeError) as e:
        raise UsageError(f"checkpoint metadata {meta_path}: its model config is refused ({e})") from None
