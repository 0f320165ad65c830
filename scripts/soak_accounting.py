"""What a fault soak (scripts/soak.py) proves, from what its runs left behind: the sample log
(`--sample-log`), the metrics files and the final checkpoints. Knows nothing of the faults
themselves except, per run, which fault made the job start it."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megalite import checkpoint
from megalite.checkpoint.fileformat import RankFile
from megalite.training.sample_log import lineage


@dataclass
class RunClocks:
    """One run's clocks from the sample log: when it began each iteration and finished each step."""
    begun: dict[int, float] = field(default_factory=dict)
    done: dict[int, float] = field(default_factory=dict)
    resumed: int = 0


def run_clocks(samples: Path) -> dict[str, RunClocks]:
    runs: dict[str, RunClocks] = {}
    for path in sorted(samples.glob("samples-rank*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:  # cut short by a crash
                continue
            c = runs.setdefault(r["run"], RunClocks())
            if "iteration" in r:
                c.begun.setdefault(r["iteration"], r["t"])
            elif "done" in r:
                c.done[r["done"]] = r["t"]
            elif "resumed" in r:
                c.resumed = r["resumed"]
    return {run: c for run, c in runs.items() if c.begun}


def runs_in_order(samples: Path) -> list[str]:
    """The runs that began an iteration, in the order they started."""
    runs = run_clocks(samples)
    return sorted(runs, key=lambda run: min(runs[run].begun.values()))


def time_lost(samples: Path, cause: dict[str, str]) -> tuple[dict[str, list[tuple[float, int]]], float]:
    """Per start after the first, keyed by the fault that made the job start it (`cause`):
    (seconds lost, iterations recomputed); and the median seconds of an iteration. A start that
    resumes at iteration r after a run whose last finished step was d recomputes d - r iterations;
    it lost the time from that step's end to its own first step's end, less the steps it moved on
    (or plus those it does again)."""
    runs = run_clocks(samples)
    order = runs_in_order(samples)
    steps = [t2 - t1 for c in runs.values() for (i1, t1), (i2, t2) in zip(sorted(c.done.items()),
                                                                         sorted(c.done.items())[1:]) if i2 == i1 + 1]
    tau = sorted(steps)[len(steps) // 2] if steps else 0.0
    lost: dict[str, list[tuple[float, int]]] = {}
    for x, y in zip(order, order[1:]):
        cx, cy = runs[x], runs[y]
        if not cx.done or not cy.done:
            continue  # a run that finished no step: its cost is counted with the next pair
        d_x, d_y = max(cx.done), min(cy.done)
        seconds = cy.done[d_y] - cx.done[d_x] - (d_y - d_x) * tau
        lost.setdefault(cause.get(y, "?"), []).append((seconds, max(d_x - cy.resumed, 0)))
    return lost, tau


def losses(root: Path, pattern: str) -> dict[int, list[float]]:
    """Every train loss logged at each iteration by the metrics files matching `pattern`."""
    out: dict[int, list[float]] = {}
    for path in sorted(root.glob(pattern)):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r.get("split", "train") == "train" and "loss" in r:
                out.setdefault(r["iteration"], []).append(r["loss"])
    return out


def final_state_gap(a: Path, b: Path, same_layout: bool) -> float:
    """Largest difference between two checkpoints: every tensor of every rank file (model,
    optimizer, RNG streams...) when they were saved at one layout, else the model weights."""
    if same_layout:
        gap = 0.0
        for fa in sorted(a.glob("rank_*.safetensors")):
            ra, rb = RankFile(fa), RankFile(b / fa.name)
            if set(ra.keys()) != set(rb.keys()):
                return float("inf")
            for key in ra.keys():
                x, y = ra.tensor(key), rb.tensor(key)
                if not torch.equal(x, y):
                    gap = max(gap, float((x.double() - y.double()).abs().max()) if x.is_floating_point() else 1.0)
        return gap
    _, _, sa = checkpoint.load_full_state_dict(a)
    _, _, sb = checkpoint.load_full_state_dict(b)
    return max(float((sa[k].double() - sb[k].double()).abs().max()) for k in sb)


def account(root: Path, save: Path, reference: Path, iters: int, samples_per_iteration: int, bitwise: bool,
            cause: dict[str, str]) -> dict:
    """The track's figures, and whether it kept its promise: every sample once, and losses (and
    with `bitwise` the whole end state) equal to the reference's (else within 1e-5)."""
    want = {i: v[0] for i, v in losses(root, "reference-metrics.jsonl").items()}
    got = losses(root, "metrics-*.jsonl")
    gaps = [abs(v - want[i]) / max(abs(want[i]), 1e-30) for i, vs in got.items() for v in vs]
    final_run = checkpoint.CheckpointReader(save).metadata.get("run")
    held = lineage(root / "samples", final_run, iters)
    lost, repeated = held.counts(range(iters * samples_per_iteration))
    lost_by_kind, tau = time_lost(root / "samples", cause)
    every = [x for v in lost_by_kind.values() for x in v]
    name = f"iter_{iters:07d}"
    state_gap = final_state_gap(save / name, reference / name, bitwise)
    final_gap = abs(got[iters][-1] - want[iters]) / abs(want[iters])
    ok = lost == 0 and repeated == 0 and not held.missing and (
        max(gaps) == 0 and state_gap == 0 if bitwise else max(gaps) <= 1e-5)
    return {"lost": lost, "repeated": repeated, "missing_iterations": len(held.missing),
            "runs_in_lineage": len(held.runs), "final_loss_gap": final_gap, "max_loss_gap": max(gaps),
            "losses_compared": len(gaps), "final_state_gap": state_gap, "bitwise_expected": bitwise, "ok": ok,
            "mean_seconds_lost": sum(s for s, _ in every) / max(len(every), 1),
            "mean_iterations_recomputed": sum(i for _, i in every) / max(len(every), 1),
            "seconds_per_iteration": tau,
            "lost_by_kind": {k: {"restarts": len(v), "mean_seconds": sum(s for s, _ in v) / len(v),
                                 "mean_iterations": sum(i for _, i in v) / len(v)} for k, v in lost_by_kind.items()}}
