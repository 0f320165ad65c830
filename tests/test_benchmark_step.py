"""scripts/benchmark_step.py on its smoke shapes (--quick): for each family both sides train, hold the
same number of parameters, and the summary is what the printed rounds say; the JSON is the result;
llama with the Hugging Face model's weights loaded into megalite starts from the same loss. The
measured ratios come from the same script at its full shapes (docs/BENCHMARKS.md)."""
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "benchmark_step.py"

# Every run in one process: the imports (torch, transformers, megalite) are most of the time.
DRIVER = """
import contextlib, importlib.util, io, json, sys
spec = importlib.util.spec_from_file_location("benchmark_step", sys.argv[1])
module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
spec.loader.exec_module(module)
runs = {}
for name, argv in json.loads(sys.argv[2]).items():
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = module.main(argv)
    runs[name] = {"stdout": printed.getvalue(), "result": json.loads(json.dumps(result))}
print(json.dumps(runs))
"""

FAMILIES = ("gpt", "llama", "bert")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("benchmark_step")
    argv = {f: ["--family", f, "--quick", "--rounds", "3", "--json", str(tmp / f"{f}.json")] for f in FAMILIES}
    argv["gpt"] += ["--profile", "--profile-steps", "1", "--top", "5"]
    argv["llama-same-weights"] = ["--family", "llama", "--quick", "--same-weights", "--rounds", "1"]
    # The script starts a one-rank process group of its own: not a rendezvous this environment names.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-c", DRIVER, str(SCRIPT), json.dumps(argv)], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for f in FAMILIES:
        out[f]["json"] = json.loads((tmp / f"{f}.json").read_text())
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_both_sides_train_the_same_number_of_parameters(runs, family):
    run = runs[family]
    result = run["result"]
    assert result["family"] == family and result["quick"] and not result["compile"]
    assert result["params"]["megalite"] == result["params"]["plain"] > 0
    assert f"{result['params']['megalite']:,} parameters each" in run["stdout"]
    for row in result["per_round"]:
        assert row["megalite_ms"] > 0 and row["plain_ms"] > 0
    assert all(0 < loss < 20 for loss in result["first_loss"].values())
    if family not in ("llama", "moe"):  # megalite pads the vocabulary; the plain side is built over the padded size
        assert result["padded_vocab"] > result["shape"]["vocab"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_ratio_is_the_median_of_the_printed_round_ratios(runs, family):
    run, result = runs[family], runs[family]["result"]
    printed = [(order.replace(" ", ""), float(a), float(b), float(r)) for order, a, b, r in re.findall(
        r"^round +\d+ \(([AB ]+)\): megalite ([\d.]+) ms, plain ([\d.]+) ms, ratio ([\d.]+)$", run["stdout"], re.M)]
    rows = result["per_round"]
    assert len(printed) == len(rows) == result["rounds"] == 3
    assert [p[0] for p in printed] == ["ABBA", "BAAB", "ABBA"] == [row["order"] for row in rows]
    for (_, a, b, ratio), row in zip(printed, rows):
        assert (a, b, ratio) == (round(row["megalite_ms"], 3), round(row["plain_ms"], 3), round(row["ratio"], 4))
        assert row["ratio"] == pytest.approx(row["megalite_ms"] / row["plain_ms"])
    assert result["ratio_median"] == statistics.median(row["ratio"] for row in rows)
    assert (result["ratio_min"], result["ratio_max"]) == (min(r["ratio"] for r in rows), max(r["ratio"] for r in rows))
    assert result["megalite_ms"] == statistics.median(row["megalite_ms"] for row in rows)
    assert result["plain_ms"] == statistics.median(row["plain_ms"] for row in rows)
    assert f"median {result['ratio_median']:.4f} (range" in run["stdout"]
    assert result["markdown"] in run["stdout"].splitlines()
    assert f"| {result['ratio_median']:.3f} |" in result["markdown"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_json_file_is_the_result(runs, family):
    run = runs[family]
    assert run["json"] == run["result"]
    for key in ("torch", "transformers", "date", "device", "git"):
        assert run["json"][key]
    assert "one thread" in run["json"]["device"]


def test_profile_lists_operators_of_both_sides(runs):
    run = runs["gpt"]
    assert "top 5 operators by self CPU time" in run["stdout"]
    profile = run["result"]["profile"]
    for side in ("megalite", "plain"):
        ms, calls = profile[side]["aten::mm"]
        assert ms > 0 and calls > 0


def test_llama_with_the_same_weights_starts_from_the_same_loss(runs):
    first = runs["llama-same-weights"]["result"]["first_loss"]
    assert first["megalite"] == pytest.approx(first["plain"], abs=1e-5)
