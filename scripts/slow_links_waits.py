"""The hidden suite's second reading of exposed communication, where a dimension's waits are on the
timeline (scripts/slow_links.py --suite hidden): how long the ranks waited for the dimension's
exchanges, across the link less on the bare veths. Each wait is the least any rank had at it (the rank
that came last to the exchange waited for the transfer alone; one that came early, for the other
rank as well: on two shared cores one rank's core is slowed by other work now and then).

The step's difference (hidden_overlap's "exposed_ms") is what the link adds to a step; the waits are
what of it is communication the compute waited for. The rest is compute that ran longer across the
link: on this 2-core host a transfer's packets are handled on the ranks' own cores (docs/slow-links.md
(f), "Compute beside a transfer"). The planner predicts the waits; the suite prints both ratios.
"""
from __future__ import annotations

import json
from pathlib import Path

# Per dimension the timeline's kinds of span that are waits for its exchanges (summed per steady
# iteration). dp: the wait for the gradients' reduction after backward; ZeRO-3: the waits for
# its units' gathers and for its gradients' reduce-scatters (the end of each backward's among them).
# tp: the waits for its collectives (megalite.parallel.lanes: "sp" with sequence parallelism, its
# pieces with --tp-comm-overlap; "tp" the all-reduces); ep and cp: their exchanges' (in overlapped
# pairs each lane names its waits apart: slow_links.waited_by_all_ms matches them lane by lane), and
# the data-parallel reduction their runs make as well (the dense layers' over ep's ranks, every
# gradient's over cp's), which the planner's prediction of the run holds too. pp: the executor's
# sends and receives ("p2p"), rank 0's own (RANK_ZERO): the ranks hold different stages, so their
# k-th receives are different exchanges, and the first stage's are what the step's end waits on (its
# last backward waits for the last gradient); a receive also waits out the other stage's compute
# (the schedule's bubble), which the bare run's waits hold as well.
WAIT_KINDS = {"dp": ("grad-reduce",), "zero3": ("zero-wait", "zero-reduce-wait"), "tp": ("sp-wait", "tp-wait"),
              "ep": ("ep-wait", "grad-reduce"), "cp": ("cp-wait", "grad-reduce"), "pp": ("p2p",)}
RANK_ZERO = {"pp"}  # read off rank 0's timeline, not matched across ranks


SOURCES = {"waited_by_all_ms": "every rank", "spans_ms": "rank 0"}  # a round's figures, by preference
PHASES = ("forwards alone", "pairs", "backwards alone", "after")  # the planner's Exposure.phases, and the rest


def trace_spans(trace) -> list[dict]:
    """The complete spans ("X") of a --timeline trace that belong to an iteration: read from `trace`
    (a path), or `trace` itself where it is such a list already (read once, used by every reading)."""
    if isinstance(trace, list):
        return trace
    return [e for e in json.loads(Path(trace).read_text())["traceEvents"]
            if e.get("ph") == "X" and "iteration" in e.get("args", {})]


def matched_spans(spans: list[dict]) -> tuple[list[tuple], set]:
    """Each span matched across ranks: the k-th of its name and kind in its iteration on every rank
    (an overlapped pair's two lanes name their waits apart, megalite.parallel.lanes, since each
    lane's come in one order on every rank and the two lanes' interleave as timing falls). Returns
    ([(iteration (1-based), kind, name, rank 0's start, the least ms any rank spent in it)], the
    (iteration, kind, name) whose count of spans differs between ranks, left out)."""
    per: dict[tuple[int, str, str], dict[int, list]] = {}
    for e in spans:
        key = (e["args"]["iteration"] + 1, e["cat"], e.get("name", ""))
        per.setdefault(key, {}).setdefault(e["pid"], []).append((e["ts"], e["dur"]))
    ranks = sorted({r for of_rank in per.values() for r in of_rank})
    matched, unmatched = [], set()
    for (it, kind, name), of_rank in per.items():
        by_rank = [sorted(of_rank.get(r, [])) for r in ranks]
        if len({len(v) for v in by_rank}) != 1:
            unmatched.add((it, kind, name))
            continue
        matched += [(it, kind, name, by_rank[0][k][0], min(v[k][1] for v in by_rank) / 1e3)
                    for k in range(len(by_rank[0]))]
    return matched, unmatched


def waited_by_phase_ms(trace) -> dict[int, dict[str, float]]:
    """Per recorded iteration (1-based): the waits matched across ranks (`matched_spans`, as
    slow_links.waited_by_all_ms: the least any rank had at each) summed by "<kind>/<phase>", the
    phase where the wait falls on rank 0's timeline: "pairs" (a lane's wait inside an overlapped
    pair), "forwards alone" and "backwards alone" (inside a forward or backward pass outside a pair),
    or "after" (the rest: the reduction after the last backward). A name whose count of spans
    differs between ranks is left out."""
    spans = trace_spans(trace)
    passes: dict[int, list] = {}  # rank 0's passes per iteration: (start, end, kind)
    for e in spans:
        if e["pid"] == 0 and e["cat"] in ("forward", "backward"):
            passes.setdefault(e["args"]["iteration"] + 1, []).append((e["ts"], e["ts"] + e["dur"], e["cat"]))
    out: dict[int, dict[str, float]] = {}
    for it, kind, name, start, ms in matched_spans(spans)[0]:
        if not (kind.endswith("-wait") or kind == "grad-reduce"):
            continue
        inside = [p for p in passes.get(it, []) if p[0] <= start < p[1]]
        phase = "pairs" if name.endswith("lane)") else f"{inside[0][2]}s alone" if inside else "after"
        out.setdefault(it, {})[f"{kind}/{phase}"] = out.get(it, {}).get(f"{kind}/{phase}", 0.0) + ms
    return out


def add_waits(row: dict, dim: str, across, bare) -> None:
    """Into `row` (hidden_overlap's, per dimension): "waited_across_ms", "waited_bare_ms" and
    "waited_ms", their difference: the ms a steady iteration of each best round waits in the
    dimension's kinds of span, each wait the least any rank had at it
    (slow_links.waited_by_all_ms: "waited_by" "every rank"), or rank 0's where a --json was saved
    before that was recorded, and for the dimensions of RANK_ZERO ("rank 0"). Nothing where either
    run recorded no timeline."""
    kinds, rounds = WAIT_KINDS.get(dim), (across.best_round(), bare.best_round())
    if kinds is None or None in rounds:
        return
    sources = ("spans_ms",) if dim in RANK_ZERO else SOURCES
    key = next((k for k in sources if all(k in r for r in rounds)), None)
    if key is None:
        return
    a, b = (sum(r[key].get(k, 0.0) for k in kinds) for r in rounds)
    row.update(waited_across_ms=a, waited_bare_ms=b, waited_ms=a - b, waited_by=SOURCES[key])
    if key == "waited_by_all_ms" and all("waited_phases_ms" in r for r in rounds):
        across, bare = (r["waited_phases_ms"] for r in rounds)
        row["waited_phases_ms"] = {phase: sum(across.get(f"{k}/{phase}", 0.0) - bare.get(f"{k}/{phase}", 0.0)
                                              for k in kinds) for phase in PHASES}


def waits_lines(derived: dict) -> list[str]:
    """The report's line for each dimension with waits: the waits' share of the exposure, the share
    of its communication hidden by the waits (1 - waited / communication time, beside the overlap
    line's by the steps), and the planner against them."""
    out = []
    for dim, row in derived.get("dimensions", {}).items():
        if "waited_ms" not in row or "exposed_ms" not in row:
            continue
        line = (f"{dim}: waited {row['waited_ms']:.0f} ms for its exchanges ({row['waited_across_ms']:.0f} across, "
                f"{row['waited_bare_ms']:.0f} bare; {row['waited_by']}; timeline: {', '.join(WAIT_KINDS[dim])}); "
                f"the step's difference is {row['exposed_ms'] - row['waited_ms']:+.0f} ms beyond them (compute "
                "that ran longer across the link, and the rounds' noise)")
        if row.get("hidden_by_waits") is not None:
            line += f"; {100 * row['hidden_by_waits']:.0f}% hidden by the waits"
        if row.get("predicted_over_waited") is not None:
            line += f"; predicted / waited {row['predicted_over_waited']:.2f}"
        out.append(line)
        planned = phases_planned(row, dim)
        if "waited_phases_ms" in row and planned:
            out.append(f"{dim} by phase, waited / planner ms: " + ", ".join(
                f"{phase} {row['waited_phases_ms'][phase]:.0f} / {planned[phase]:.0f}" for phase in PHASES))
    return out


def phases_planned(row: dict, dim: str) -> dict | None:
    """The planner's exposure of `dim`'s run by PHASES (across less bare): its paired program's
    phases (Exposure.phases), and "after" the data-parallel reduction the run also makes; None where
    the planner played no paired program."""
    dims = row.get("predicted", {}).get("dimensions", {})
    phases = dims.get(dim, {}).get("phases_ms")
    if not phases:
        return None
    dp = dims.get("dp") if dim != "dp" else None
    return {**phases, "after": dp["exposed_across_ms"] - dp["exposed_bare_ms"] if dp else 0.0}


def predicted_over_waited(row: dict) -> None:
    """The planner's exposure over the waits, where both are there and the waits are above noise (1 ms)."""
    if row.get("predicted_exposed_ms") is not None and row.get("waited_ms", 0.0) > 1.0:
        row["predicted_over_waited"] = row["predicted_exposed_ms"] / row["waited_ms"]
