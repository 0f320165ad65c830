"""scripts/bench_checkpoint.py at the tiny size: every figure present, the ratios are the figures'
ratios, the loads restore the state, and megalite stores fp32 masters once (no more bytes than
torch.save of the same model and optimizer state)."""
import json
import subprocess
import sys

import pytest

from cli import ROOT


def test_bench_checkpoint_tiny_reports_consistent_figures(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_checkpoint.py"), "--size", "tiny", "--repeat", "2",
                          "--json", str(out), "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())
    m, a = r["methods"], r["async"]
    assert r["repeat"] == 2
    assert set(m) == {"megalite", "torch.save", "dcp"} and set(a) == {"megalite", "dcp"}
    for fig in m.values():
        assert fig["save_s"] > 0 and fig["load_s"] > 0 and fig["bytes"] > 0
        assert fig["save_GBps"] == pytest.approx(fig["bytes"] / fig["save_s"] / 1e9)
    for other in ("torch.save", "dcp"):
        for what in ("save_s", "load_s", "bytes"):
            assert r["ratios"][f"{what}_megalite_over_{other}"] == pytest.approx(m["megalite"][what] / m[other][what])
    assert r["ratios"]["async_blocked_megalite_over_dcp"] == pytest.approx(a["megalite"]["blocked_s"] / a["dcp"]["blocked_s"])
    assert all(x["blocked_s"] <= x["total_s"] for x in a.values())
    assert r["state_unchanged_by_loads"] is True
    assert m["megalite"]["bytes"] <= 1.01 * m["torch.save"]["bytes"], "fp32 masters must not be stored twice"
    assert "megalite" in run.stdout and "ratios (megalite / other)" in run.stdout
