"""scripts/benchmark_moe_layer.py on its smoke shapes (--quick): the plain MoE it times computes the
same outputs as megalite's layer (checked by the script before timing), both comparisons run, and
the summary is the median of the rounds it prints. The measured ratios come from the same script
at its full shapes (docs/BENCHMARKS.md)."""
import json
import re
import statistics
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "benchmark_moe_layer.py"


def _bench():
    sys.path.insert(0, str(ROOT / "scripts"))
    import benchmark_moe_layer

    return benchmark_moe_layer


@pytest.mark.parametrize("compare, names", [("layer", ("megalite", "plain")), ("grouped", ("grouped", "loop"))])
def test_the_quick_run_times_both_sides_and_reports_the_median_of_its_rounds(tmp_path, capsys, compare, names):
    # In this process (the script's main, as its command line calls it): a launch would import torch anew.
    out = tmp_path / "result.json"
    threads = torch.get_num_threads()
    try:
        returned = _bench().main(["--quick", "--compare", compare, "--json", str(out)])
    finally:
        torch.set_num_threads(threads)  # the script times on one thread
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert returned == result
    rounds = [float(r) for r in re.findall(r"ratio (\d+\.\d+)\n", printed)]
    assert len(rounds) == 2 and (result["a"], result["b"]) == names
    assert result["ratio_median"] == pytest.approx(statistics.median(rounds), rel=1e-3)
    assert result["a_ms"] > 0 and result["b_ms"] > 0


def test_the_plain_moe_equals_megalites_layer_in_outputs_and_gradients():
    bench = _bench()
    layer = bench.megalite_layer(32, 4, 32, 2).train()
    plain = bench.PlainMoE(layer.router.weight, layer.experts.fc1_weight, layer.experts.fc2_weight, 2)
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(0))
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = layer(xa), plain(xb)
    grad = torch.randn(ya.shape, generator=torch.Generator().manual_seed(1))
    ya.backward(grad)
    yb.backward(grad)
    assert torch.allclose(ya, yb, rtol=1e-5, atol=1e-6)
    assert torch.allclose(xa.grad, xb.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(layer.experts.fc1_weight.grad, plain.fc1.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(layer.experts.fc2_weight.grad, plain.fc2.grad, rtol=1e-5, atol=1e-6)
