"""scripts/benchmark_schedules.py: its smoke run, and the activation memory each schedule holds per
stage (saved-tensor hooks) against the formula: 1F1B (p - r) micro-batches on stage r, ZB-H1 p on
every stage at most, with stage 0 at 1F1B's peak exactly, ZB-V 2p chunks (p micro-batches of a
whole stage) on every stage at most, DualPipeV 2p + 1."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megalite.testing import run_ranks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # the ranks import the script's rank function by name

import benchmark_schedules  # noqa: E402


def test_peak_activation_memory_per_stage_follows_the_formula():
    model = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--vocab-size", "128"]
    ranks = run_ranks(benchmark_schedules.memory_rank, 2, args=(model, ("1f1b", "zb-h1", "zb-v", "dualpipev")))
    for r, got in enumerate(ranks):
        one_f_one_b, zb, v, dpv = got["1f1b"], got["zb-h1"], got["zb-v"], got["dualpipev"]
        assert one_f_one_b["in_flight"] == 2 - r and zb["in_flight"] == 2 and v["in_flight"] == 4  # chunks of half
        assert dpv["in_flight"] == 5 and dpv["peak"] <= 1.02 * dpv["in_flight"] * dpv["micro_batch"], r  # 2p + 1
        assert abs(one_f_one_b["peak"] / (one_f_one_b["in_flight"] * one_f_one_b["micro_batch"]) - 1) < 0.02, r
        assert zb["peak"] <= 1.02 * zb["in_flight"] * zb["micro_batch"], r
        assert v["peak"] <= 1.02 * v["in_flight"] * v["micro_batch"], r
        assert v["peak"] <= ranks[0]["1f1b"]["peak"] * 1.2, r  # ZB-V: about 1F1B's first-stage peak, every stage
    assert ranks[0]["zb-h1"]["peak"] == ranks[0]["1f1b"]["peak"]  # W right after B on stage 0: 1F1B's
    assert ranks[1]["zb-h1"]["peak"] > ranks[1]["1f1b"]["peak"]  # the last stage holds its W's back
    assert ranks[1]["zb-h1"]["peak"] <= ranks[0]["1f1b"]["peak"] * 1.2  # about 1F1B's first-stage peak


@pytest.mark.slow
def test_smoke_run_prints_every_schedule_and_writes_json(tmp_path):
    out = tmp_path / "schedules.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark_schedules.py"), "--quick", "--json",
                           str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "zb-h1" in proc.stdout and "zb-v" in proc.stdout and "predicted" in proc.stdout
    rows = json.loads(out.read_text())["schedules"]
    assert set(rows) == {"1f1b", "zb-h1", "zb-v", "zb-v*", "dualpipev"}
    assert rows["zb-h1"]["costs_ms"]["W"] > 0 and rows["1f1b"]["costs_ms"]["W"] == 0
    assert rows["zb-h1"]["predicted"] < rows["1f1b"]["predicted"]
    assert rows["zb-v"]["costs_ms"]["W"] > 0 and rows["zb-v"]["predicted"] < rows["1f1b"]["predicted"]
