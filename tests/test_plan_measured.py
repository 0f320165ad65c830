"""The planner's predictions against real measurements: the hidden suite's runs of 2026-12-06
(docs/runs/2026-12-06/, scripts/slow_links.py --json on the two-core development machine, pinned,
300 Mbit/s tc-tbf), derived again with this checkout's planner and pooled (slow_links_rederive.py):
the day's ep runs, and the whole suite four times. One run's measured exposure scatters by about
29% there, so the checks are on the mean of the runs (docs/slow-links.md (f), "Twelve rounds a run,
and the runs pooled" and "The whole suite four times, pooled"). A change to the planner that moves
these predictions, toward the measurements or away from them, fails here."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from cli import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import slow_links_rederive  # noqa: E402

DAY = ROOT / "docs" / "runs" / "2026-12-06"
RUNS = sorted(DAY.glob("ep-*.json"))
SUITE = sorted(DAY.glob("suite-*.json"))  # the whole hidden suite, each run with its measured bucket


def _pooled_rows(paths: list[Path], burst_kib: float | None) -> dict[str, dict]:
    """Per dimension the pooled row of these saved runs, with this checkout's planner (burst_kib None:
    each run's measured bucket)."""
    a = argparse.Namespace(exchange_latency_ms=None, link_burst_kib=burst_kib)
    rows = slow_links_rederive.pooled([slow_links_rederive.rederived(a, str(p))[2] for p in paths])
    return {r["dimension"]: r for r in rows}


def _pooled(paths: list[Path], burst_kib: float | None) -> dict:
    (row,) = _pooled_rows(paths, burst_kib).values()  # ep runs: one dimension
    return row


def test_the_ep_prediction_is_within_20_percent_of_the_days_mean_measured_exposure():
    suite = [p for p in RUNS if "-flag-" not in p.name]
    assert len(suite) == 13
    row = _pooled(suite, 30.0)  # the bucket probe's mean of the day (20-41 kB)
    assert row["runs"] == 13 and row["measured_ms"] == pytest.approx(293.4, abs=0.5)
    assert 0.8 <= row["predicted_over_measured"] <= 1.2, row
    # the four twelve-round runs with the bucket each measured before it (27-36 kB)
    twelve = [p for p in suite if p.name.endswith("-12r.json")]
    row = _pooled(twelve, None)
    assert row["runs"] == 4 and 0.8 <= row["predicted_over_measured"] <= 1.2, row
    # without the bucket the planner was over (the link's burst crosses at once after compute)
    assert _pooled(suite, 0.0)["predicted_over_measured"] > 1.2
    # with --delay-wgrad-compute it is low in four runs of five (0.49-0.81; 1.49 the fifth): the play
    # lends weight-gradient work to every wait, the run less of it (docs/slow-links.md (f))
    flag = [p for p in RUNS if "-flag-" in p.name]
    row = _pooled(flag, 30.0)
    assert len(flag) == 5 and 0.6 <= row["predicted_over_measured"] < 0.8, row


def test_the_whole_suite_pooled_per_dimension():
    rows = _pooled_rows(SUITE, None)
    assert len(SUITE) == 4 and set(rows) == {"dp", "zero3", "ep", "pp", "cp", "tp"}
    assert all(r["runs"] == 4 for r in rows.values())
    for dim in ("ep", "cp"):
        assert 0.8 <= rows[dim]["predicted_over_measured"] <= 1.2, rows[dim]
    # the gap as found: the planner takes the four pieces' own cost on the bare link (64-row GEMMs,
    # four times the messages) for GEMM time that covers transfers; at one piece it is 0.91
    # (docs/slow-links.md (f)). When it learns the difference, this moves, and the docs with it.
    assert rows["tp"]["predicted_over_measured"] < 0.6, rows["tp"]
