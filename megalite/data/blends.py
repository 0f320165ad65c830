"""Which data each split reads: --data-path cut by --split, or Megatron-LM's per-split paths
(--train/valid/test-data-path), each possibly read from a file (--data-args-path,
--per-split-data-args-path) as Megatron-LM's training script reads them."""
from __future__ import annotations

import json

SPLITS = ("train", "valid", "test")


def split_blends(data) -> tuple[list[str] | None, tuple | None]:
    """(--data-path's words, None), or (None, the train, valid and test splits' words, None for a split
    not named) of a data section; a file that cannot be read is a ValueError naming it."""
    if data.data_args_path:
        return _read(data.data_args_path, "--data-args-path").split(), None
    if data.per_split_data_args_path:
        text = _read(data.per_split_data_args_path, "--per-split-data-args-path")
        try:
            named = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--per-split-data-args-path {data.per_split_data_args_path}: not JSON ({e})") from None
        if not isinstance(named, dict) or "train" not in named:
            raise ValueError(f"--per-split-data-args-path {data.per_split_data_args_path}: expected an object with "
                             f"\"train\" (and \"valid\", \"test\") keys, each a list or string of prefixes and weights")
        return None, tuple(_words(named.get(name), data.per_split_data_args_path, name) for name in SPLITS)
    if data.train_data_path:
        return None, (data.train_data_path, data.valid_data_path, data.test_data_path)
    return data.data_path, None


def _read(path: str, flag: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot be read ({e.strerror or e})") from None


def _words(value, path: str, name: str) -> list[str] | None:
    """A split's entry of the JSON file as --data-path-style words (Megatron-LM splits a string at spaces)."""
    if value is None or value == [] or value == "":
        return None
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
        return [str(v) for v in value]
    raise ValueError(f"--per-split-data-args-path {path}: \"{name}\" is neither a list nor a string of prefixes "
                     f"and weights")
