"""python -m megalite.tools.generate --load CKPT --prompt TEXT: completions from a megalite
checkpoint (trained, or imported from Hugging Face), at any layout under torchrun.

    python -m megalite.tools.generate --load ckpt --tokenizer tok/ --prompt "Once upon a time"
    torchrun --nproc-per-node 4 -m megalite.tools.generate --load ckpt --tp 2 --pp 2 \\
        --prompt-file prompts.txt --max-new-tokens 64 --temperature 0.8 --top-p 0.9 --seed 1

Every rank loads its part of the checkpoint (layout-free: any --tp/--pp/--ep reads any checkpoint)
and all run the same prompts; global rank 0 prints. docs/generate.md.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from megalite.errors import UsageError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megalite.tools.generate",
                                description="Complete prompts with a megalite checkpoint (greedy or sampled).")
    p.add_argument("--load", required=True, help="megalite checkpoint directory (a --save directory or iter_N)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat the flag for more)")
    p.add_argument("--prompt-file", help="a file of prompts, one a line (empty lines skipped)")
    p.add_argument("--prompt-ids", action="store_true",
                   help="prompts are token ids separated by spaces; completions are printed as ids (no tokenizer)")
    p.add_argument("--tokenizer", help="SentencePiece .model file or Hugging Face tokenizer directory (default: the "
                                       "one the checkpoint's training run named)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens of this total "
                                                            "probability (1: all)")
    p.add_argument("--seed", type=int, default=0, help="the sampling generator's seed (the same on every rank)")
    p.add_argument("--eos-id", type=int, action="append", default=None,
                   help="token id that ends a completion (repeatable; default: the tokenizer's end-of-sequence id "
                        "and a Hugging Face generation_config.json's beside it)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts completed together (left-padded)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE)")
    p.add_argument("--jsonl", action="store_true", help="print one JSON object a prompt: prompt, completion, tokens")
    return p


def _prompts(args) -> list:
    prompts = list(args.prompt)
    if args.prompt_file:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise UsageError(f"--prompt-file {path} does not exist")
        prompts += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise UsageError("give --prompt TEXT or --prompt-file FILE")
    if args.prompt_ids:
        try:
            return [[int(t) for t in p.split()] for p in prompts]
        except ValueError:
            raise UsageError("--prompt-ids: prompts are token ids separated by spaces, e.g. --prompt '1 2 3'") from None
    return prompts


def _tokenizer(args, metadata: dict):
    """The tokenizer --tokenizer names, else the checkpoint's run's, else None (only --prompt-ids works)."""
    from megalite.data.tokenizers import build_tokenizer

    if args.tokenizer:
        return build_tokenizer(args.tokenizer)
    data = (metadata.get("run_config") or {}).get("data") or {}
    if data.get("tokenizer"):
        return build_tokenizer(data["tokenizer"])
    kind = data.get("tokenizer_type")
    if kind and kind != "NullTokenizer":
        return build_tokenizer((kind, data.get("vocab_file"), data.get("merge_file"), data.get("tokenizer_model")))
    if not args.prompt_ids:
        raise UsageError(f"the checkpoint {args.load} names no tokenizer: give --tokenizer (a Hugging Face tokenizer "
                         f"directory or a SentencePiece .model), or prompts as ids with --prompt-ids")
    return None


def _eos_ids(args, tokenizer) -> list[int] | None:
    """--eos-id, else the tokenizer's end id plus those of a generation_config.json beside it."""
    if args.eos_id:
        return args.eos_id
    ids = [] if tokenizer is None or tokenizer.eod is None else [tokenizer.eod]
    if args.tokenizer and (Path(args.tokenizer) / "generation_config.json").is_file():
        eos = json.loads((Path(args.tokenizer) / "generation_config.json").read_text()).get("eos_token_id")
        ids += [t for t in (eos if isinstance(eos, list) else [eos]) if t is not None and t not in ids]
    return ids or None


def build_stage(load: str, tp: int, pp: int, device):
    """(this rank's GPTModel for its pipeline stage at the current layout, loaded from `load`; the
    checkpoint's metadata). Tensor-parallel MoE layers run with sequence parallelism."""
    from megalite import checkpoint, parallel
    from megalite.models import GPTModel
    from megalite.pipeline.partition import layers_of, stage_layer_counts

    reader = checkpoint.CheckpointReader(load)
    if reader.model_kind != "gpt":
        raise UsageError(f"checkpoint {load} holds a {reader.model_kind} model: generation needs a GPT")
    config = reader.config.replace(sequence_parallel=tp > 1 and reader.config.is_moe, recompute="none")
    try:
        counts = stage_layer_counts(config.num_layers, pp)
    except ValueError as e:
        raise UsageError(str(e)) from None
    stage = parallel.get_pipeline_model_parallel_rank()
    model = GPTModel(config, pre_process=stage == 0, post_process=stage == pp - 1,
                     layer_numbers=layers_of(counts, stage), device=device)
    checkpoint.load_model_weights(load, [model], reader)
    return model.eval(), reader.metadata


def loaded_stage(args, minutes: int):
    """Every rank of a tool run: the process groups at --tp/--pp/--ep (the rest data-parallel),
    then (this rank's stage of the --load checkpoint, the tokenizer: `_tokenizer`)."""
    import datetime

    import torch.distributed as dist

    from megalite import parallel
    from megalite.runtime import init_distributed

    device = init_distributed()
    world = dist.get_world_size()
    if world % (args.tp * args.pp):
        raise UsageError(f"--tp {args.tp} x --pp {args.pp} does not divide the {world} ranks")
    parallel.initialize_model_parallel(args.tp, args.pp, expert_model_parallel_size=args.ep,
                                       timeout=datetime.timedelta(minutes=minutes))
    parallel.model_parallel_manual_seed(args.seed)
    model, metadata = build_stage(args.load, args.tp, args.pp, device)
    return model, _tokenizer(args, metadata)


def _run(args) -> None:
    from megalite.data.tokenizers import TokenizerError
    from megalite.generation import generate

    for flag in ("max_new_tokens", "batch_size", "tp", "pp", "ep"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    prompts = _prompts(args)
    import torch.distributed as dist

    try:
        model, tokenizer = loaded_stage(args, minutes=10)
        eos = _eos_ids(args, tokenizer)
        for start in range(0, len(prompts), args.batch_size):
            batch = prompts[start:start + args.batch_size]
            out = generate([model], batch, tokenizer=None if args.prompt_ids else tokenizer,
                           max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, seed=args.seed, eos_id=eos)
            if dist.get_rank() == 0:
                _print(batch, out, args, last=start + len(batch) == len(prompts))
    except (ValueError, FileNotFoundError, TokenizerError) as e:
        raise UsageError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def _print(batch, out, args, last: bool) -> None:
    """Each prompt and its completion (ids with --prompt-ids), a blank line between them; or JSON lines."""
    for i, prompt in enumerate(batch):
        text = " ".join(map(str, out.tokens[i])) if args.prompt_ids else out.texts[i]
        shown = " ".join(map(str, prompt)) if args.prompt_ids else prompt
        if args.jsonl:
            print(json.dumps({"prompt": shown, "completion": text, "tokens": out.tokens[i]}), flush=True)
        else:
            print(f"{shown} {text}" if args.prompt_ids else shown + text, flush=True)
            if not (last and i == len(batch) - 1):
                print(flush=True)


def main(argv: list[str] | None = None) -> int:
    from megalite.runtime import run_main

    return run_main(_run, _parser().parse_args(argv))


if __name__ == "__main__":
    from megalite.runtime import exit_process

    exit_process(main())
