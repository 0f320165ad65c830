"""scripts/benchmark_gpt.py's own logic on tiny CPU shapes: every implementation timed, the formula's
TFLOP/s and MFU consistent, and the training log's MFU read back for the same run. The H100 figures
come from the same script (docs/BENCHMARKS.md)."""
import importlib.util
import json
from pathlib import Path

import pytest

from megalite.metrics import gpt_flops_per_iteration
from megalite.models import preset

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("benchmark_gpt", ROOT / "scripts" / "benchmark_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_in_rank(rank, world, out):
    return _script().main(["--device", "cpu", "--quick", "--variants", "eager", "--json", out])


def test_benchmark_reports_plain_and_megalite_and_the_log_mfu(tmp_path):
    from megalite.testing import run_ranks
    out = tmp_path / "gpt.json"
    results = run_ranks(_run_in_rank, 1, args=(str(out),), timeout=300)[0]
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    runs = {r["implementation"]: r for r in results["runs"]}
    assert set(runs) == {"plain eager", "megalite eager"}
    c = preset("gpt-tiny")
    flops = gpt_flops_per_iteration(2, 64, c.num_layers, c.hidden_size, c.vocab_size)
    for r in runs.values():
        assert r["tflops"] == pytest.approx(flops / (r["ms_per_step"] * 1e-3) / 1e12)
        assert r["mfu_datasheet"] == pytest.approx(r["tflops"] / results["datasheet_tflops"])
        assert r["tokens_per_sec"] == pytest.approx(2 * 64 / (r["ms_per_step"] * 1e-3))
    logged = runs["megalite eager"]["log_mfu"]
    assert 0 < logged < 1, "the training log's MFU must be read back"
    assert runs["megalite eager"]["log_mfu_difference_points"] == pytest.approx(
        100 * (logged - runs["megalite eager"]["mfu_datasheet"]))


def _validate_in_rank(rank, world, out):
    spec = importlib.util.spec_from_file_location("validate_planner", ROOT / "scripts" / "validate_planner.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(["--device", "cpu", "--quick", "--json", out])


def test_planner_validation_compares_the_planners_figures_with_measured_steps(tmp_path):
    from megalite.testing import run_ranks
    from megalite.tools import plan
    results = run_ranks(_validate_in_rank, 1, args=(str(tmp_path / "p.json"),), timeout=300)[0]
    assert [r["recompute"] for r in results["rows"]] == ["none", "selective", "full"]
    for r in results["rows"]:
        config = preset("gpt-tiny", recompute=r["recompute"], hidden_dropout=0.0, attention_dropout=0.0)
        _, pred = plan.check_layout(config, micro_batch_size=2, global_batch_size=4, seq_length=64,
                                    recompute=r["recompute"], dtype="bf16", gpu_memory_bytes=80 * 2 ** 30)
        assert r["predicted_ms"] == pytest.approx(pred.step_time * 1e3)
        assert r["predicted_bytes"] == pytest.approx(pred.peak_bytes - pred.memory.overhead)
        assert r["measured_ms"] > 0 and r["time_error"] == pytest.approx(r["predicted_ms"] / r["measured_ms"] - 1)
    assert json.loads((tmp_path / "p.json").read_text())["rows"] == json.loads(json.dumps(results["rows"]))


def test_model_flops_of_a_gpt2_shape_are_megatrons_formula_and_grow_and_shrink_with_the_architecture():
    from megalite.metrics import model_flops_per_iteration

    c = preset("gpt2-350m")
    B, s = 8, 1024
    expected = gpt_flops_per_iteration(B, s, c.num_layers, c.hidden_size, c.vocab_size)
    assert model_flops_per_iteration(c, B, s) == pytest.approx(expected, rel=1e-12)
    h, f, L, a = c.hidden_size, c.ffn_hidden_size, c.num_layers, c.num_attention_heads
    # Grouped-query attention with G groups: the key/value matmuls shrink from 2h^2 to 2h^2*G/a.
    gqa = c.replace(num_query_groups=4)
    assert expected - model_flops_per_iteration(gqa, B, s) == pytest.approx(
        3 * L * 2 * s * B * 2 * h * h * (1 - 4 / a), rel=1e-12)
    # A gated MLP has three ffn-wide matmuls instead of two.
    gated = c.replace(gated_linear_unit=True, activation="silu")
    assert model_flops_per_iteration(gated, B, s) - expected == pytest.approx(3 * L * 2 * s * B * h * f, rel=1e-12)
    # Untied output weights and no biases cost the same matmuls.
    assert model_flops_per_iteration(c.replace(untie_embeddings_and_output_weights=True, add_bias_linear=False),
                                     B, s) == model_flops_per_iteration(c, B, s)
