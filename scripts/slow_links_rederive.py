"""A suite's figures worked out again from a --json that scripts/slow_links.py saved: the same
derivation and report with this checkout's code (the planner's predictions above all), from the
runs' recorded step times, bytes and links. No root, no runs.

    python scripts/slow_links_rederive.py hidden.json [--exchange-latency-ms 3.8] [--link-burst-kib 0] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("saved", help="a --json written by scripts/slow_links.py with --suite")
    ap.add_argument("--exchange-latency-ms", type=float, default=None,
                    help="hidden suite: the planner's per-exchange latency (default: each link's, as measured)")
    ap.add_argument("--link-burst-kib", type=float, default=None,
                    help="hidden suite: the planner's tbf bucket of the limited links (default: the one measured "
                         "before the runs; a --json without it: the configured 2 ms of the rate; 0: none)")
    ap.add_argument("--json", default=None, help="write the saved results with the new derivation here")
    a = ap.parse_args(argv)
    saved = json.loads(Path(a.saved).read_text())
    if saved.get("suite") not in DERIVED:
        ap.error(f"{a.saved}: suite {saved.get('suite')!r}: only {', '.join(DERIVED)} are derived from what a "
                 "--json holds (run the others again)")
    a.suite, a.common_flags = saved["suite"], saved["common"]
    results, links = load(a.saved)
    derived = derive(a, results, links)
    print(table(results))
    print(report(a, derived) or json.dumps(derived, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps({**saved, "derived": derived}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
