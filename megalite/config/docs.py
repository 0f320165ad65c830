"""docs/configuration.md, generated from the sections so it cannot drift from them:
`python -m megalite.config docs > docs/configuration.md` (a test compares the two)."""
from __future__ import annotations

import dataclasses
import typing

from megalite.config import megatron
from megalite.config.fields import flags_of, spec_of
from megalite.config.run import SECTIONS

INTRO = """# Configuration

Every setting of `pretrain_gpt.py` and `pretrain_bert.py` is a field of one typed section below
(`megalite.config.RunConfig`). The command line, `--help`, config files and this page are generated
from the same dataclasses.

- **Flags**: each field's flag is its name with dashes; Megatron-LM's spellings are accepted too
  (the second column lists them). A flag given twice keeps the last value, as in Megatron-LM.
- **Files**: `--config FILE` reads a TOML file (YAML too, with PyYAML) of `[section]` tables with
  these field names; flags given with it override the file. Unknown sections or keys, wrong types
  and values outside the choices end the run in one line naming the key and the file.
- **`--print-config`** prints the resolved configuration (every default filled in) as a file
  `--config` reads again, after checking it for the world size torchrun gives (`WORLD_SIZE`): no
  process group is started and no data is read. Values derived from other settings are written as
  comments (`# lr_warmup_iters = 10  (derived)`), so a flag given over the file derives them anew.
  The preset is written out the same way: every model and MoE field left to it appears with the
  value the built model holds (`# num_layers = 4  (derived)`), so the file says what trains; read
  back, as printed or with those lines uncommented, it builds the same model (every preset is
  checked both ways). A dense model's MoE fields are comments too.
- **Resuming**: `--load` without shape flags takes the model's shape from the checkpoint (its
  `run_config`, or the model of one imported from Hugging Face); `--use-checkpoint-args` says so
  explicitly, and then a shape flag that disagrees is refused naming it. Layout, intervals and
  paths may change on resume. Every checkpoint holds the run's configuration (`run_config` in its
  metadata); `--metrics-file PATH` writes it beside the records as `PATH.config.toml`, and
  TensorBoard shows it as text.

```bash
WORLD_SIZE=4 python pretrain_gpt.py --config examples/gpt-small.toml --tp 2 --print-config > job.toml
torchrun --standalone --nproc_per_node 4 pretrain_gpt.py --config examples/gpt-small.toml --tp 2 --train-iters 200
```

Derived values: `--seq-length` defaults to `--max-position-embeddings`, else the preset's
positions; `--train-samples N` sets `--train-iters` to N // global batch and, with no decay length
given, decays the learning rate over N samples; `--lr-warmup-fraction f` warms up for f x the decay
length; `--num-layers-per-virtual-pipeline-stage L` sets `--vpp` to layers / (pp x L); `--zero-stage`
defaults to 1 with `--use-distributed-optimizer`, else 0. `--rampup-batch-size START INCREMENT SAMPLES`
grows the global batch as Megatron-LM does: START + INCREMENT x (samples seen / (SAMPLES / increments)),
the full batch after SAMPLES; the learning rate then follows the samples seen, in full batches, and
`--train-samples` counts the ramp's steps one by one (with `--train-iters`, which Megatron-LM refuses
with a ramp, the run is that many steps). `--step-batch-size-schedule "THRESHOLD:BATCH ..."` (Megatron-LM's
successor of the ramp) gives the batch by steps: thresholds in tokens (K/M/B/T suffixes; divided by
`--seq-length` into samples), the first 0, and a step takes the batch of the last threshold the samples
consumed before it reached; `--global-batch-size` becomes the last batch (one that disagrees is
refused), the learning rate follows the samples seen in it, and `--train-samples` counts the steps one
by one up to the last threshold (megalite/config/batch_schedule.py).

Megatron-LM's defaults where megalite's models differ: a model given by Megatron-LM's size flags
(`--num-layers`, `--hidden-size`, `--num-attention-heads`, no `--model`) has Megatron-LM's exact (erf)
GeLU in its MLP, and `--openai-gelu` its tanh form; a preset keeps its own (the GPT-2 presets, like
Hugging Face's GPT-2, the tanh form; BERT's the exact one). `--optimizer sgd` is Megatron-LM's SGD:
weight decay added to the gradient and `--sgd-momentum` (0.9).

Errors name a flag as the command line spelled it: with `--pipeline-model-parallel-size 3`, a layout
error says `--pipeline-model-parallel-size`, not megalite's `--pp`.
"""


def _type_name(hint) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    kind = args[0] if args else hint
    if typing.get_origin(kind) is list:
        return f"list of {typing.get_args(kind)[0].__name__}"
    return kind.__name__


def _row(f: dataclasses.Field, hint) -> str:
    spec = spec_of(f)
    flags = flags_of(f)
    aliases = [*flags[1:], *(f"{flag} (= {flags[0]} {str(v).lower()})" for flag, v in spec.sets)]
    default = f.default if f.default is not dataclasses.MISSING else None
    kind = _type_name(hint) + (f": {', '.join(map(str, spec.choices))}" if spec.choices else "")
    cell = "" if default is None else f"`{default}`"
    help_cell = spec.help.replace("|", r"\|")  # a bar in a help (a layout's stages) is not a column
    return f"| `{f.name}` | `{flags[0]}` | {', '.join(f'`{a}`' for a in aliases)} | {kind} | {cell} | {help_cell} |"


def reference_markdown() -> str:
    out = [INTRO]
    for name, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        out += [f"## [{name}]", "", cls.__doc__.strip(), "",
                "| field | flag | also accepted | type | default | meaning |", "|---|---|---|---|---|---|"]
        out += [_row(f, hints[f.name]) for f in dataclasses.fields(cls)]
        out.append("")
    out += ["## Megatron-LM's flags", "",
            "Every flag of Megatron-LM's `megatron/training/arguments.py` is one of three kinds "
            "(tests/test_megatron_flags.py checks the list in tests/data/megatron_lm_flags.txt):", "",
            "- **honoured**: a field's flag or alias in the sections above (the flag and *also accepted* "
            "columns), or one of Megatron-LM's other spellings of a flag (the last table);",
            f"- **accepted without effect** ({len(megatron.ACCEPTED_WITHOUT_EFFECT)} flags): only those that "
            "cannot change the numbers (profiling, logging, kernel choices, launcher and file details);",
            f"- **refused** ({len(megatron.REFUSED)} flags): the run ends in one line saying why.", "",
            "## Megatron-LM flags accepted without effect", "",
            "Given, they change nothing; a note line at start lists those a run was given.", "",
            "| flag | why nothing changes |", "|---|---|"]
    out += [f"| `{flag}` | {why} |" for flag, (_, why) in megatron.ACCEPTED_WITHOUT_EFFECT.items()]
    out += ["", "## Megatron-LM flags megalite refuses", "", "Each ends the run in one line saying why.", "",
            "| flag | why |", "|---|---|"]
    out += [f"| `{flag}` | {why} |" for flag, (_, why) in megatron.REFUSED.items()]
    out += ["", "## Megatron-LM's other spellings", "", "Each is the flag it names, in every way.", "",
            "| spelling | is |", "|---|---|"]
    out += [f"| `{alias}` | `{flag}` |" for alias, flag in megatron.ALIASES.items()]
    return "\n".join(out) + "\n"
