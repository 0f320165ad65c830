"""Pretrain a GPT with tensor, pipeline and data parallelism.

    torchrun --standalone --nproc_per_node 4 pretrain_gpt.py --tp 2 --pp 2

With no --data-path it trains on the embedded corpus (the Python standard library's sources,
tokenized once into a cache); --mock-data uses a synthetic token stream.
"""
import sys

from megalite import arguments
from megalite.data import build_gpt_datasets, resolve_data, train_valid_datasets
from megalite.data.synthetic import SyntheticTokens
from megalite.models import GPTModel
from megalite.runtime import run_main
from megalite.training import Task, gpt_forward_step, pretrain


def prepare(args):
    resolve_data(args, kind="gpt")


def build_model(config, args, device, pre_process=True, post_process=True, layer_numbers=None):
    return GPTModel(config, pre_process, post_process, layer_numbers, seed=args.seed, device=device)


def build_data(config, args):
    def datasets(samples, lock_timeout):  # token ids are checked against the model's vocabulary
        return build_gpt_datasets(args.data_path, args.split, args.seq_length, samples, args.seed,
                                  vocab_size=config.vocab_size, lock_timeout=lock_timeout)

    return train_valid_datasets(args, config.vocab_size, SyntheticTokens, datasets)


def task() -> Task:
    return Task(build_model, build_data, gpt_forward_step, prepare)


def main(argv=None) -> int:
    args = arguments.build_parser("Pretrain a GPT with megalite.", default_model="gpt-tiny").parse_args(argv)
    return run_main(pretrain, args, task())


if __name__ == "__main__":
    sys.exit(main())
