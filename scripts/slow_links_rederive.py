"""A suite's figures worked out again from a --json that scripts/slow_links.py saved: the same
derivation and report with this checkout's code (the planner's predictions above all), from the
runs' recorded step times, bytes and links. No root, no runs.

    python scripts/slow_links_rederive.py hidden.json [--exchange-latency-ms 3.8] [--link-burst-kib 0] [--json out.json]

Several saved runs of the hidden suite are pooled: per dimension the planner's prediction against
the mean of the runs' measured exposure, beside each run's own ratio. One run's exposure is the
difference of two steps of a few seconds, and on a shared machine it scatters by as much as the
20% the planner is held to (docs/slow-links.md (f)); the mean of n runs scatters sqrt(n) times less.

    python scripts/slow_links_rederive.py a.json b.json c.json [--link-burst-kib 30]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests")]
from slow_links import RunResult, RunSpec, table  # noqa: E402  (beside this file)
from slow_links_suites import derive, report  # noqa: E402


# suites whose derivation reads only the runs, the links and the common flags (diloco's reads its
# own flags; planner's the solo run's world)
DERIVED = ("hidden", "pairs", "moe", "overlap", "bf16")


def _rate(key: str) -> float | None:
    return None if key == "None" else float(key)


def load(path: str) -> tuple[dict[str, RunResult], dict]:
    """The saved runs (spec and rounds) and links (rate -> figures) of a slow_links.py --json."""
    saved = json.loads(Path(path).read_text())
    results = {name: RunResult(RunSpec(name, r["flags"], r["hosts"], r["nproc"], r["rate_mbit"]), r["rounds"],
                               r["error"])
               for name, r in saved["runs"].items()}
    return results, {_rate(k): v for k, v in saved["links"].items()}


def rederived(a, path: str) -> tuple[dict, dict, dict]:
    """(saved, runs, derived) of one --json, worked out again with `a`'s overrides."""
    try:
        saved = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: not a saved run of scripts/slow_links.py --json ({e})") from None
    if saved.get("suite") not in DERIVED:
        raise SystemExit(f"{path}: suite {saved.get('suite')!r}: only {', '.join(DERIVED)} are derived from what a "
                         "--json holds (run the others again)")
    a.suite, a.common_flags = saved["suite"], saved["common"]
    a.saved_derived = saved.get("derived", {})  # what the run measured besides its rounds (no probe now)
    results, links = load(path)
    return saved, results, derive(a, results, links)


def pooled(derived_runs: list[dict]) -> list[dict]:
    """Per dimension measured and predicted in every run: the mean measured exposure and its standard
    error, the mean prediction, their ratio, each run's ratio and how many are within 20%."""
    out = []
    dims = {d for derived in derived_runs for d in derived.get("dimensions", {})}
    for dim in sorted(dims):
        rows = [r["dimensions"][dim] for r in derived_runs if "predicted_exposed_ms" in r["dimensions"].get(dim, {})
                and r["dimensions"][dim].get("exposed_ms")]
        if not rows:
            continue
        measured = [r["exposed_ms"] for r in rows]
        predicted = [r["predicted_exposed_ms"] for r in rows]
        ratios = [p / m for p, m in zip(predicted, measured)]
        se = statistics.stdev(measured) / len(measured) ** 0.5 if len(measured) > 1 else None
        out.append({"dimension": dim, "runs": len(rows), "measured_ms": statistics.mean(measured),
                    "measured_se_ms": se, "predicted_ms": statistics.mean(predicted),
                    "predicted_over_measured": statistics.mean(predicted) / statistics.mean(measured),
                    "per_run": ratios, "within_20": sum(0.8 <= r <= 1.2 for r in ratios)})
        waited = [r["waited_ms"] for r in rows if "waited_ms" in r]
        if waited:  # the timeline's waits (slow_links_waits), in the runs that recorded them
            with_waits = [r["predicted_exposed_ms"] for r in rows if "waited_ms" in r]
            mean = statistics.mean(waited)
            out[-1].update(waited_runs=len(waited), waited_ms=mean,
                           predicted_over_waited=statistics.mean(with_waits) / mean if mean > 0 else None)
            both = [(r["waited_ms"], r["comm_ms"]) for r in rows if "waited_ms" in r and r.get("comm_ms")]
            if both:  # 1 - waited / communication time, pooled
                out[-1]["hidden_by_waits"] = 1 - sum(w for w, _ in both) / sum(c for _, c in both)
    return out


def pooled_report(rows: list[dict]) -> str:
    lines = ["| dimension | runs | measured exposed ms (mean ± s.e.) | predicted ms (mean) | predicted / measured, "
             "pooled | per run | runs within 20% | waited ms (runs) | predicted / waited | hidden by the waits |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        se = f" ± {r['measured_se_ms']:.0f}" if r["measured_se_ms"] is not None else ""
        waited = f"{r['waited_ms']:.0f} ({r['waited_runs']})" if "waited_ms" in r else "-"
        over = f"{r['predicted_over_waited']:.2f}" if r.get("predicted_over_waited") is not None else "-"
        hidden = f"{100 * r['hidden_by_waits']:.0f}%" if r.get("hidden_by_waits") is not None else "-"
        lines.append(f"| {r['dimension']} | {r['runs']} | {r['measured_ms']:.0f}{se} | {r['predicted_ms']:.0f} | "
                     f"{r['predicted_over_measured']:.2f} | {', '.join(f'{x:.2f}' for x in r['per_run'])} | "
                     f"{r['within_20']} of {r['runs']} | {waited} | {over} | {hidden} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("saved", nargs="+", help="a --json written by scripts/slow_links.py with --suite (several: "
                                             "the hidden suite's runs pooled)")
    ap.add_argument("--exchange-latency-ms", type=float, default=None,
                    help="hidden suite: the planner's per-exchange latency (default: each link's, as measured)")
    ap.add_argument("--link-burst-kib", type=float, default=None,
                    help="hidden suite: the planner's tbf bucket of the limited links (default: the one measured "
                         "before the runs; a --json without it: the configured 2 ms of the rate; 0: none)")
    ap.add_argument("--json", default=None, help="write the saved results with the new derivation here (one run), "
                                                 "or the pooled figures (several)")
    a = ap.parse_args(argv)
    if len(a.saved) > 1:
        runs = [rederived(a, path) for path in a.saved]
        if any(saved["suite"] != "hidden" for saved, _, _ in runs):
            ap.error("only runs of the hidden suite are pooled")
        rows = pooled([derived for _, _, derived in runs])
        print(pooled_report(rows))
        if a.json:
            Path(a.json).write_text(json.dumps({"runs": a.saved, "pooled": rows}, indent=2) + "\n")
        return 0
    saved, results, derived = rederived(a, a.saved[0])
    print(table(results))
    print(report(a, derived) or json.dumps(derived, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps({**saved, "derived": derived}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
