"""Megatron-LM's --data-parallel-random-init: each data-parallel rank's runtime random streams
(dropout) seeded seed + 10 x its DP rank, the weights still every replica's alike; without dropout
nothing changes."""
from __future__ import annotations

import pytest
import torch

from megalite.testing import run_ranks
from training_ranks import gpt_run, parse, several

BASE = ["--train-iters", "2", "--global-batch-size", "8", "--micro-batch-size", "2", "--log-interval", "1",
        "--eval-iters", "0"]


def _run(rank, world, argv):
    from megalite import parallel
    from megalite.parallel.random import get_rng_tracker

    run = gpt_run(argv)
    first = next(iter(run.model_chunks[0].parameters())).detach().clone()
    return ([r["loss"] for r in run.records], torch.get_rng_state(), get_rng_tracker().get_states(),
            parallel.get_data_parallel_rank(), first)


@pytest.mark.slow
def test_each_data_parallel_rank_draws_its_own_dropout_and_starts_from_the_same_weights():
    dropout = ["--hidden-dropout", "0.1"]
    runs = [BASE + dropout, BASE + dropout + ["--data-parallel-random-init"], BASE,
            BASE + ["--data-parallel-random-init"]]
    per_rank = run_ranks(several, 4, args=(_run, [r + ["--tp", "2"] for r in runs]))  # dp 2 of tp 2
    (plain, apart, no_dropout, no_dropout_apart) = zip(*per_rank)  # each: that run on every rank
    assert plain[0][0] != apart[0][0]  # the masks differ, so the losses
    assert no_dropout[0][0] == no_dropout_apart[0][0]  # without dropout nothing changes
    for run, seeded_apart in ((plain, False), (apart, True)):
        by_dp = {}
        for losses, cpu, tracker, dp_rank, _ in run:
            by_dp.setdefault(dp_rank, []).append(cpu)
        same = torch.equal(by_dp[0][0], by_dp[1][0])
        assert same != seeded_apart, seeded_apart  # the streams differ between DP ranks only with the flag
        assert all(torch.equal(s, group[0]) for group in by_dp.values() for s in group)  # TP ranks alike
    # the weights a replica starts from do not depend on the flag (one step on, still the replicas' alike)
    assert all(torch.equal(a[4], b[4]) for a, b in zip(no_dropout, no_dropout_apart))


def test_the_flag_is_megalites_own_and_noted_on_resume():
    from megalite.training.resume_policy import NOTED, POLICY

    assert parse(["--data-parallel-random-init"]).training.data_parallel_random_init
    assert POLICY["data_parallel_random_init"] == NOTED
