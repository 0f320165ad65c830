"""GPU checks, run on a CUDA machine with `python -m pytest -m gpu` (deselected by default).
Each has a CPU counterpart in the regular suite."""
import importlib.util
from pathlib import Path

import pytest
import torch

from megalite.models import activation_bytes_per_layer

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _need_cuda():
    if not torch.cuda.is_available():
        pytest.fail("GPU tests need CUDA: run them on the GPU machine, or leave out -m gpu")


def test_selective_recompute_saves_at_least_70_percent_of_the_formula_on_gpu():
    """CPU counterpart: tests/test_activation_memory.py::test_measured_activation_bytes_follow_the_formula_on_cpu"""
    spec = importlib.util.spec_from_file_location("activation_memory", ROOT / "scripts" / "activation_memory.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    dev = torch.device("cuda")
    for s, b, h, a in [(1024, 8, 1024, 16), (2048, 4, 2048, 16)]:
        none, selective = (script.measure(s, b, h, a, m, dev) for m in ("none", "selective"))
        predicted = activation_bytes_per_layer(s, b, h, a) - activation_bytes_per_layer(s, b, h, a, recompute="selective")
        assert none - selective >= 0.7 * predicted
