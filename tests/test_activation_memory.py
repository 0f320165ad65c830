"""The activation-memory formula and its measurement; the attention backends agree. Sequence
parallelism's and recomputation's equality tests live in test_sequence_parallel.py and
test_recompute.py."""
import importlib.util
from pathlib import Path

import pytest
import torch

from megalite.models import activation_bytes_per_layer
from megalite.testing import run_ranks
from test_sequence_parallel import BASE, assert_same_runs
from training_ranks import train_params

ROOT = Path(__file__).resolve().parents[1]


def test_attention_backends_agree():
    argv = BASE[:-4] + ["--hidden-dropout", "0", "--attention-dropout", "0"]
    sdpa = run_ranks(train_params, 1, args=(argv,))
    explicit = run_ranks(train_params, 1, args=(argv + ["--attention-backend", "torch"],))
    assert_same_runs(explicit, sdpa, 1e-5, params=False)


def test_formula_terms():
    s, b, h, a = 2048, 4, 4096, 32
    sbh = s * b * h
    assert activation_bytes_per_layer(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert activation_bytes_per_layer(s, b, h, a, t=8) == sbh * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert activation_bytes_per_layer(s, b, h, a, t=8, sequence_parallel=True) == sbh * (34 + 5 * a * s / h) / 8
    assert activation_bytes_per_layer(s, b, h, a, t=8, sequence_parallel=True, recompute="selective") == 34 * sbh / 8
    assert activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * sbh
    with pytest.raises(ValueError):
        activation_bytes_per_layer(s, b, h, a, recompute="most")


def test_measured_activation_bytes_follow_the_formula_on_cpu():
    spec = importlib.util.spec_from_file_location("activation_memory", ROOT / "scripts" / "activation_memory.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    cpu = torch.device("cpu")
    s, b, h, a = 256, 2, 256, 4
    measured = {m: script.measure(s, b, h, a, m, cpu) for m in ("none", "selective", "full")}
    formula = {m: activation_bytes_per_layer(s, b, h, a, recompute=m) for m in measured}
    for m in measured:
        assert 0.9 <= measured[m] / formula[m] <= 1.25, (m, measured[m], formula[m])
    saved = measured["none"] - measured["selective"]
    assert saved >= 0.7 * (formula["none"] - formula["selective"])
