"""Training over slow links, measured: N network-namespace "hosts" (tests/netns.py) whose links are
limited by a token bucket (tc-tbf), a torchrun on each running pretrain_gpt.py, and each run's
--metrics-file records summed up in one table. Several named runs in one invocation, so every ratio
comes from one machine in one sitting. Needs root (network namespaces) and iproute2 (`ip`, `tc`).

    sudo python scripts/slow_links.py --hosts 2 --rate-mbit 200 \\
        --common "--mock-data --model gpt-tiny --seq-length 64 --train-iters 12" \\
        --run "alone=solo=1 rate=off --global-batch-size 8" --run "dp=--global-batch-size 16" [--json out.json]

A run is NAME=[SETTINGS ]FLAGS. SETTINGS are leading words: `hosts=N` (default --hosts; hosts=1
runs on host 0 alone), `nproc=K` (ranks per host, default --nproc-per-node), `rate=MBIT` or
`rate=off` (this run's link limit, default --rate-mbit), `solo=1` (every host runs a one-host job
of its own at the same time: compute alone, with the share of the CPU the talking runs get),
`timeline=1` (--timeline on every iteration: rank 0's time by kind of span, e.g. the wait for the
gradients' reduction, in the JSON).
FLAGS go to pretrain_gpt.py after --common. Suites are the measurements of docs/slow-links.md,
their runs and derived ratios built in (scripts/slow_links_suites.py):

    sudo python scripts/slow_links.py --suite overlap --rate-mbit 300 --repeat 3   # bf16 planner diloco moe hidden pairs

Step time is the median of `ms_per_iter` over the iterations after --warmup (robust to a spell of
other work on the machine), tokens/s the mean over them (a DiLoCo outer step counts); each from the
best of --repeat rounds (the runs interleaved round by round; other work on a shared machine only
adds time), the range over the rounds beside it. Bytes: megalite's own count (`comm_bytes` of the
metrics records, rank 0) and what the hosts' interfaces sent in the whole run (`wire`, headers and
start-up included). torchrun uses the static rendezvous at host 0 (docs/multinode.md says why not
c10d here) and GLOO_SOCKET_IFNAME=ml0.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's megalite (planner), tests/netns.py
import netns  # noqa: E402
from slow_links_probe import _env, measure_link  # noqa: E402  (beside this file)
from slow_links_suites import SUITES, derive, report, suite_runs  # noqa: E402  (beside this file)
from slow_links_waits import (  # noqa: E402  (beside this file)
    matched_spans, trace_spans, waited_by_least_rank_ms, waited_by_phase_ms)

TIMINGS = ("step_ms", "step_ms_mean", "tokens_per_s", "ms_per_iter")
PORT = 29500  # every run gets the next one: a fresh namespace has every port free, TIME_WAIT aside


@dataclass
class RunSpec:
    name: str
    flags: list[str]
    hosts: int
    nproc: int
    rate_mbit: float | None  # None: no limit
    solo: bool = False  # every host runs its own one-host job at the same time (no traffic between them)
    timeline: bool = False  # record every iteration's spans (--timeline): time by kind of work on rank 0


@dataclass
class RunResult:
    spec: RunSpec
    rounds: list[dict] = field(default_factory=list)  # one summary per round
    error: str | None = None

    def best_round(self) -> dict | None:
        """The round with the lowest median step time (other work on the machine only ever adds
        time); None where no round recorded a step."""
        rounds = [r for r in self.rounds if r.get("step_ms") is not None]
        return min(rounds, key=lambda r: r["step_ms"]) if rounds else None

    def figure(self, key: str) -> float | None:
        """Timings from the best round (best_round), anything else the median over the rounds."""
        if key in TIMINGS:
            best = self.best_round()
            return best[key] if best else None
        values = [r[key] for r in self.rounds if r.get(key) is not None]
        return statistics.median(values) if values else None

    def span(self, kind: str) -> float | None:
        """Median over the rounds of rank 0's median ms a steady iteration spends in spans of this kind."""
        values = [r["spans_ms"].get(kind, 0.0) for r in self.rounds if "spans_ms" in r]
        return statistics.median(values) if values else None

    def steps(self) -> list[float]:
        """Each round's step time (rounds that recorded one)."""
        return [r["step_ms"] for r in self.rounds if r.get("step_ms") is not None]

    def spread(self) -> str:
        steps = self.steps()
        return f"{min(steps):.0f}-{max(steps):.0f}" if len(steps) > 1 else ""

    def spread_ratio(self) -> float | None:
        """How far apart the rounds are: the slowest over the fastest, less 1 (None: one round)."""
        steps = self.steps()
        return max(steps) / min(steps) - 1 if len(steps) > 1 else None


def parse_run(text: str, default_hosts: int, default_nproc: int, default_rate: float | None) -> RunSpec:
    name, sep, rest = text.partition("=")
    if not sep or not name or any(c.isspace() for c in name):
        raise SystemExit(f"--run {text!r}: expected NAME=[hosts=N nproc=K rate=MBIT|off] FLAGS")
    words = shlex.split(rest)
    settings = {"hosts": default_hosts, "nproc": default_nproc, "rate": default_rate, "solo": 0, "timeline": 0}
    while words and words[0].split("=", 1)[0] in settings and "=" in words[0]:
        key, value = words.pop(0).split("=", 1)
        try:
            settings[key] = None if (key == "rate" and value == "off") else (float(value) if key == "rate"
                                                                              else int(value))
        except ValueError:
            raise SystemExit(f"--run {name}: {key}={value!r} is not a number") from None
    return RunSpec(name, words, settings["hosts"], settings["nproc"], settings["rate"], bool(settings["solo"]),
                   bool(settings["timeline"]))


def pretrain_flags() -> set[str]:
    """The flags this checkout's pretrain_gpt.py takes (new ones may not exist yet)."""
    run = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    if run.returncode != 0:
        raise SystemExit(f"`pretrain_gpt.py --help` failed (exit {run.returncode}): {run.stderr.strip()[-800:]}")
    return {w.strip("[],") for w in run.stdout.split() if w.startswith(("--", "[--"))}


def missing_flags(flags: list[str], known: set[str]) -> list[str]:
    return [f.split("=")[0] for f in flags if f.startswith("--") and f.split("=")[0] not in known]


def pinned_cpus(node_rank: int, nproc: int) -> str:
    """Host `node_rank`'s CPUs under --pin (a taskset list): nproc a host, in turn, round the usable ones."""
    cpus = sorted(os.sched_getaffinity(0))
    return ",".join(str(cpus[(node_rank * nproc + i) % len(cpus)]) for i in range(nproc))


def launch(net: netns.Network, spec: RunSpec, flags: list[str], workdir: Path, port: int, threads: int,
           timeout: float, pin: bool = False) -> tuple[list[dict], str | None]:
    """One torchrun per host of the run; returns rank 0's training records, then {"wire_bytes": what
    the hosts sent on their links during the run, start-up and all}, then {"valid": the last
    validation record} if there was one; and an error, if any."""
    workdir.mkdir(parents=True, exist_ok=True)
    metrics = workdir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    link = netns.LinkLimit(spec.rate_mbit) if spec.rate_mbit else None
    for h in net.hosts[:spec.hosts]:
        if h.link != link:
            h.limit(link)
    timeline = workdir / "timeline.json"
    timeline.unlink(missing_ok=True)
    if spec.timeline:
        flags = [*flags, "--timeline", str(timeline), "--timeline-iters", "1000000"]
    sent = [h.tx_bytes() for h in net.hosts[:spec.hosts]]
    procs = []
    for node_rank, host in enumerate(net.hosts[:spec.hosts]):
        if spec.solo:  # a job of its own: rendezvous on the host's loopback, metrics of host 0 kept
            own = metrics if node_rank == 0 else workdir / f"metrics-host{node_rank}.jsonl"
            where = ["--nnodes", "1", "--node_rank", "0", "--master_addr", "127.0.0.1"]
        else:
            own, where = metrics, ["--nnodes", str(spec.hosts), "--node_rank", str(node_rank), "--master_addr",
                                   net[0].addr]
        cmd = [sys.executable, "-m", "torch.distributed.run", *where, "--nproc_per_node", str(spec.nproc),
               "--master_port", str(port), str(ROOT / "pretrain_gpt.py"), *flags, "--metrics-file", str(own)]
        cmd = ["taskset", "-c", pinned_cpus(node_rank, spec.nproc), *cmd] if pin else cmd  # ranks, gloo, torchrun
        with open(workdir / f"host{node_rank}.out", "w") as out, open(workdir / f"host{node_rank}.err", "w") as err:
            procs.append(host.popen(cmd, env=_env(threads, host.ifname), stdout=out, stderr=err, cwd=workdir))
    deadline = time.monotonic() + timeout
    error = None
    for i, p in enumerate(procs):
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            error = f"did not end within {timeout:.0f} s"
            break
        if p.returncode != 0 and error is None:
            tail = (workdir / f"host{i}.err").read_text(errors="replace").strip().splitlines()[-3:]
            error = f"host{i} exited {p.returncode}: {' | '.join(tail)}"
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for h in net.hosts[:spec.hosts]:
        h.kill_all()
    wire = sum(h.tx_bytes() for h in net.hosts[:spec.hosts]) - sum(sent)
    records = read_records(metrics) if metrics.exists() else []
    valid = read_records(metrics, "valid") if metrics.exists() else []
    extra = [{"wire_bytes": wire}] + ([{"valid": valid[-1]}] if valid else [])
    if timeline.exists():
        spans = trace_spans(timeline)  # (read once: a trace holds every rank's spans of every iteration)
        extra.append({"timeline": timeline_ms(spans), "waited_by_all": waited_by_all_ms(spans),
                      "waited_phases": waited_by_phase_ms(spans), "waited_least_rank": waited_by_least_rank_ms(spans)})
    return records + extra, error


def timeline_ms(trace, rank: int = 0) -> dict[int, dict[str, float]]:
    """Milliseconds of each kind of span (forward, backward, grad-reduce: the wait for the
    gradients' reduction, optimizer, ...) in each recorded iteration (1-based) of one rank (`trace`:
    a --timeline file, or its spans read once: slow_links_waits.trace_spans)."""
    out: dict[int, dict[str, float]] = {}
    for e in trace_spans(trace):
        if e.get("pid") == rank:
            kinds = out.setdefault(e["args"]["iteration"] + 1, {})
            kinds[e["cat"]] = kinds.get(e["cat"], 0.0) + e["dur"] / 1e3
    return out


def waited_by_all_ms(trace) -> dict[int, dict[str, float]]:
    """Per recorded iteration (1-based) and kind of span: the sum over the kind's spans of the least
    time any rank spent in the matching span (slow_links_waits.matched_spans: the k-th of its name and
    kind in the iteration on each rank). Meant for waits of exchanges every rank takes part in, issued
    by every rank in one order: gloo moves an exchange's bytes once both ranks have posted it, so a
    rank that came early waits for the one that came late as well as for the transfer, and the rank
    that came last waited for the transfer alone (scripts/gloo_exchanges.py --lag-ms). A kind with a
    name whose count of spans differs between ranks is left out."""
    matched, unmatched = matched_spans(trace_spans(trace))
    left_out = {(it, kind) for it, kind, _ in unmatched}
    out: dict[int, dict[str, float]] = {}
    for it, kind, _name, _start, ms in matched:
        if (it, kind) not in left_out:
            out.setdefault(it, {})[kind] = out.get(it, {}).get(kind, 0.0) + ms
    return out


def read_records(path: Path, split: str = "train") -> list[dict]:
    """The records of a --metrics-file: training ones, or split="valid" for the validation ones."""
    return [r for r in map(json.loads, Path(path).read_text().splitlines()) if r.get("split", "train") == split]


def comm_total(record: dict) -> float | None:
    """Bytes this record's comm_bytes counts (megalite's byte accounting), all kinds together."""
    cb = record.get("comm_bytes")
    if isinstance(cb, dict):
        return float(sum(v for v in cb.values() if isinstance(v, (int, float))))
    if isinstance(cb, (int, float)):
        return float(cb)
    return None


def summarize(records: list[dict], warmup: int) -> dict:
    valid = [r["valid"] for r in records if "valid" in r]
    wire = [r["wire_bytes"] for r in records if "wire_bytes" in r]
    train = [r for r in records if "iteration" in r]
    steady = [r for r in train if r["iteration"] > warmup] or train[-1:]
    if not steady:
        return {}
    ms = [r["ms_per_iter"] for r in steady]
    tokens_per_iter = statistics.mean(r["tokens_per_sec"] * r["ms_per_iter"] / 1e3 for r in steady)
    out = {"step_ms": statistics.median(ms), "step_ms_mean": statistics.mean(ms), "steps": len(steady),
           "tokens_per_s": tokens_per_iter / (statistics.mean(ms) / 1e3), "tokens_per_iter": tokens_per_iter,
           "ms_per_iter": ms,
           "loss": train[-1]["loss"], "iterations": train[-1]["iteration"],
           # one step's loss is one batch's: the mean over the last 16 logged steps is steadier
           "loss_last16": statistics.mean(r["loss"] for r in train[-16:]),
           "valid_loss": valid[-1]["valid_loss"] if valid else None}
    for key, name in (("timeline", "spans_ms"), ("waited_by_all", "waited_by_all_ms"),
                      ("waited_phases", "waited_phases_ms"), ("waited_least_rank", "waited_least_rank_ms")):
        spans = [r[key] for r in records if key in r]
        if spans:  # median ms of each key per steady iteration (rank 0's kinds; the waits' readings)
            steady_spans = [v for it, v in spans[-1].items() if it > warmup] or list(spans[-1].values())
            kinds = sorted({k for v in steady_spans for k in v})
            out[name] = {k: statistics.median(v.get(k, 0.0) for v in steady_spans) for k in kinds}
    if wire:  # the whole job's link traffic over every token it trained (start-up and evaluation included)
        trained = sum(r["tokens_per_sec"] * r["ms_per_iter"] / 1e3 for r in train) * train[-1]["iteration"] / len(train)
        out["wire_bytes"] = wire[-1]
        out["wire_bytes_per_token"] = wire[-1] / trained
    # megalite's count (rank 0), per logged step: the mean over all of them (a local-SGD outer step
    # every H counts), per token over every token of the run
    comm = [comm_total(r) for r in train]
    if comm and all(c is not None for c in comm):
        out["comm_bytes"] = statistics.mean(comm)
        out["comm_bytes_per_token"] = out["comm_bytes"] / tokens_per_iter
        kinds: dict[str, list[float]] = {}
        for r in train:
            for k, v in (r["comm_bytes"].items() if isinstance(r["comm_bytes"], dict) else ()):
                kinds.setdefault(k, []).append(v)
        out["comm_bytes_by_kind"] = {k: sum(v) / len(train) for k, v in kinds.items()}  # kinds absent: 0
    return out


# ---- the table -------------------------------------------------------------------------------------------------------

def table(results: dict[str, RunResult]) -> str:
    head = ["run", "hosts x ranks", "link Mbit/s", "step ms", "rounds", "reduce wait ms", "tokens/s", "loss",
            "valid loss", "comm bytes/step", "comm bytes/token", "wire bytes/token"]
    rows = []
    for name, r in results.items():
        s = r.spec
        f = r.figure

        def fmt(key, spec):
            v = f(key)
            return format(v, spec) if v is not None else "-"
        where = f"{s.hosts} x {s.nproc}" + (" solo" if s.solo else "")
        rows.append([name, where, f"{s.rate_mbit:g}" if s.rate_mbit else "off",
                     fmt("step_ms", ".1f"), r.spread(),
                     "-" if r.span("grad-reduce") is None else f"{r.span('grad-reduce'):.1f}",
                     fmt("tokens_per_s", ".0f"), fmt("loss", ".4f"),
                     fmt("valid_loss", ".4f"),
                     fmt("comm_bytes", ",.0f"), fmt("comm_bytes_per_token", ",.1f"),
                     fmt("wire_bytes_per_token", ",.1f")]
                    + ([f"FAILED: {r.error}"] if r.error else []))
    widths = [max(len(str(x[i])) for x in [head, *rows] if i < len(x)) for i in range(len(head))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(x, widths)) + " |" + (f" {x[-1]}" if len(x) > len(head)
                                                                                      else "") for x in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--nproc-per-node", type=int, default=1)
    ap.add_argument("--rate-mbit", type=float, default=200.0, help="each host's link, each direction (0: no limit)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every rank")
    ap.add_argument("--pin", action="store_true", help="each host's processes on CPUs of their own (taskset)")
    ap.add_argument("--common", default="", help="pretrain_gpt.py flags of every run (before the run's own)")
    ap.add_argument("--run", action="append", default=[], metavar="NAME=[SETTINGS] FLAGS")
    ap.add_argument("--suite", choices=SUITES)
    ap.add_argument("--model", default="gpt-tiny", help="suites: the model preset")
    ap.add_argument("--hidden-size", type=int, default=None, help="suites: overrides the preset's")
    ap.add_argument("--seq-length", type=int, default=64, help="suites")
    ap.add_argument("--micro-batch-size", type=int, default=None,
                    help="suites (default: 16 for overlap, 8 for the others)")
    ap.add_argument("--iters", type=int, default=12, help="suites: --train-iters")
    ap.add_argument("--dims", default=None, help="hidden suite: the dimensions to run, e.g. zero3,tp (default: all)")
    ap.add_argument("--dim-scale", action="append", default=[], metavar="DIM=K",
                    help="hidden suite: K times the tokens a step for DIM (communication closer to compute)")
    ap.add_argument("--dim-flags", action="append", default=[], metavar="DIM=FLAGS",
                    help="hidden suite: pretrain_gpt.py flags after DIM's own, e.g. 'cp=--seq-length 4096'")
    ap.add_argument("--bucket", type=int, default=200_000, help="suites: --ddp-bucket-size (elements)")
    ap.add_argument("--interval", type=int, default=16, help="diloco suite: --local-sgd-interval")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="diloco suite")
    ap.add_argument("--outer-momentum", type=float, default=0.9, help="diloco suite")
    ap.add_argument("--exchange-latency-ms", type=float, default=None,
                    help="hidden suite: the planner's per-exchange latency (default: each link's small all-reduce)")
    ap.add_argument("--warmup", type=int, default=2, help="iterations left out of the step time")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of all runs, interleaved")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run")
    ap.add_argument("--workdir", default=None, help="logs and metrics of every run (default: a temporary dir)")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    a.probe_compute = True  # the hidden suite measures its compute probes now (slow_links_predict.attention_blocks)
    if os.geteuid() != 0:
        ap.error("network namespaces need root: run as root (sudo)")
    if a.pin and not any(os.access(os.path.join(d, "taskset"), os.X_OK) for d in os.get_exec_path()):
        ap.error("--pin runs each host under taskset, which is not installed: install util-linux or drop --pin")
    rate = a.rate_mbit or None
    common, run_texts = (suite_runs(a) if a.suite else ([], []))
    a.common_flags = [*common, *shlex.split(a.common)]
    run_texts = [*run_texts, *a.run]
    if not run_texts:
        ap.error("nothing to run: give --run NAME=FLAGS (repeatable) or --suite")
    specs = [parse_run(t, a.hosts, a.nproc_per_node, rate) for t in run_texts]
    if len({s.name for s in specs}) != len(specs):
        ap.error("two runs share a name")
    too_many = [s.name for s in specs if s.hosts > a.hosts or s.hosts < 1]
    if too_many:
        ap.error(f"runs {too_many} ask for more hosts than --hosts {a.hosts} (or fewer than 1)")
    known = pretrain_flags()
    results = {s.name: RunResult(s) for s in specs}
    for s in specs:
        absent = missing_flags([*a.common_flags, *s.flags], known)
        if absent:
            results[s.name].error = f"pretrain_gpt.py has no {', '.join(sorted(set(absent)))} (yet)"
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="slow-links-"))
    port = PORT
    links: dict = {}  # rate (None: no limit) -> {"tcp": B/s, "bus": B/s}: the links the runs use, measured
    with netns.hosts(a.hosts, tag="l") as net:
        if a.hosts > 1:
            for r in sorted({s.rate_mbit for s in specs if s.hosts > 1 and not s.solo}, key=lambda x: x or 1e12):
                links[r] = measure_link(net, r, cpus=[pinned_cpus(i, 1) for i in range(a.hosts)] if a.pin else None)
        for round_ in range(a.repeat):
            for s in specs:
                r = results[s.name]
                if r.error and not r.rounds:
                    continue
                port += 1
                flags = [*a.common_flags, *s.flags]
                link = f"{s.rate_mbit:g} Mbit/s" if s.rate_mbit else "unlimited"
                print(f"[{round_ + 1}/{a.repeat}] {s.name}: {s.hosts} host(s) x {s.nproc}{' solo' if s.solo else ''}, "
                      f"link {link}: pretrain_gpt.py {shlex.join(flags)}", file=sys.stderr)
                records, error = launch(net, s, flags, workdir / s.name / f"round{round_}", port, a.threads,
                                        a.timeout, pin=a.pin)
                if error:
                    r.error = error
                    print(f"    {s.name} failed: {error}", file=sys.stderr)
                    continue
                summary = summarize(records, a.warmup)
                r.rounds.append(summary)
                print(f"    {summary.get('step_ms', float('nan')):.1f} ms/step, loss {summary.get('loss')}",
                      file=sys.stderr)
    derived = derive(a, results, links) if a.suite else {}
    print(f"logs: {workdir}", file=sys.stderr)  # before the results: a suite's last line ends the output
    print(table(results))
    text = report(a, derived) if a.suite else None
    if text:
        print(text)
    elif derived:
        print(json.dumps(derived, indent=2))
    if a.json:
        out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": len(os.sched_getaffinity(0)),
               "rate_mbit": rate, "links": {str(k): v for k, v in links.items()}, "common": a.common_flags,
               "suite": a.suite, "derived": derived,
               "runs": {n: {"hosts": r.spec.hosts, "nproc": r.spec.nproc, "rate_mbit": r.spec.rate_mbit,
                            "flags": r.spec.flags, "error": r.error, "rounds": r.rounds,
                            **{k: r.figure(k) for k in ("step_ms", "tokens_per_s", "loss", "valid_loss", "comm_bytes",
                                                        "comm_bytes_per_token", "wire_bytes_per_token")}}
                        for n, r in results.items()}}
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    return 1 if any(r.error and not r.rounds for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
