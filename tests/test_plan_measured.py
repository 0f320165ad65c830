"""The planner's predictions against real measurements: the hidden suite's runs of 2026-12-06
(docs/runs/2026-12-06/, scripts/slow_links.py --json on the two-core development machine, pinned,
300 Mbit/s tc-tbf), derived again with this checkout's planner and pooled (slow_links_rederive.py):
the day's ep runs, the whole suite four times, dp, zero3 and tp four times with the reference runs
the planner's compute is fitted to (slow_links_predict.reference_run), and dp and zero3 three times
with every rank's waits on the timeline (slow_links_waits), and tp twice with them; the whole suite
three times with the waits read per rank. One run's measured exposure scatters by about 29% there, so the checks are on the mean of the runs (docs/slow-links.md (f), "Twelve rounds a run,
and the runs pooled" and "The whole suite four times, pooled"). A change to the planner that moves
these predictions, toward the measurements or away from them, fails here."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from cli import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import slow_links_rederive  # noqa: E402

DAY = ROOT / "docs" / "runs" / "2026-12-06"
RUNS = sorted(DAY.glob("ep-*.json"))
SUITE = sorted(DAY.glob("suite-*.json"))  # the whole hidden suite, each run with its measured bucket
REFERENCED = sorted(DAY.glob("ref-*.json"))  # dp, zero3 and tp (four pieces) with their reference runs


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
    # tp in four pieces too (0.88), since each exchange is played behind its own linear's GEMM
    # (tp_linears.py; 0.37 behind the average linear's: the output projection's pieces were hidden)
    for dim in ("ep", "cp", "tp"):
        assert 0.8 <= rows[dim]["predicted_over_measured"] <= 1.2, rows[dim]


def test_tp_is_within_20_percent_fitted_to_its_reference_or_its_bare_step_and_dp_and_zero3_do_not_move():
    rows = _pooled_rows(REFERENCED, None)
    assert len(REFERENCED) == 4 and set(rows) == {"dp", "zero3", "tp"}
    assert all(row["runs"] == 4 for row in rows.values())
    # the same runs fitted to their bare steps (the reference runs left out)
    a = argparse.Namespace(exchange_latency_ms=None, link_burst_kib=None)
    bare_fit = []
    for path in REFERENCED:
        saved = json.loads(path.read_text())
        a.suite, a.common_flags = saved["suite"], saved["common"]  # (what rederived sets, without deriving)
        a.saved_derived = saved.get("derived", {})
        results, links = slow_links_rederive.load(str(path))
        results = {name: r for name, r in results.items() if not name.endswith("-ref")}
        bare_fit.append(slow_links_rederive.derive(a, results, links))
    fitted = {r["dimension"]: r for r in slow_links_rederive.pooled(bare_fit)}
    # tp in four pieces, each exchange behind its own linear's GEMM (tp_linears.py): 1.13 fitted to
    # its one-piece run, 1.02 to its own bare step (which takes the pieces' own 790-921 ms a step for
    # GEMM time that covers transfers); behind the average linear it was 0.78 and 0.44
    # (docs/slow-links.md (f), "Reference runs", "Each exchange behind its own linear")
    assert 0.8 <= fitted["tp"]["predicted_over_measured"] < rows["tp"]["predicted_over_measured"] <= 1.2, \
        (fitted["tp"], rows["tp"])
    # dp's and ZeRO-3's predictions do not depend on the fit (every bucket but the last ones is
    # covered at either rate): dp within 20%, ZeRO-3 under (0.74)
    for dim in ("dp", "zero3"):
        assert fitted[dim]["predicted_over_measured"] == pytest.approx(rows[dim]["predicted_over_measured"], rel=0.02)
    assert 0.8 <= rows["dp"]["predicted_over_measured"] <= 1.2, rows["dp"]
    assert 0.6 <= rows["zero3"]["predicted_over_measured"] < 0.8, rows["zero3"]


WAITED = sorted(DAY.glob("every-*.json"))  # dp and zero3 with their timelines: every rank's waits
TP_WAITED = sorted(DAY.glob("tpw-*.json"))  # tp in four pieces with its timeline and its reference run


def test_the_planner_is_within_20_percent_of_what_the_ranks_waited_for_dp_zero3_and_tp_exchanges():
    """Three runs of dp and ZeRO-3 whose timelines hold each wait of every rank (slow_links_waits):
    the waits, each the least any rank had at it, are steady from run to run where the step's
    difference is not (dp's was -18 to 50 ms), and the planner is within 20% of them; ZeRO-3's step
    difference is larger by the compute that ran longer beside its transfers (docs/slow-links.md (f),
    "The waits on the timeline"). The same for tp in four pieces, two runs with its reference."""
    rows = _pooled_rows(WAITED, None)
    assert len(WAITED) == 3 and set(rows) == {"dp", "zero3"}
    for dim, row in rows.items():
        assert row["waited_runs"] == 3, dim
        assert 0.8 <= row["predicted_over_waited"] <= 1.2, (dim, row)
    a = argparse.Namespace(exchange_latency_ms=None, link_burst_kib=None)
    per_run = [slow_links_rederive.rederived(a, str(p))[2]["dimensions"] for p in WAITED]
    for dim in ("dp", "zero3"):
        waited = [d[dim]["waited_ms"] for d in per_run]
        assert max(waited) / min(waited) < 1.1, (dim, waited)  # the steps' differences: 10x apart for dp
        assert all(d[dim]["waited_by"] == "every rank, per exchange" for d in per_run)
    assert rows["zero3"]["predicted_over_measured"] < 0.8 < rows["zero3"]["predicted_over_waited"]

    # tp in four pieces: its waits 791 ms a step in both runs; the planner 1.12 of them
    rows = _pooled_rows(TP_WAITED, None)
    assert len(TP_WAITED) == 2 and rows["tp"]["waited_runs"] == 2
    assert 0.8 <= rows["tp"]["predicted_over_waited"] <= 1.2 and 0.8 <= rows["tp"]["predicted_over_measured"] <= 1.2
    waited = [slow_links_rederive.rederived(a, str(p))[2]["dimensions"]["tp"]["waited_ms"] for p in TP_WAITED]
    assert max(waited) / min(waited) < 1.05, waited


BLOCKS = sorted(DAY.glob("blocks-*.json")) + sorted(DAY.glob("phases-*.json"))  # cp with its blocks probed


def test_cp_with_its_attention_blocks_measured_against_its_waits():
    """Five runs of ep and cp whose suites probed cp's attention blocks (`attention_block_ms`): with
    them the planner's cp is 1.11 of the ranks' waits (0.93-1.31 per run), where with the blocks at
    the layer's average rate it is over 1.5 in every run; ep, which has no ring, does not move
    (docs/slow-links.md (f), "cp's attention blocks, measured")."""
    rows = _pooled_rows(BLOCKS, None)
    assert len(BLOCKS) == 5 and rows["cp"]["waited_runs"] == 5
    assert rows["cp"]["predicted_over_waited"] == pytest.approx(1.11, abs=0.01)
    a = argparse.Namespace(exchange_latency_ms=None, link_burst_kib=None)
    measured = [slow_links_rederive.rederived(a, str(p))[2]["dimensions"] for p in BLOCKS]
    assert all(0.9 <= d["cp"]["predicted_over_waited"] <= 1.35 for d in measured)
    assert all(30 < d["cp"]["attention_block_ms"][0] < 70 for d in measured)
    flops = []  # the same runs with the blocks at the layer's average rate (no probe figure)
    for path in BLOCKS:
        saved = json.loads(path.read_text())
        a.suite, a.common_flags, a.saved_derived = saved["suite"], saved["common"], {}
        flops.append(slow_links_rederive.derive(a, *slow_links_rederive.load(str(path)))["dimensions"])
    assert all(d["cp"]["predicted_over_waited"] > 1.5 for d in flops)
    assert [d["ep"]["predicted_exposed_ms"] for d in flops] == pytest.approx([d["ep"]["predicted_exposed_ms"]
                                                                             for d in measured])


LEAST = sorted(DAY.glob("least-*.json"))  # the whole suite, each dimension's waits read per rank


def test_every_dimension_is_within_20_percent_of_the_waits_of_the_rank_that_waited_least():
    """The whole suite three times with the waits read as the total of the rank that waited least
    (slow_links_waits.waited_by_least_rank_ms): pooled, the planner is within 20% of them for dp,
    ZeRO-3, ep, cp and tp, and each clears its bar of the issue (80% hidden for dp, ZeRO-3 and ep, 60%
    for cp and tp). The waits matched exchange by exchange, the reading before, are lower where a rank
    waits hundreds of times a step (ep, cp, tp) and the same where it waits once (dp)
    (docs/slow-links.md (f), "The waits read per rank")."""
    rows = _pooled_rows(LEAST, None)
    assert len(LEAST) == 3
    bars = {"dp": 0.8, "zero3": 0.8, "ep": 0.8, "cp": 0.6, "tp": 0.6}
    for dim, bar in bars.items():
        assert rows[dim]["waited_runs"] == 3, dim
        assert 0.8 <= rows[dim]["predicted_over_waited"] <= 1.2, (dim, rows[dim])
        assert rows[dim]["hidden_by_waits"] >= bar, (dim, rows[dim])
    a = argparse.Namespace(exchange_latency_ms=None, link_burst_kib=None)
    per_run = [slow_links_rederive.rederived(a, str(p))[2]["dimensions"] for p in LEAST]
    for d in per_run:
        assert all(d[dim]["waited_by"] == "the rank that waited least" for dim in bars)
        assert d["dp"]["waited_per_exchange_ms"] == pytest.approx(d["dp"]["waited_ms"], rel=0.02)
        assert all(d[dim]["waited_per_exchange_ms"] < 0.9 * d[dim]["waited_ms"] for dim in ("ep", "cp", "tp"))


PP_LEAST = sorted((ROOT / "docs" / "runs" / "2026-12-07").glob("ppleast-*.json"))  # pp's waits read per rank


@pytest.mark.parametrize("layout,micro_batches,warmup", [("a", 16, 1), ("b", 8, 0), ("c", 8, 1)])
def test_pp_is_within_20_percent_of_the_waits_of_the_stage_that_waited_least(layout, micro_batches, warmup):
    """pp's waits drawn apart from the exchanges' posting ("p2p-wait") and the wait at the gradient
    norm's reduction ("norm-wait"), read as the total of the rank that waited least: the last stage.
    Three layouts three times each: (a) the suite's, 16 micro-batches of 1 MiB activations with
    --pipeline-extra-warmup 1; (b) 8 of 2 MiB without it, where the last stage receives each
    activation at the exchange point before the forward that reads it and waits out its whole
    transfer (gloo moves bytes only to a posted receive), which the planner plays since
    (pipeline_play.receives_posted); (c) b with one forward ahead. Pooled, the planner is within 20%
    of each, and a and c clear the issue's 60% (docs/slow-links.md (f), "pp's waits read per rank")."""
    paths = [p for p in PP_LEAST if p.name.startswith(f"ppleast-{layout}-")]
    assert len(paths) == 3
    row = _pooled_rows(paths, None)["pp"]
    assert row["waited_runs"] == 3 and 0.8 <= row["predicted_over_waited"] <= 1.2, row
    if warmup:
        assert row["hidden_by_waits"] >= 0.6, row
    else:
        assert row["hidden_by_waits"] < 0.1, row  # each activation's transfer waited out whole
    a = argparse.Namespace(exchange_latency_ms=None, link_burst_kib=None)
    for p in paths:
        pp = slow_links_rederive.rederived(a, str(p))[2]["dimensions"]["pp"]
        assert pp["waited_by"] == "the rank that waited least" and "waited_per_exchange_ms" not in pp
        flags = " ".join(json.loads(p.read_text())["runs"]["pp-across"]["flags"])
        assert f"--global-batch-size {8 * micro_batches}" in flags
        assert ("--pipeline-extra-warmup 1" in flags) == bool(warmup)
    # the runs saved before the waits were drawn apart keep their reading: rank 0's "p2p" spans
    old = slow_links_rederive.rederived(a, str(DAY / "ppw-1705-3r.json"))[2]["dimensions"]["pp"]
    assert old["waited_by"] == "rank 0"


def test_the_whole_suite_with_pp_read_per_rank_is_within_20_percent_in_every_dimension():
    """The whole suite once more with pp's waits read per rank (least-0123-3r.json, after the pp runs
    above): every dimension's waits are the total of the rank that waited least, the planner is within
    20% of them in all six, and each clears its bar of the issue by them (docs/slow-links.md (f), "pp's
    waits read per rank")."""
    (path,) = sorted((ROOT / "docs" / "runs" / "2026-12-07").glob("least-*.json"))
    a = argparse.Namespace(exchange_latency_ms=None, link_burst_kib=None)
    dims = slow_links_rederive.rederived(a, str(path))[2]["dimensions"]
    bars = {"dp": 0.8, "zero3": 0.8, "ep": 0.8, "pp": 0.6, "cp": 0.6, "tp": 0.6}
    for dim, bar in bars.items():
        row = dims[dim]
        assert row["waited_by"] == "the rank that waited least", dim
        assert 0.8 <= row["predicted_over_waited"] <= 1.2 and row["hidden_by_waits"] >= bar, (dim, row)
