"""The planner's ep prediction against real measurements: the hidden suite's ep runs of 2026-12-06
(docs/runs/2026-12-06/, scripts/slow_links.py --json on the two-core development machine, pinned,
300 Mbit/s tc-tbf), derived again with this checkout's planner and pooled (slow_links_rederive.py).
One run's measured exposure scatters by about 29% there, so the check is on the mean of the runs
(docs/slow-links.md (f), "Twelve rounds a run, and the runs pooled"). A change to the planner that
moves these predictions off the measurements fails here."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from cli import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import slow_links_rederive  # noqa: E402

RUNS = sorted((ROOT / "docs" / "runs" / "2026-12-06").glob("ep-*.json"))


def _pooled(paths: list[Path], burst_kib: float | None) -> dict:
    a = argparse.Namespace(exchange_latency_ms=None, link_burst_kib=burst_kib)
    (row,) = slow_links_rederive.pooled([slow_links_rederive.rederived(a, str(p))[2] for p in paths])
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
