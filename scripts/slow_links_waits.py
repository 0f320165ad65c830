"""The hidden suite's second reading of exposed communication, where a dimension's waits are on the
timeline (scripts/slow_links.py --suite hidden): how long the ranks waited for the dimension's
exchanges, across the link less on the bare veths.

The reading is the total a rank waited in a step, on the rank whose total was least: every rank's step
is its compute plus its waits (one lane computes at a time), and the steps end together, so the rank
that waited least is the one with the most compute, and its waits are what communication added to the
step beyond compute (`waited_by_least_rank_ms`). A wait counted exchange by exchange, the least any
rank had at each (`waited_by_all_ms`), reads less: where compute varies between ranks, at one exchange
rank 0 has the more compute before its wait and at the next rank 1, and the least of the two each time
drops what each rank really waited (scripts/gloo_exchanges.py --chain: ranks whose compute pieces vary
by +/- 2 ms around a 4 ms exchange; the link adds 50-55 ms to the step, the least totals read 53-58,
the waits matched exchange by exchange 31-34). Runs saved before the totals were recorded keep that
reading.

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
# waits for its sends and receives ("p2p-wait"; their posting, "p2p", is the host's work) and the
# wait for the gradient norm's reduction ("norm-wait"), where the last stage, done with its passes,
# waits out the first stage's last backward and the gradient that goes to it (the schedule's drain).
# The stage with the most compute waits least: the first activation to reach it and the drain.
WAIT_KINDS = {"dp": ("grad-reduce",), "zero3": ("zero-wait", "zero-reduce-wait"), "tp": ("sp-wait", "tp-wait"),
              "ep": ("ep-wait", "grad-reduce"), "cp": ("cp-wait", "grad-reduce"), "pp": ("p2p-wait", "norm-wait")}
# Not matched exchange by exchange (slow_links.waited_by_all_ms): the ranks hold different stages,
# so their k-th receives are different exchanges.
NOT_PER_EXCHANGE = {"pp"}
# Runs saved before the executor drew its waits apart: every "p2p" span, posting with waits, rank 0's.
SAVED_BEFORE = {"pp": ("p2p",)}


# a round's figures, by preference
SOURCES = {"waited_least_rank_ms": "the rank that waited least", "waited_by_all_ms": "every rank, per exchange",
           "spans_ms": "rank 0"}
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


def _passes(spans: list[dict]) -> dict[tuple[int, int], list]:
    """Each rank's passes per iteration (1-based): {(iteration, rank): [(start, end, "forward"|"backward")]}."""
    out: dict[tuple[int, int], list] = {}
    for e in spans:
        if e["cat"] in ("forward", "backward"):
            out.setdefault((e["args"]["iteration"] + 1, e["pid"]), []).append((e["ts"], e["ts"] + e["dur"], e["cat"]))
    return out


def _phase(name: str, start: float, passes: list) -> str:
    """PHASES' phase of a wait that starts at `start` on a rank whose passes are `passes`."""
    if name.endswith("lane)"):
        return "pairs"
    inside = [p for p in passes if p[0] <= start < p[1]]
    return f"{inside[0][2]}s alone" if inside else "after"


def waited_by_least_rank_ms(trace) -> dict[int, dict[str, float]]:
    """Per recorded iteration (1-based) and dimension of WAIT_KINDS: the total
    each rank waited in the dimension's kinds of span, the least over the ranks that ran passes in the
    iteration ("<dim>"), and that rank's total by phase ("<dim>/<phase>", as `waited_by_phase_ms`'s on
    its own timeline). A dimension whose kinds are on no rank is left out."""
    spans = trace_spans(trace)
    passes = _passes(spans)
    ranks: dict[int, set] = {}
    for it, rank in passes:
        ranks.setdefault(it, set()).add(rank)
    totals: dict[tuple[int, str], dict[int, dict[str, float]]] = {}  # (it, dim) -> rank -> phase -> ms
    for e in spans:
        it = e["args"]["iteration"] + 1
        for dim, kinds in WAIT_KINDS.items():
            if e["cat"] not in kinds:
                continue
            phase = _phase(e.get("name", ""), e["ts"], passes.get((it, e["pid"]), []))
            of_rank = totals.setdefault((it, dim), {}).setdefault(e["pid"], {})
            of_rank[phase] = of_rank.get(phase, 0.0) + e["dur"] / 1e3
    out: dict[int, dict[str, float]] = {}
    for (it, dim), of_ranks in totals.items():
        least = min(ranks.get(it, set()) | set(of_ranks), key=lambda r: sum(of_ranks.get(r, {}).values()))
        mine = of_ranks.get(least, {})
        out.setdefault(it, {})[dim] = sum(mine.values())
        out[it].update({f"{dim}/{phase}": ms for phase, ms in mine.items()})
    return out


def waited_by_phase_ms(trace) -> dict[int, dict[str, float]]:
    """Per recorded iteration (1-based): the waits matched across ranks (`matched_spans`, as
    slow_links.waited_by_all_ms: the least any rank had at each) summed by "<kind>/<phase>", the
    phase where the wait falls on rank 0's timeline: "pairs" (a lane's wait inside an overlapped
    pair), "forwards alone" and "backwards alone" (inside a forward or backward pass outside a pair),
    or "after" (the rest: the reduction after the last backward). A name whose count of spans
    differs between ranks is left out."""
    spans = trace_spans(trace)
    passes = _passes(spans)
    out: dict[int, dict[str, float]] = {}
    for it, kind, name, start, ms in matched_spans(spans)[0]:
        if not (kind.endswith("-wait") or kind == "grad-reduce"):
            continue
        phase = _phase(name, start, passes.get((it, 0), []))
        out.setdefault(it, {})[f"{kind}/{phase}"] = out.get(it, {}).get(f"{kind}/{phase}", 0.0) + ms
    return out


def add_waits(row: dict, dim: str, across, bare) -> None:
    """Into `row` (hidden_overlap's, per dimension): "waited_across_ms", "waited_bare_ms" and
    "waited_ms", their difference: the ms a steady iteration of each best round waits in the
    dimension's kinds of span, read (SOURCES, "waited_by") as the total of the rank that waited least
    (`waited_by_least_rank_ms`), or where a --json was saved before that was recorded each wait the
    least any rank had at it (slow_links.waited_by_all_ms; not for NOT_PER_EXCHANGE) or rank 0's (of
    SAVED_BEFORE's kinds, where a run has none of today's). "waited_phases_ms": the same by phase;
    "waited_per_exchange_ms": the per-exchange reading beside the totals', where both are there.
    Nothing where either run recorded no timeline."""
    kinds, rounds = WAIT_KINDS.get(dim), (across.best_round(), bare.best_round())
    if kinds is None or None in rounds:
        return
    if dim in SAVED_BEFORE and not any(k in r.get("spans_ms", {}) for r in rounds for k in kinds):
        kinds = SAVED_BEFORE[dim]
    per_exchange = dim not in NOT_PER_EXCHANGE
    sources = [k for k in SOURCES if per_exchange or k != "waited_by_all_ms"]
    key = next((k for k in sources if all(k in r and _waited(r[k], k, dim, kinds) is not None for r in rounds)), None)
    if key is None:
        return
    a, b = (_waited(r[key], key, dim, kinds) for r in rounds)
    row.update(waited_across_ms=a, waited_bare_ms=b, waited_ms=a - b, waited_by=SOURCES[key])
    if key == "waited_least_rank_ms":
        across, bare = (r[key] for r in rounds)
        row["waited_phases_ms"] = {phase: across.get(f"{dim}/{phase}", 0.0) - bare.get(f"{dim}/{phase}", 0.0)
                                   for phase in PHASES}
        if per_exchange and all("waited_by_all_ms" in r for r in rounds):
            a, b = (_waited(r["waited_by_all_ms"], "waited_by_all_ms", dim, kinds) for r in rounds)
            row["waited_per_exchange_ms"] = a - b
    elif key == "waited_by_all_ms" and all("waited_phases_ms" in r for r in rounds):
        across, bare = (r["waited_phases_ms"] for r in rounds)
        row["waited_phases_ms"] = {phase: sum(across.get(f"{k}/{phase}", 0.0) - bare.get(f"{k}/{phase}", 0.0)
                                              for k in kinds) for phase in PHASES}


def _waited(figures: dict, key: str, dim: str, kinds) -> float | None:
    """A round's ms of `dim`'s waits in the SOURCES figures `key`: per dimension for the least rank's
    totals (None where the dimension is not among them), per kind of span summed otherwise."""
    if key == "waited_least_rank_ms":
        return figures.get(dim)
    return sum(figures.get(k, 0.0) for k in kinds)


def waits_lines(derived: dict) -> list[str]:
    """The report's line for each dimension with waits: the waits' share of the exposure, the share
    of its communication hidden by the waits (1 - waited / communication time, beside the overlap
    line's by the steps), and the planner against them."""
    out = []
    for dim, row in derived.get("dimensions", {}).items():
        if "waited_ms" not in row or "exposed_ms" not in row:
            continue
        per_exchange = (f"; {row['waited_per_exchange_ms']:.0f} read exchange by exchange"
                        if "waited_per_exchange_ms" in row else "")
        line = (f"{dim}: waited {row['waited_ms']:.0f} ms for its exchanges ({row['waited_across_ms']:.0f} across, "
                f"{row['waited_bare_ms']:.0f} bare; {row['waited_by']}; timeline: {', '.join(WAIT_KINDS[dim])}"
                f"{per_exchange}); "
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
