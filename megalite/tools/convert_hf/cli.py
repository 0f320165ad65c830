"""python -m megalite.tools.convert_hf import|export: through megalite checkpoints."""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from megalite.tools.convert_hf.common import ConversionNote
from megalite.tools.convert_hf.convert import SUPPORTED, from_hf, hf_model_kind, to_hf


def _cmd_import(args) -> str:
    from megalite import checkpoint

    kind = hf_model_kind(args.hf_dir)
    config, sd = from_hf(args.hf_dir)
    checkpoint.save_model_checkpoint(args.out, config, kind, sd, iteration=0)
    experts = (f", {config.num_moe_experts} experts top-{config.moe_router_topk} in {sum(config.moe_layer_freq)} "
               f"layers" if config.is_moe else "")
    mtp = f", {config.mtp_num_layers} multi-token prediction layers" if config.mtp_num_layers else ""
    return (f"imported {kind} ({config.num_layers} layers, hidden {config.hidden_size}, "
            f"{config.num_attention_heads} heads, vocab {config.vocab_size}{experts}{mtp}) from {args.hf_dir} "
            f"into {args.out}")


def _cmd_export(args) -> str:
    from megalite import checkpoint

    if not Path(args.load).is_dir():
        raise FileNotFoundError(f"{args.load} is not a megalite checkpoint directory")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} exists and is not an empty directory: choose a new one (an export "
                              f"never writes over files)")
    config, kind, sd = checkpoint.load_full_state_dict(args.load)
    model = to_hf(config, sd, kind, architecture=args.architecture)
    save_whole(model, out)
    return f"exported {kind} from {args.load} as {type(model).__name__} into {args.out}"


def save_whole(model, out: Path) -> None:
    """model.save_pretrained into `out` as a whole or not at all: written beside it, then renamed, so
    a failure (a full disk, a kill) leaves no folder of config.json without weights."""
    import os
    import shutil

    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        model.save_pretrained(partial)
        if out.exists():
            out.rmdir()  # empty (checked above)
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megalite.tools.convert_hf",
        description=f"Convert Hugging Face models ({SUPPORTED}) to megalite checkpoints and back.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face save_pretrained directory -> megalite checkpoint")
    imp.add_argument("--hf-dir", required=True, help="directory written by save_pretrained (nothing is downloaded)")
    imp.add_argument("--out", required=True, help="megalite checkpoint directory to write (iteration 0)")
    exp = sub.add_parser("export", help="megalite checkpoint (any layout) -> Hugging Face save_pretrained directory")
    exp.add_argument("--load", required=True, help="megalite checkpoint directory")
    exp.add_argument("--out", required=True, help="directory for save_pretrained")
    exp.add_argument("--architecture", default=None,
                     help="Hugging Face class to write (default: the one the model's shape calls for, e.g. "
                          "LlamaForCausalLM; MistralForCausalLM holds the same weights)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always", ConversionNote)
            message = _cmd_import(args) if args.command == "import" else _cmd_export(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"megalite: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a read-only folder: nothing half-written is left
        print(f"megalite: error: {args.command} into {args.out} failed ({e.strerror or e}); nothing was written "
              f"there", file=sys.stderr)
        return 2
    said = set()
    for note in notes:
        if issubclass(note.category, ConversionNote):
            if str(note.message) not in said:  # a directory's config is read twice
                print(f"megalite: note: {note.message}", file=sys.stderr)
            said.add(str(note.message))
        else:  # someone else's warning, shown as it would have been
            warnings.showwarning(note.message, note.category, note.filename, note.lineno)
    print(message)
    return 0
