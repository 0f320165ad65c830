"""Pretrain a GPT with tensor, pipeline and data parallelism.

    torchrun --standalone --nproc_per_node 4 pretrain_gpt.py --tp 2
"""
import sys

from megalite import arguments
from megalite.data.synthetic import SyntheticTokens
from megalite.models import GPTModel
from megalite.runtime import run_main
from megalite.training import Task, gpt_forward_step, pretrain


def build_model(config, args, device, pre_process=True, post_process=True, layer_numbers=None):
    return GPTModel(config, pre_process, post_process, layer_numbers, seed=args.seed, device=device)


def build_data(config, args):
    return SyntheticTokens(config.vocab_size, args.seq_length, seed=args.seed)


def task() -> Task:
    return Task(build_model, build_data, gpt_forward_step)


def main(argv=None) -> int:
    args = arguments.build_parser("Pretrain a GPT with megalite.", default_model="gpt-tiny").parse_args(argv)
    return run_main(pretrain, args, task())


if __name__ == "__main__":
    sys.exit(main())
