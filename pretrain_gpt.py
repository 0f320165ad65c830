"""Pretrain a GPT with tensor, pipeline and data parallelism.

    torchrun --standalone --nproc_per_node 4 pretrain_gpt.py --tp 2 --pp 2

With no --data-path it trains on the embedded corpus (the Python standard library's sources,
tokenized once into a cache); --mock-data uses a synthetic token stream.
"""
import sys

from megalite import arguments
from megalite.data import build_gpt_datasets, resolve_data
from megalite.data.synthetic import SyntheticTokens
from megalite.models import GPTModel
from megalite.runtime import UsageError, run_main
from megalite.training import Task, gpt_forward_step, pretrain


def prepare(args):
    resolve_data(args, kind="gpt")


def build_model(config, args, device, pre_process=True, post_process=True, layer_numbers=None):
    return GPTModel(config, pre_process, post_process, layer_numbers, seed=args.seed, device=device)


def build_data(config, args):
    if args.mock_data:
        return (SyntheticTokens(config.vocab_size, args.seq_length, seed=args.seed),
                SyntheticTokens(config.vocab_size, args.seq_length, seed=args.seed + 1))
    valid_samples = args.eval_iters * args.global_batch_size if args.eval_interval else 0
    try:
        # Ids are checked against the model's vocabulary; a rank waits for another building a cache
        # no longer than for a collective.
        train, valid, _ = build_gpt_datasets(args.data_path, args.split, args.seq_length,
                                             (args.train_iters * args.global_batch_size, valid_samples, 0), args.seed,
                                             vocab_size=config.vocab_size,
                                             lock_timeout=args.distributed_timeout_minutes * 60)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if train is None:
        raise UsageError(f"--split {args.split} leaves no training documents")
    return train, valid


def task() -> Task:
    return Task(build_model, build_data, gpt_forward_step, prepare)


def main(argv=None) -> int:
    args = arguments.build_parser("Pretrain a GPT with megalite.", default_model="gpt-tiny").parse_args(argv)
    return run_main(pretrain, args, task())


if __name__ == "__main__":
    sys.exit(main())
