"""Rank functions that run the real training loop inside `run_ranks` (no torchrun needed)."""
from __future__ import annotations

import torch

from megalite import arguments, parallel
from megalite.training import pretrain

import pretrain_gpt


def parse(argv):
    return arguments.build_parser("test", default_model="gpt-tiny").parse_args(argv)


def gpt_run(argv):
    return pretrain(parse(argv), pretrain_gpt.task())


def train_losses(rank, world, argv):
    return [r["loss"] for r in gpt_run(argv).records]


def train_and_check_tied_embeddings(rank, world, argv):
    """Losses, plus whether the first and last stage still hold the same word embedding."""
    run = gpt_run(argv)
    emb = [c.word_embeddings.weight.detach() for c in run.model_chunks if hasattr(c, "word_embeddings")]
    same = None
    group = parallel.get_embedding_group()
    if emb and group is not None and parallel.get_pipeline_model_parallel_world_size() > 1:
        w = emb[0].clone()
        other = w.clone()
        torch.distributed.all_reduce(other, group=group)  # first + last
        same = torch.equal(other, 2 * w)
    return [r["loss"] for r in run.records], same
