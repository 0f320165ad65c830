"""Activation recomputation (full: uniform or block; selective: the attention core) replays the
same operations on the same inputs and dropout masks: losses, gradient norms and weights are
bitwise those without it."""
import pytest

from megalite.testing import run_ranks
from test_sequence_parallel import BASE, assert_same_runs
from training_ranks import train_params

RECOMPUTE = [
    ["--recompute", "full"],
    ["--recompute", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
    ["--recompute", "full", "--recompute-method", "block", "--recompute-num-layers", "3"],
    ["--recompute", "selective"],
    ["--recompute", "selective", "--attention-backend", "torch"],
]


@pytest.mark.parametrize("flags", RECOMPUTE, ids=lambda f: "-".join(x.strip("-") for x in f[1::2]))
def test_recomputation_replays_the_same_numbers(flags):
    argv = BASE + ["--tp", "2", "--sequence-parallel"]
    if "torch" in flags:
        argv += ["--attention-backend", "torch"]
        flags = flags[:2]
    plain = run_ranks(train_params, 2, args=(argv,))
    recomputed = run_ranks(train_params, 2, args=(argv + flags,))
    assert_same_runs(recomputed, plain, 0.0)  # the same operations on the same inputs and dropout masks: bitwise
