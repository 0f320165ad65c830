"""Megatron-LM's validation flags: --multiple-validation-sets (each prefix of the validation data
validated on its own, a loss of its own), --validation-set-names (what each is called), and
--full-validation (each validation reads every sample of its data once, in whole global batches,
instead of --eval-iters of them). GPT only, as in Megatron-LM; docs/data.md."""
from __future__ import annotations

from dataclasses import dataclass

from megalite.data.gpt_dataset import parse_data_path
from megalite.errors import UsageError


@dataclass(frozen=True)
class ValidationSet:
    name: str | None  # None: the one validation split, logged as ever
    data: object
    batches: int  # global batches each validation reads


def check_flags(cfg, model_kind: str) -> None:
    """Refused in one line before anything starts: what the flags cannot apply to."""
    t, d = cfg.training, cfg.data
    given = [f for f, on in (("--full-validation", t.full_validation),
                             ("--multiple-validation-sets", t.multiple_validation_sets)) if on]
    names = t.validation_set_names
    if names and not t.multiple_validation_sets:
        raise UsageError("--validation-set-names names the sets of --multiple-validation-sets: add it, or drop the "
                         "names")
    if names and (len(set(names)) < len(names) or not all(names) or any("/" in n for n in names)):
        raise UsageError(f"--validation-set-names {' '.join(names)}: each name once, not empty and without '/' (it "
                         f"names the set's metrics: valid/NAME/loss)")
    if not given:
        return
    if model_kind != "gpt":
        raise UsageError(f"{given[0]} is for GPT datasets (as Megatron-LM's); a {model_kind} run validates on "
                         f"--eval-iters batches: drop it")
    if d.mock_data or d.sft_data_path:
        raise UsageError(f"{given[0]} reads indexed validation data; {'--mock-data' if d.mock_data else '--sft-data-path'} "
                         f"has none: give --data-path or --valid-data-path, or drop it")
    if t.multiple_validation_sets and not (d.valid_data_path or d.per_split_data_args_path):
        raise UsageError("--multiple-validation-sets validates each prefix of the validation data named per split: "
                         "give --valid-data-path A B (with --train-data-path) or --per-split-data-args-path")
    if names and d.valid_data_path:  # (from --per-split-data-args-path: counted when the data is read)
        try:
            prefixes = [p for _, p in parse_data_path(d.valid_data_path, "--valid-data-path")]
        except ValueError:  # the data's own refusal says it when the data is read
            return
        _check_names(names, prefixes)


def _check_names(names: list[str], prefixes: list[str]) -> None:
    if len(names) != len(prefixes):
        raise UsageError(f"--validation-set-names gives {len(names)} names for {len(prefixes)} validation sets "
                         f"({', '.join(prefixes)}): give one name a prefix")


def validation_sets(valid, cfg) -> list[ValidationSet]:
    """The run's validation data (a dataset, a list of (prefix, dataset) under
    --multiple-validation-sets, or None) as the sets each validation reads, with how many global
    batches: none when the run does not validate; a set that holds less than one global batch under
    --full-validation is refused in one line."""
    t = cfg.training
    named = [(None, valid)] if not isinstance(valid, list) else list(valid)
    if t.multiple_validation_sets and t.validation_set_names and isinstance(valid, list):
        _check_names(t.validation_set_names, [prefix for prefix, _ in named])
    if valid is None or not t.eval_interval or not (t.eval_iters or t.full_validation):
        return []
    if t.multiple_validation_sets:
        names = t.validation_set_names or [str(i) for i in range(len(named))]
        named = [(name, data) for name, (_, data) in zip(names, named)]
    sets = []
    for name, data in named:
        batches = t.eval_iters
        if t.full_validation:
            samples = len(data)
            batches = samples // t.global_batch_size
            if not batches:
                which = f"validation set {name}" if name is not None else "the validation data"
                raise UsageError(f"--full-validation: {which} holds {samples} samples, less than one global batch of "
                                 f"{t.global_batch_size}: give more validation data or a smaller --global-batch-size")
        sets.append(ValidationSet(name, data, batches))
    return sets


def each_dataset(valid, wrap):
    """`wrap` applied to each validation dataset, whichever form `valid` has."""
    if isinstance(valid, list):
        return [(prefix, wrap(data)) for prefix, data in valid]
    return None if valid is None else wrap(valid)
