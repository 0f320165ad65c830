"""Which data each split reads: --data-path cut by --split, or Megatron-LM's per-split paths
(--train/valid/test-data-path), each possibly read from a file (--data-args-path,
--per-split-data-args-path) as Megatron-LM's training script reads them."""
from __future__ import annotations

import difflib
import json

SPLITS = ("train", "valid", "test")


def split_blends(data) -> tuple[list[str] | None, tuple | None]:
    """(--data-path's words, None), or (None, the train, valid and test splits' words, None for a split
    not named) of a data section; a file that cannot be read, or names no data, is a ValueError naming it."""
    if data.data_args_path is not None:
        words = _read(data.data_args_path, "--data-args-path").split()
        if not words:
            raise ValueError(f"--data-args-path {data.data_args_path} is empty: it should hold --data-path's words "
                             f"(a prefix, weight-prefix pairs, or prefixes alone)")
        return words, None
    if data.per_split_data_args_path is not None:
        path = data.per_split_data_args_path
        text = _read(path, "--per-split-data-args-path")
        try:
            named = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--per-split-data-args-path {path}: not JSON ({e})") from None
        if not isinstance(named, dict) or "train" not in named:
            raise ValueError(f"--per-split-data-args-path {path}: expected an object with \"train\" (and \"valid\", "
                             f"\"test\") keys, each a list or string of prefixes and weights")
        for key in named:
            if key not in SPLITS:
                close = difflib.get_close_matches(key, SPLITS, n=1)
                raise ValueError(f"--per-split-data-args-path {path}: {key!r} is not a split"
                                 f"{f' (did you mean {close[0]!r}?)' if close else ''}: the keys are train, valid, test")
        words = tuple(_words(named.get(name), path, name) for name in SPLITS)
        if words[0] is None:
            raise ValueError(f"--per-split-data-args-path {path}: \"train\" names no data")
        return None, words
    if data.train_data_path:
        return None, (data.train_data_path, data.valid_data_path, data.test_data_path)
    return data.data_path, None


def split_flags(data) -> tuple[str, str, str]:
    """Where each split's words come from, as the messages about them should say."""
    if data.data_args_path is not None:
        return (f"--data-args-path {data.data_args_path}",) * 3
    if data.per_split_data_args_path is not None:
        return tuple(f"--per-split-data-args-path {data.per_split_data_args_path} ({name!r})" for name in SPLITS)
    if data.train_data_path:
        return "--train-data-path", "--valid-data-path", "--test-data-path"
    return ("--data-path",) * 3


def _read(path: str, flag: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot be read ({e.strerror or e})") from None


def _words(value, path: str, name: str) -> list[str] | None:
    """A split's entry of the JSON file as --data-path-style words (Megatron-LM splits a string at spaces)."""
    if value is None or value == [] or (isinstance(value, str) and not value.split()):
        return None
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
        return [str(v) for v in value]
    raise ValueError(f"--per-split-data-args-path {path}: \"{name}\" is neither a list nor a string of prefixes "
                     f"and weights")
