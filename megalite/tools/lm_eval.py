"""python -m megalite.tools.lm_eval --load CKPT --tasks T1,T2: lm-evaluation-harness scores of a megalite
checkpoint (trained, or imported from Hugging Face), at any layout under torchrun, without an export.

    python -m megalite.tools.lm_eval --load ckpt --tokenizer tok/ --tasks hellaswag --limit 100
    torchrun --nproc-per-node 4 -m megalite.tools.lm_eval --load ckpt --tp 2 --pp 2 \\
        --tasks my_task --include-path tasks/ --output-path scores.json

The model interface is megalite.generation.lm_eval_adapter.MegaliteLM (also for a Python caller:
`lm_eval.simple_evaluate(model=MegaliteLM(chunks, tokenizer), tasks=[...])`). Ranks beyond
tp x pp are data-parallel replicas: lm-eval deals the requests over them. Global rank 0 prints the
table (and writes --output-path). docs/evaluate.md.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from megalite.errors import UsageError

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megalite.tools.lm_eval",
                                description="Score a megalite checkpoint on lm-evaluation-harness tasks.")
    p.add_argument("--load", required=True, help="megalite checkpoint directory (a --save directory or iter_N)")
    p.add_argument("--tasks", required=True, help="lm-eval task (or group) names, comma-separated")
    p.add_argument("--include-path", help="a directory of task YAML files of your own (lm-eval's --include_path)")
    p.add_argument("--tokenizer", help="SentencePiece .model file or Hugging Face tokenizer directory (default: the "
                                       "one the checkpoint's training run named)")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--limit", type=float, default=None, help="documents per task (a fraction if < 1)")
    p.add_argument("--batch-size", type=int, default=8, help="requests scored or completed together")
    p.add_argument("--max-gen-toks", type=int, default=256, help="new tokens of a completion, unless the task says")
    p.add_argument("--add-bos-token", action="store_true", help="start every input with the tokenizer's BOS")
    p.add_argument("--apply-chat-template", action="store_true", help="render prompts with the tokenizer's chat "
                                                                      "template")
    p.add_argument("--seed", type=int, default=0, help="lm-eval's seeds and the sampling generator's")
    p.add_argument("--output-path", help="write the results (lm-eval's dictionary, samples left out) as JSON")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE)")
    return p


def _run(args) -> None:
    import torch.distributed as dist

    from megalite.data.tokenizers import TokenizerError
    from megalite.tools.generate import loaded_stage

    for flag in ("batch_size", "max_gen_toks", "tp", "pp", "ep"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UsageError("--tasks names no task")
    try:
        from megalite.generation.lm_eval_adapter import MegaliteLM, evaluate_tasks
    except ImportError as e:
        raise UsageError(str(e)) from None
    args.prompt_ids = False  # the tokenizer is needed (generate's --prompt-ids makes it optional)
    try:
        model, tokenizer = loaded_stage(args, minutes=30)
        lm = MegaliteLM([model], tokenizer, batch_size=args.batch_size, max_gen_toks=args.max_gen_toks,
                        add_bos_token=args.add_bos_token, seed=args.seed, shard_over_data_parallel=True)
        results = evaluate_tasks(lm, tasks, args.include_path, args.limit, args.num_fewshot, args.seed,
                                 args.apply_chat_template)
    except (ValueError, FileNotFoundError, TokenizerError) as e:
        raise UsageError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    if dist.get_rank() == 0:
        from lm_eval.utils import make_table

        print(make_table(results), flush=True)
        if args.output_path:
            kept = {k: results[k] for k in ("results", "versions", "n-shot", "higher_is_better", "config")
                    if k in results}
            Path(args.output_path).write_text(json.dumps(kept, indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    from megalite.runtime import run_main

    return run_main(_run, _parser().parse_args(argv))


if __name__ == "__main__":
    from megalite.runtime import exit_process

    exit_process(main())
