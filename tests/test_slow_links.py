"""Slow links: two network-namespace hosts whose links a token bucket (tc-tbf) limits
(tests/netns.py `LinkLimit`), and scripts/slow_links.py's launcher training across them.

Needs root (network namespaces) and iproute2 (`ip`, `tc`). Skipped when not root, except in CI (CI
set), where the tests fail instead, as in tests/test_multinode.py."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

import netns
from cli import ROOT
from slurm_cluster import in_ci

sys.path.insert(0, str(ROOT / "scripts"))
import slow_links  # noqa: E402
import slow_links_probe  # noqa: E402
import slow_links_suites  # noqa: E402
from megalite import arguments  # noqa: E402

RATE = 80  # Mbit/s each way: 10 MB/s, about 0.37 s for one all-reduce of gpt-tiny's fp32 gradients
MODEL = ["--mock-data", "--model", "gpt-tiny", "--seq-length", "32", "--log-interval", "1", "--eval-iters", "0"]
TOL = 1e-5  # relative, fp32


def _needs_netns():
    if os.geteuid() != 0 and not in_ci():
        pytest.skip("network namespaces need root (run as root, or in CI where this test must pass)")


@pytest.fixture(scope="module")
def net():
    """host0 and host1, each link limited to RATE Mbit/s in both directions."""
    _needs_netns()
    try:
        with netns.hosts(2, tag="w", link=netns.LinkLimit(RATE)) as n:
            yield n
    except netns.NetnsError as e:
        pytest.fail(f"cannot create throttled network-namespace hosts: {e} (CI={os.environ.get('CI', '')!r}, "
                    f"uid {os.geteuid()}; .ci/setup_netns.sh installs iproute2)")


def test_the_link_carries_the_configured_rate(net):
    rate = netns.LinkLimit(RATE).bytes_per_s
    for sender, receiver in ((1, 0), (0, 1)):  # both directions are limited
        got = net.throughput(sender, receiver, nbytes=3 << 20)
        assert 0.5 * rate <= got <= 1.1 * rate, f"host{sender} -> host{receiver}: {got / 1e6:.2f} MB/s at {RATE} Mbit/s"
    # A plain torch.distributed (gloo) all-reduce between the hosts: 2 MiB sent by each rank.
    nbytes = 2 << 20
    bus = nbytes / statistics.median(slow_links_probe.exchange_seconds(net, nbytes, rounds=3))
    assert 0.4 * rate <= bus <= 1.1 * rate, f"all-reduce bus bandwidth {bus / 1e6:.2f} MB/s at {RATE} Mbit/s"
    # The token bucket: an all-to-all of 32 KiB each way after the link idled crosses faster than the
    # rate lets its bytes. By the fastest of the calls: tbf without a bucket lets no call beat the
    # rate, and a loaded machine only slows calls, so one fast call is the bucket's evidence (the lower
    # quartile failed once in five CI runs under load, 2.87 against 2.79 ms; after idling a seventh to
    # a half of the calls take the full time anyway). Against the rate, not a measured back-to-back
    # call: on a loaded machine the gaps between calls refill the bucket, and "back to back" was as
    # fast (0.78 against 0.69 ms after idling)
    idle = min(slow_links_probe.exchange_seconds(net, 1 << 16, rounds=15, idle_s=0.02, op="all_to_all"))
    at_rate = (1 << 15) / rate
    assert idle < 0.85 * at_rate, f"after idling {idle * 1e3:.2f} ms, its bytes at the rate {at_rate * 1e3:.2f} ms"
    # By trimmed mean: at most the bucket. Two probes, not the suite's 12: each is a fresh pair of
    # ranks (about 5 s), and the bound holds for any one of them.
    burst = slow_links_probe.measure_link(net, RATE, probes=2)["burst"]
    assert 0 <= burst <= 1.5 * netns.LinkLimit(RATE).burst_bytes, f"bucket measured {burst:.0f} B"
    # The limit is what holds the rate down: without it the same veths are many times faster.
    net.limit(None)
    try:
        assert [h.link for h in net.hosts] == [None, None]
        fast = net.throughput(1, 0, nbytes=16 << 20)
        assert fast > 3 * rate, f"unthrottled: {fast / 1e6:.2f} MB/s"
    finally:
        net.limit(netns.LinkLimit(RATE))
    assert "tbf" in net[0].qdiscs() and "tbf" in net[1].qdiscs()


def _gradient_bytes() -> int:
    """gpt-tiny's fp32 gradients (every parameter), counted on megalite's own model."""
    from megalite import arguments
    from megalite.tools.plan.inputs import stage_parameters

    args = arguments.build_parser("test", default_model="gpt-tiny").parse_args(MODEL)
    config = arguments.model_config(args)
    params = stage_parameters(config, args.model.seq_length, pre=True, post=True)
    numel = sum(p.numel for p in (*params.head, *params.tail)) + config.num_layers * sum(p.numel for p in params.layer)
    return 4 * numel


def test_data_parallel_training_across_the_throttled_link_equals_one_process(net, tmp_path):
    flags = [*MODEL, "--global-batch-size", "4", "--micro-batch-size", "2", "--train-iters", "4"]
    spec = slow_links.RunSpec("dp", flags, hosts=2, nproc=1, rate_mbit=RATE)
    records, error = slow_links.launch(net, spec, flags, tmp_path / "dp", port=29510, threads=1, timeout=240)
    logs = "\n".join((tmp_path / "dp" / f"host{i}.{k}").read_text(errors="replace")[-3000:]
                     for i in (0, 1) for k in ("out", "err"))
    assert error is None, f"{error}\n{logs}"
    train = [r for r in records if "iteration" in r]
    assert "2 ranks as tp=1 pp=1 dp=2" in (tmp_path / "dp" / "host0.out").read_text(), logs

    # The same training as one process with the whole batch (fp32: equal within 1e-5).
    single = tmp_path / "single.jsonl"
    run = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *flags, "--metrics-file", str(single)],
                         capture_output=True, text=True, timeout=180, cwd=tmp_path,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    reference = slow_links.read_records(single)
    assert [r["iteration"] for r in train] == [r["iteration"] for r in reference] == [1, 2, 3, 4]
    for mine, ref in zip(train, reference):
        assert abs(mine["loss"] - ref["loss"]) <= TOL * abs(ref["loss"]), (mine["loss"], ref["loss"])

    # Its metrics, as the script reports them; every step's gradient all-reduce crossed the link,
    # so no step was faster than the gradients' bytes at the link's rate (90% of it: the bucket).
    summary = slow_links.summarize(records, warmup=1)
    assert summary["iterations"] == 4 and summary["steps"] == 3 and summary["tokens_per_s"] > 0
    grad_bytes = _gradient_bytes()
    floor_ms = 0.9 * grad_bytes / netns.LinkLimit(RATE).bytes_per_s * 1e3
    assert min(summary["ms_per_iter"]) >= floor_ms, (summary["ms_per_iter"], floor_ms)
    # What the hosts' interfaces sent: at least each step's all-reduce, the gradients' bytes from
    # each of the two ranks (a ring's 2 (n-1)/n), every step.
    assert summary["wire_bytes"] >= 2 * 4 * grad_bytes, (summary["wire_bytes"], grad_bytes)
    if "comm_bytes" in train[0]:  # megalite's own byte accounting, where it exists
        assert summary["comm_bytes"] >= 0.9 * grad_bytes, (summary["comm_bytes_by_kind"], grad_bytes)


def test_run_specs_and_link_limits():
    spec = slow_links.parse_run("alone=solo=1 rate=off nproc=2 --tp 2 --global-batch-size 8", 2, 1, 200.0)
    assert (spec.name, spec.flags, spec.hosts, spec.nproc, spec.rate_mbit, spec.solo) == \
        ("alone", ["--tp", "2", "--global-batch-size", "8"], 2, 2, None, True)
    spec = slow_links.parse_run("dp=hosts=1 rate=50", 2, 1, 200.0)
    assert (spec.flags, spec.hosts, spec.rate_mbit, spec.solo) == ([], 1, 50.0, False)
    with pytest.raises(SystemExit, match="NAME="):
        slow_links.parse_run("--tp 2", 2, 1, None)
    with pytest.raises(SystemExit, match="not a number"):
        slow_links.parse_run("x=hosts=two", 2, 1, None)
    # tbf's arguments: the rate in kbit, a 2 ms bucket (at least 32 KiB), the queue limit in us.
    assert netns.LinkLimit(200).tbf_args() == ["tbf", "rate", "200000kbit", "burst", "50000", "latency", "50000us"]
    assert netns.LinkLimit(10).burst_bytes == 32 * 1024 and netns.LinkLimit(10, 4).burst_bytes == 4096
    assert netns.LinkLimit(200).bytes_per_s == 25e6
    for bad in (dict(rate_mbit=0), dict(rate_mbit=10, burst_kib=1), dict(rate_mbit=10, queue_ms=0)):
        with pytest.raises(ValueError):
            netns.LinkLimit(**bad)


def _result(name: str, rate: float | None, steps_ms: list[float], kinds: dict[str, float] | None = None,
            error: str | None = None) -> slow_links.RunResult:
    """A RunResult as the harness leaves it: one summary a round (no rounds when every one failed)."""
    rounds = [{"step_ms": ms, **({"comm_bytes": sum(kinds.values()), "comm_bytes_by_kind": kinds} if kinds else {})}
              for ms in steps_ms]
    return slow_links.RunResult(slow_links.RunSpec(name, [], hosts=2, nproc=1, rate_mbit=rate), rounds, error)


def test_hidden_is_one_minus_exposed_over_the_counted_bytes_at_the_tcp_rate_unclamped():
    links = {300.0: {"tcp": 36e6, "bus": 30e6}, None: {"tcp": 900e6, "bus": 450e6}}  # bytes/s
    runs = [
        # best rounds 180 and 100 ms: 80 ms exposed of 3.6 MB / 36 MB/s = 100 ms: 20% hidden
        _result("dp-across", 300.0, [250.0, 180.0], {"dp": 3_599_980, "metrics": 20}), _result("dp-bare", None, [100.0]),
        # more exposed than the bytes take at the link's rate (many small collectives): negative, as measured
        _result("zero3-across", 300.0, [400.0], {"dp": 3.6e6}), _result("zero3-bare", None, [100.0, 130.0]),
        # faster across than bare (noise): over 100%, as measured
        _result("ep-across", 300.0, [90.0], {"ep": 1.2e6, "dp": 0.6e6}), _result("ep-bare", None, [100.0]),
        _result("pp-across", 300.0, [], error="host1 exited 1: ValueError: no"), _result("pp-bare", None, [100.0]),
        _result("cp-across", 300.0, [150.0], {"cp": 4.8e6, "dp": 2.4e6}), _result("cp-bare", None, [100.0]),
        _result("tp-across", 300.0, [300.0], {"sp": 7.2e6}), _result("tp-bare", None, [100.0]),
    ]
    derived = slow_links_suites.hidden_overlap({r.spec.name: r for r in runs}, links)
    dims = derived["dimensions"]
    assert derived["rate"] == "tcp" and derived["link_mb_per_s"]["300.0"] == {"tcp": 36.0, "bus": 30.0}
    expected = {"dp": (180, 100, 100, 80, 0.2), "zero3": (400, 100, 100, 300, -2.0), "ep": (90, 100, 50, -10, 1.2),
                "cp": (150, 100, 200, 50, 0.75), "tp": (300, 100, 200, 200, 0.0)}
    for dim, (across, bare, comm, exposed, hidden) in expected.items():
        row = dims[dim]
        assert (row["step_across_ms"], row["step_bare_ms"]) == (across, bare), dim
        assert row["comm_ms"] == pytest.approx(comm) and row["exposed_ms"] == pytest.approx(exposed), (dim, row)
        assert row["hidden"] == pytest.approx(hidden, abs=1e-12), (dim, row)
        assert row["comm_ms_bare"] == pytest.approx(comm * 36 / 900), dim  # the same bytes on the bare veths
    assert dims["cp"]["comm_bytes_by_kind"] == {"cp": 4.8e6, "dp": 2.4e6}
    assert "hidden" not in dims["pp"] and dims["pp"]["error"] == "pp-across: host1 exited 1: ValueError: no"

    line = "overlap: dp 20%, zero3 -200%, ep 120%, pp n/a, cp 75%, tp 0% of communication hidden"
    assert slow_links_suites.overlap_line(derived) == line
    report = slow_links_suites.hidden_report(derived).splitlines()
    assert report[-1] == line and report[-2] == "pp: n/a: pp-across: host1 exited 1: ValueError: no"
    assert [r.split("|")[1].strip() for r in report[2:8]] == list(slow_links_suites.HIDDEN)
    assert [c.strip() for c in report[2].split("|")[2:8]] == \
        ["180.0", "100.0", "3,600,000 (dp 3,599,980; metrics 20)", "100.0", "80.0", "20%"]
    # a run whose rounds are more than 10% apart (across or bare) is flagged: it cannot judge the planner alone
    assert dims["zero3"]["rounds_spread"] == pytest.approx(0.3) and "rounds_spread" not in dims["ep"]
    assert dims["dp"]["rounds_spread"] == pytest.approx(250 / 180 - 1)
    noisy = [line for line in report if "rounds are" in line]
    assert noisy == ["dp: a run's rounds are 39% apart: on a machine this noisy one run's exposure "
                     "scatters by as much as the planner's 20%; pool several runs "
                     "(scripts/slow_links_rederive.py A.json B.json ...)",
                     "zero3: a run's rounds are 30% apart: on a machine this noisy one run's exposure "
                     "scatters by as much as the planner's 20%; pool several runs "
                     "(scripts/slow_links_rederive.py A.json B.json ...)"]

    # Without a limited link (or without megalite's byte count) there is nothing to divide by: n/a, said why.
    derived = slow_links_suites.hidden_overlap({r.spec.name: r for r in runs}, {None: links[None]})
    assert slow_links_suites.overlap_line(derived) == \
        "overlap: dp n/a, zero3 n/a, ep n/a, pp n/a, cp n/a, tp n/a of communication hidden"
    assert dims["dp"]["exposed_ms"] == derived["dimensions"]["dp"]["exposed_ms"] == 80
    assert "no limited link" in derived["dimensions"]["dp"]["error"]
    runs[0] = _result("dp-across", 300.0, [180.0])
    derived = slow_links_suites.hidden_overlap({r.spec.name: r for r in runs}, links)
    assert "counted no bytes" in derived["dimensions"]["dp"]["error"]
    assert slow_links_suites.overlap_line(derived).startswith("overlap: dp n/a, zero3 -200%, ")


def test_the_waits_on_the_timeline_are_the_exposed_communication_and_the_planner_is_held_to_them_too():
    """slow_links_waits: per dimension with its waits on the timeline (dp, ZeRO-3, ep), rank 0's waits in
    the best round across less bare; the rest of the step's difference is compute that ran longer."""
    import slow_links_waits

    def run(name, rate, rounds):
        return slow_links.RunResult(slow_links.RunSpec(name, [], hosts=2, nproc=1, rate_mbit=rate, timeline=True),
                                    [{"step_ms": ms, "comm_bytes": 36e5, "comm_bytes_by_kind": {"dp": 36e5},
                                      "spans_ms": spans} for ms, spans in rounds])
    links = {300.0: {"tcp": 36e6, "bus": 30e6}, None: {"tcp": 900e6, "bus": 450e6}}
    runs = [  # the best rounds' spans count (1,000 ms across, 900 bare), not the slower rounds'
        run("zero3-across", 300.0, [(1100.0, {"zero-wait": 90.0, "zero-reduce-wait": 60.0, "forward": 400.0}),
                                    (1000.0, {"zero-wait": 50.0, "zero-reduce-wait": 40.0, "grad-reduce": 9.0})]),
        run("zero3-bare", None, [(900.0, {"zero-wait": 4.0, "zero-reduce-wait": 6.0})]),
        run("dp-across", 300.0, [(500.0, {"grad-reduce": 61.0})]), run("dp-bare", None, [(450.0, {"optimizer": 5.0})]),
        run("ep-across", 300.0, [(500.0, {"ep-comm": 61.0, "ep-wait": 20.0})]),
        run("ep-bare", None, [(450.0, {"ep-comm": 5.0, "ep-wait": 2.0})]),
        run("pp-across", 300.0, [(130.0, {"p2p": 40.0})]), run("pp-bare", None, [(100.0, {"p2p": 25.0})])]
    for r in runs[-2:]:  # the least at each exchange too: pp's stages' k-th receives are not one exchange, so unused
        r.rounds[0]["waited_by_all_ms"] = {"p2p": 1.0}
    derived = slow_links_suites.hidden_overlap({r.spec.name: r for r in runs}, links)
    dims = derived["dimensions"]
    assert (dims["zero3"]["waited_across_ms"], dims["zero3"]["waited_bare_ms"], dims["zero3"]["waited_ms"]) == \
        (90.0, 10.0, 80.0)  # grad-reduce holds ZeRO's own landing waits: not counted twice
    assert dims["zero3"]["waited_by"] == "rank 0"  # rounds saved without every rank's waits
    assert dims["dp"]["waited_ms"] == 61.0 and dims["zero3"]["exposed_ms"] == 100.0
    assert dims["ep"]["waited_ms"] == 18.0  # its waits, not its collectives in flight
    # saved before the executor drew its waits apart ("p2p-wait"): rank 0's "p2p" spans
    assert (dims["pp"]["waited_ms"], dims["pp"]["waited_by"]) == (15.0, "rank 0")
    today = [run("pp-across", 300.0, [(130.0, {"p2p": 9.0, "p2p-wait": 40.0, "norm-wait": 1.0})]),
             run("pp-bare", None, [(100.0, {"p2p": 20.0, "p2p-wait": 25.0, "norm-wait": 1.0})])]
    for r, least in zip(today, (60.0, 5.0)):
        r.rounds[0].update(waited_least_rank_ms={"pp": least}, waited_by_all_ms={"p2p-wait": 1.0})
    pp = slow_links_suites.hidden_overlap({r.spec.name: r for r in today}, links)["dimensions"]["pp"]
    assert (pp["waited_ms"], pp["waited_by"]) == (55.0, "the rank that waited least")
    assert "waited_per_exchange_ms" not in pp  # the stages' k-th receives are not one exchange
    dims["zero3"]["predicted_exposed_ms"], dims["dp"]["predicted_exposed_ms"] = 72.0, 30.0
    for row in dims.values():
        slow_links_waits.predicted_over_waited(row)
    assert dims["zero3"]["predicted_over_waited"] == pytest.approx(0.9) and "predicted_over_waited" not in dims["ep"]
    lines = [x for x in slow_links_suites.hidden_report(derived).splitlines()
             if " waited " in x and not x.startswith(("ep:", "pp:"))]
    noise = "(compute that ran longer across the link, and the rounds' noise)"
    assert lines == ["dp: waited 61 ms for its exchanges (61 across, 0 bare; rank 0; timeline: grad-reduce); the step's "
                     f"difference is -11 ms beyond them {noise}; 39% hidden by the waits; predicted / waited 0.49",
                     "zero3: waited 80 ms for its exchanges (90 across, 10 bare; rank 0; timeline: zero-wait, "
                     f"zero-reduce-wait); the step's difference is +20 ms beyond them {noise}; 20% hidden by the waits; "
                     "predicted / waited 0.90"]
    assert dims["zero3"]["hidden_by_waits"] == pytest.approx(0.2)  # 1 - 80 / 100 ms of communication
    # every rank's waits, each the least any rank had, where both best rounds hold them
    for r, least in ((runs[0], {"zero-wait": 45.0, "zero-reduce-wait": 40.0}), (runs[1], {"zero-wait": 1.0})):
        for rnd in r.rounds:
            rnd["waited_by_all_ms"] = least
    row = slow_links_suites.hidden_overlap({r.spec.name: r for r in runs}, links)["dimensions"]["zero3"]
    assert (row["waited_across_ms"], row["waited_bare_ms"], row["waited_by"]) == (85.0, 1.0, "every rank, per exchange")
    # the least rank's totals where both best rounds hold them (per dimension, and by phase), the
    # per-exchange reading beside them
    runs[0].rounds[1]["waited_least_rank_ms"] = {"zero3": 120.0, "zero3/after": 20.0, "zero3/pairs": 100.0}
    runs[1].rounds[0]["waited_least_rank_ms"] = {"zero3": 7.0, "zero3/after": 7.0}
    row = slow_links_suites.hidden_overlap({r.spec.name: r for r in runs}, links)["dimensions"]["zero3"]
    assert (row["waited_across_ms"], row["waited_bare_ms"], row["waited_ms"], row["waited_by"]) == \
        (120.0, 7.0, 113.0, "the rank that waited least")
    assert row["waited_per_exchange_ms"] == 84.0
    assert row["waited_phases_ms"] == {"forwards alone": 0.0, "pairs": 100.0, "backwards alone": 0.0, "after": 13.0}
    line = slow_links_waits.waits_lines({"dimensions": {"zero3": row}})[0]
    assert line.startswith("zero3: waited 113 ms for its exchanges (120 across, 7 bare; the rank that waited least; "
                           "timeline: zero-wait, zero-reduce-wait; 84 read exchange by exchange); ")
    # pooled: the mean prediction over the mean waits, in the runs that have them
    import slow_links_rederive
    rows = [{"dimensions": {"zero3": {**dims["zero3"], "waited_ms": w, "predicted_exposed_ms": p}}}
            for w, p in ((80.0, 72.0), (120.0, 108.0))] + [{"dimensions": {"zero3": {
                "exposed_ms": 100.0, "predicted_exposed_ms": 90.0}}}]
    (row,) = slow_links_rederive.pooled(rows)
    assert (row["runs"], row["waited_runs"]) == (3, 2) and row["waited_ms"] == 100.0
    assert row["predicted_over_waited"] == pytest.approx(0.9)
    assert row["hidden_by_waits"] == pytest.approx(1 - 200 / 200)  # the waits over 100 ms of communication, twice
    assert slow_links_rederive.pooled_report([row]).splitlines()[-1].endswith("| 100 (2) | 0.90 | 0% |")


def test_each_wait_on_the_timeline_counts_as_long_as_the_rank_that_waited_least(tmp_path):
    """slow_links.waited_by_all_ms: per iteration and kind, the k-th span of each rank matched, the
    least of them summed (the rank that came last to an exchange waited for the transfer alone); a
    kind whose count differs between ranks is left out; summarize takes the steady iterations' median."""
    def span(rank, it, cat, ts, dur):
        return {"ph": "X", "pid": rank, "tid": 0, "cat": cat, "name": cat, "ts": ts, "dur": dur,
                "args": {"iteration": it}}
    events = [{"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "rank 0"}}]
    for it in range(3):
        # rank 0 came early to the first exchange (waited 30 ms for rank 1 and 5 for the transfer), rank 1
        # to the second; each rank's spans listed out of order
        events += [span(0, it, "zero-wait", 2000, 5000 + 1000 * it), span(0, it, "zero-wait", 1000, 35000),
                   span(1, it, "zero-wait", 1100, 5000), span(1, it, "zero-wait", 2100, 40000),
                   span(0, it, "forward", 0, 90000), span(1, it, "forward", 0, 80000),
                   span(0, it, "grad-reduce", 9000, 7000)]  # rank 1 has none: left out
    trace = tmp_path / "timeline.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    got = slow_links.waited_by_all_ms(trace)
    assert got[1] == {"zero-wait": 10.0, "forward": 80.0} and got[3]["zero-wait"] == pytest.approx(12.0)
    records = [{"iteration": i, "ms_per_iter": 100.0, "tokens_per_sec": 10.0, "loss": 1.0} for i in (1, 2, 3)]
    summary = slow_links.summarize(records + [{"timeline": slow_links.timeline_ms(trace), "waited_by_all": got}], 1)
    assert summary["waited_by_all_ms"]["zero-wait"] == pytest.approx(11.5)  # iterations 2 and 3
    assert summary["spans_ms"]["zero-wait"] == pytest.approx(41.5) and summary["spans_ms"]["grad-reduce"] == 7.0


def test_a_pairs_waits_are_matched_across_ranks_lane_by_lane(tmp_path):
    """slow_links.waited_by_all_ms matches the k-th span of one name: the two lanes of an overlapped
    pair come to their waits in either order on each rank, each lane's in one order."""
    def span(rank, name, ts, dur):
        return {"ph": "X", "pid": rank, "tid": 0, "cat": "ep-wait", "name": name, "ts": ts, "dur": dur,
                "args": {"iteration": 0}}
    f, b = "wait for ep (F lane)", "wait for ep (B lane)"
    events = [span(0, f, 0, 4000), span(0, b, 100, 9000), span(0, f, 200, 1000),  # rank 0: F, B, F
              span(1, b, 0, 7000), span(1, f, 100, 6000), span(1, f, 200, 3000)]  # rank 1: B, F, F
    trace = tmp_path / "timeline.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    # F: min(4, 6) + min(1, 3); B: min(9, 7). In time order the k-th spans would give 4 + 6 + 1.
    assert slow_links.waited_by_all_ms(trace) == {1: {"ep-wait": pytest.approx(12.0)}}
    trace.write_text(json.dumps({"traceEvents": events[:-1]}))  # rank 1 lacks an F wait: the kind left out
    assert slow_links.waited_by_all_ms(trace) == {}


def test_the_waits_are_summed_by_the_phase_they_fall_in(tmp_path):
    """slow_links_waits.waited_by_phase_ms: each matched wait (the least any rank had) under its
    phase on rank 0's timeline: a lane's wait in a pair, a wait inside a forward or backward pass
    alone, or after them (the reduction); add_waits gives them across less bare, the report beside
    the planner's phases (Exposure.phases; "after": the run's data-parallel reduction)."""
    import slow_links_waits

    def span(rank, cat, name, ts, dur, it=0):
        return {"ph": "X", "pid": rank, "tid": 0, "cat": cat, "name": name, "ts": ts, "dur": dur,
                "args": {"iteration": it}}
    f, b = "wait for cp (F lane)", "wait for cp (B lane)"
    events = []
    for rank, late in ((0, 0), (1, 2000)):
        events += [span(rank, "forward", "F c0 mb0", 0, 100_000),
                   span(rank, "cp-wait", "wait for cp", 50_000, 8000 + late),
                   span(rank, "forward", "F c0 mb1", 100_000, 200_000),
                   span(rank, "backward", "B c0 mb0", 110_000, 200_000),
                   span(rank, "cp-wait", f, 120_000, 1000), span(rank, "cp-wait", b, 130_000, 16_000 - late),
                   span(rank, "backward", "B c0 mb1", 310_000, 100_000),
                   span(rank, "cp-wait", "wait for cp", 350_000, 30_000 + late),
                   span(rank, "grad-reduce", "grad reduce (wait)", 410_000, 11_000)]
    trace = tmp_path / "timeline.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    got = slow_links_waits.waited_by_phase_ms(trace)
    assert got == {1: {"cp-wait/forwards alone": 8.0, "cp-wait/pairs": pytest.approx(1.0 + 14.0),
                       "cp-wait/backwards alone": 30.0, "grad-reduce/after": 11.0}}
    records = [{"iteration": 1, "ms_per_iter": 100.0, "tokens_per_sec": 10.0, "loss": 1.0}]
    summary = slow_links.summarize(records + [{"waited_phases": got, "waited_by_all": {1: {"cp-wait": 53.0}}}], 0)
    assert summary["waited_phases_ms"]["cp-wait/pairs"] == pytest.approx(15.0)
    # across less bare, the cp run's kinds (its ring's waits and the reduction) by phase
    bare = {"cp-wait/forwards alone": 1.0, "grad-reduce/after": 2.0}
    rounds = [{"step_ms": 500.0, "waited_by_all_ms": {"cp-wait": 53.0, "grad-reduce": 11.0},
               "waited_phases_ms": summary["waited_phases_ms"]},
              {"step_ms": 400.0, "waited_by_all_ms": {"cp-wait": 1.0, "grad-reduce": 2.0}, "waited_phases_ms": bare}]
    across, on_bare = (slow_links.RunResult(slow_links.RunSpec(n, [], 2, 1, r, timeline=True), [rnd])
                       for n, r, rnd in (("cp-across", 300.0, rounds[0]), ("cp-bare", None, rounds[1])))
    row = {"exposed_ms": 100.0}
    slow_links_waits.add_waits(row, "cp", across, on_bare)
    assert row["waited_phases_ms"] == {"forwards alone": 7.0, "pairs": pytest.approx(15.0), "backwards alone": 30.0,
                                       "after": 9.0}
    row["predicted"] = {"dimensions": {"cp": {"phases_ms": {"forwards alone": 40.0, "pairs": 400.0,
                                                            "backwards alone": 215.0}},
                                       "dp": {"exposed_across_ms": 120.0, "exposed_bare_ms": 5.0}}}
    line = slow_links_waits.waits_lines({"dimensions": {"cp": row}})[-1]
    assert line == ("cp by phase, waited / planner ms: forwards alone 7 / 40, pairs 15 / 400, "
                    "backwards alone 30 / 215, after 9 / 115")


def test_the_waits_are_read_as_the_total_of_the_rank_that_waited_least(tmp_path):
    """slow_links_waits.waited_by_least_rank_ms: per iteration and dimension each rank's total wait,
    the least over the ranks, by phase on that rank's own timeline. Each rank waited 10 ms at one of
    two exchanges and 1-2 at the other: the least at each exchange adds to 3 ms where either rank
    waited at least 11 (scripts/gloo_exchanges.py --chain: the step's difference is the totals')."""
    import slow_links_waits

    def span(rank, cat, name, ts, dur, it=0):
        return {"ph": "X", "pid": rank, "tid": 0, "cat": cat, "name": name, "ts": ts, "dur": dur,
                "args": {"iteration": it}}
    f, b = "wait for ep (F lane)", "wait for ep (B lane)"
    events = []
    for rank, (fw, bw, alone, start) in ((0, (10_000, 1000, 3000, 0)), (1, (2000, 10_000, 4000, 50_000))):
        # the lone wait at 45 ms falls in rank 0's own forward (0-50 ms), after rank 1's (50-90)
        events += [span(rank, "forward", "F c0 mb0", start, 40_000 + 10_000 * (1 - rank)),
                   span(rank, "ep-wait", "wait for ep", 45_000, alone),
                   span(rank, "ep-wait", f, 100_000, fw), span(rank, "ep-wait", b, 120_000, bw),
                   span(rank, "grad-reduce", "grad reduce (wait)", 200_000, 5000 - 1000 * rank),
                   span(rank, "zero-wait", "wait for zero", 300_000, 7000 + 1000 * rank)]
    # pp: the first stage waits out the bubble (30 ms), the last stage the first activation (8) and the
    # drain at the gradient norm's reduction (12); posting ("p2p") is not a wait
    for rank, (receive, posting, norm) in ((0, (30_000, 2000, 1000)), (1, (8000, 5000, 12_000))):
        events += [span(rank, "p2p-wait", "wait for a receive", 400_000, receive),
                   span(rank, "p2p", "send/recv", 430_000, posting),
                   span(rank, "norm-wait", "wait for the gradient norm", 500_000, norm)]
    trace = tmp_path / "timeline.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    got = slow_links_waits.waited_by_least_rank_ms(trace)[1]
    # rank 0 waited 3 + 10 + 1 + 5 = 19 ms, rank 1 4 + 2 + 10 + 4 = 20
    assert (got["ep"], got["ep/forwards alone"], got["ep/pairs"], got["ep/after"]) == (19.0, 3.0, 11.0, 5.0)
    assert got["zero3"] == 7.0 and got["dp"] == 4.0  # each dimension's own least rank (rank 1's reduction)
    assert got["pp"] == 20.0  # the last stage's: the first activation and the drain
    per_exchange = slow_links.waited_by_all_ms(trace)[1]
    assert per_exchange["ep-wait"] == 3.0 + 2.0 + 1.0  # the least at each exchange: 9 ms less than either rank's
    # rank 0 waits 50 ms in the pair: rank 1 (20 ms) is the least, its lone wait after its own forward
    got = slow_links_waits.waited_by_least_rank_ms([{**e, "dur": 50_000} if e["name"] == f and e["pid"] == 0 else e
                                                    for e in events])[1]
    assert (got["ep"], got["ep/pairs"], got["ep/after"]) == (20.0, 12.0, 8.0) and "ep/forwards alone" not in got
    records = [{"iteration": 1, "ms_per_iter": 100.0, "tokens_per_sec": 10.0, "loss": 1.0}]
    summary = slow_links.summarize(records + [{"waited_least_rank": {1: got}}], 0)
    assert summary["waited_least_rank_ms"]["ep"] == 20.0


def test_gloo_exchanges_chain_reads_a_steps_waits_three_ways(tmp_path):
    """scripts/gloo_exchanges.py --chain: a step of overlapped all-to-alls between spins each rank
    draws apart; per size the step, the most compute, the waits read per exchange (the least at
    each), as the least rank's total and as the mean total (`chain_readings`, worked here by hand)."""
    import gloo_exchanges

    # per rank its two calls: [step, compute, wait at exchange 1, exchange 2, the end]
    every = [[[30.0, 20.0, 5.0, 0.0, 1.0], [40.0, 22.0, 6.0, 1.0, 2.0]],
             [[31.0, 21.0, 0.0, 4.0, 1.0], [41.0, 21.0, 3.0, 0.0, 0.0]]]
    got = gloo_exchanges.chain_readings(every)
    # call 1: totals 6 and 5, per exchange 0 + 0 + 1; call 2: totals 9 and 3, per exchange 3 + 0 + 0
    assert got == {"step_ms": 36.0, "compute_ms": 21.5, "per_exchange_least_ms": 2.0, "least_total_ms": 4.0,
                   "mean_total_ms": 5.75}
    _needs_netns()
    out = tmp_path / "x.json"
    gloo_exchanges.main(["--chain", "6", "--rate-mbit", "40", "--sizes", "65536", "--calls", "2", "--hide-ms", "3",
                         "--jitter-ms", "1", "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"tbf 40 Mbit/s", "bare veths"}
    for (row,) in results.values():
        assert row["bytes"] == 65536 and row["step_ms"] >= row["compute_ms"] > 6 * 2.0
        assert row["mean_total_ms"] >= row["least_total_ms"] >= row["per_exchange_least_ms"] >= 0
    with pytest.raises(SystemExit, match="--chain plays its own step"):
        gloo_exchanges.main(["--chain", "4", "--lag-ms", "5"])


def test_the_hidden_suite_runs_every_dimension_across_the_link_and_on_bare_veths():
    a = slow_links.argparse.Namespace(suite="hidden", model="gpt-tiny", hidden_size=None, seq_length=64, iters=8,
                                      micro_batch_size=None, bucket=200_000)
    common, texts = slow_links_suites.suite_runs(a)
    specs = [slow_links.parse_run(t, 2, 1, 300.0) for t in texts]
    # dp and ZeRO-3 each with a reference run: one rank, one rank's work (the planner's compute fit);
    # tp at one piece a shard is its own reference
    refs = {"dp": ["dp-ref"], "zero3": ["zero3-ref"]}
    assert [s.name for s in specs] == [n for d in slow_links_suites.HIDDEN
                                       for n in (f"{d}-across", f"{d}-bare", *refs.get(d, []))]
    pairs = [s for s in specs if not s.name.endswith("-ref")]
    assert [s.rate_mbit for s in pairs] == [300.0, None] * 6 and {(s.hosts, s.nproc) for s in pairs} == {(2, 1)}
    # dp's, ZeRO-3's and tp's pairs record their timelines (their waits: slow_links_waits), no other run does
    assert {s.name for s in specs if s.timeline} == {f"{d}-{w}" for d in ("dp", "zero3", "tp", "ep", "cp", "pp")
                                                     for w in ("across", "bare")}
    flags = {s.name: " ".join(s.flags) for s in specs}
    for ref in (s for s in specs if s.name.endswith("-ref")):
        assert (ref.hosts, ref.nproc, ref.rate_mbit) == (1, 1, None), ref.name
        args = arguments.build_parser("t", default_model="gpt-tiny").parse_args(ref.flags)
        assert (args.training.micro_batch_size, args.training.global_batch_size) == (8, 8), ref.name  # a rank's work
    assert flags["zero3-ref"].endswith("--global-batch-size 8 --zero-stage 0")
    for name, wants in {"dp": "--micro-batch-size 8 --global-batch-size 16", "zero3": "--zero-stage 3",
                        "ep": "--num-experts 8 --moe-router-topk 2", "pp": "--pp 2 --micro-batch-size 4",
                        "cp": "--cp 2 --seq-length 256 --micro-batch-size 4 --global-batch-size 4",
                        "tp": "--tp 2 --sequence-parallel --tp-comm-overlap"}.items():
        assert wants in flags[f"{name}-across"] and flags[f"{name}-across"] == flags[f"{name}-bare"], name
    assert "--expert-model-parallel-size 2" in flags["ep-across"] and "--mock-data" in common
    # 4 micro-batches a rank, each forward but the first beside a backward
    assert "--micro-batch-size 2 --global-batch-size 16" in flags["ep-across"]
    assert "--overlap-moe-expert-parallel-comm" in flags["ep-across"]


def test_the_hidden_suite_runs_the_dimensions_asked_for_each_scaled_to_its_own_tokens():
    a = slow_links.argparse.Namespace(suite="hidden", model="gpt-tiny", hidden_size=None, seq_length=64, iters=8,
                                      micro_batch_size=None, bucket=200_000, dims="zero3,cp,ep",
                                      dim_scale=["zero3=2", "cp=4", "ep=2"])
    specs = [slow_links.parse_run(t, 2, 1, 300.0) for t in slow_links_suites.suite_runs(a)[1]]
    flags = {s.name: " ".join(s.flags) for s in specs}
    assert list(flags) == ["zero3-across", "zero3-bare", "zero3-ref", "cp-across", "cp-bare", "ep-across", "ep-bare"]
    assert flags["zero3-ref"].startswith(flags["zero3-bare"]) and "--global-batch-size 16 " in flags["zero3-ref"]
    assert "--micro-batch-size 2 --global-batch-size 32" in flags["ep-bare"]  # 8 micro-batches a rank, not 4 bigger
    assert "--micro-batch-size 16 --global-batch-size 32 --zero-stage 3" in flags["zero3-across"]
    assert "--seq-length 256 --micro-batch-size 16 --global-batch-size 16" in flags["cp-bare"]  # 4 x 1,024 tokens
    for bad in (dict(dims="zero3,fsdp"), dict(dim_scale=["tp=0"]), dict(dim_scale=["xp=2"]),
                dict(dim_flags=["fsdp=--num-layers 8"]), dict(dim_flags=["cp="])):
        with pytest.raises(SystemExit):
            slow_links_suites.suite_runs(slow_links.argparse.Namespace(**{**vars(a), **bad}))


def test_a_dimensions_own_flags_come_after_its_suite_flags_in_both_of_its_runs():
    a = slow_links.argparse.Namespace(suite="hidden", model="gpt-tiny", hidden_size=None, seq_length=64, iters=8,
                                      micro_batch_size=None, bucket=200_000, dims="cp,tp", dim_scale=[],
                                      dim_flags=["cp=--seq-length 4096 --micro-batch-size 1", "cp=--global-batch-size 1",
                                                 "tp=--hidden-size 1024"])
    specs = [slow_links.parse_run(t, 2, 1, 300.0) for t in slow_links_suites.suite_runs(a)[1]]
    flags = {s.name: s.flags for s in specs}
    for where in ("across", "bare"):
        cp = flags[f"cp-{where}"]
        assert cp[-6:] == ["--seq-length", "4096", "--micro-batch-size", "1", "--global-batch-size", "1"]
        args = arguments.build_parser("t", default_model="gpt-tiny").parse_args(cp)
        assert (args.model.seq_length, args.training.micro_batch_size, args.parallel.cp) == (4096, 1, 2)  # last wins
        assert flags[f"tp-{where}"][-2:] == ["--hidden-size", "1024"] and "--tp-comm-overlap" in flags[f"tp-{where}"]
    assert "tp-ref" not in flags  # one piece a shard: the bare run is the reference
    # in pieces, tp's reference is the bare run at one piece: the pieces' own cost is no GEMM time
    a.dim_flags.append("tp=--tp-comm-overlap-splits 4")
    specs = {s.name: s for s in (slow_links.parse_run(t, 2, 1, 300.0) for t in slow_links_suites.suite_runs(a)[1])}
    ref = specs["tp-ref"]
    assert (ref.hosts, ref.rate_mbit) == (2, None)
    assert ref.flags == [*specs["tp-bare"].flags, "--tp-comm-overlap-splits", "1"]


def test_pinned_hosts_take_cpus_of_their_own_in_turn(monkeypatch):
    monkeypatch.setattr(slow_links.os, "sched_getaffinity", lambda pid: {0, 1, 5})
    assert [slow_links.pinned_cpus(h, 1) for h in range(4)] == ["0", "1", "5", "0"]  # one rank a host
    assert [slow_links.pinned_cpus(h, 2) for h in range(2)] == ["0,1", "5,0"]


def test_the_bucket_is_what_the_planners_link_needs_for_the_mean_exchange_after_idling(monkeypatch):
    """bucket_bytes: all-to-alls of 128 KiB each way after 20 ms of idle link, pooled over fresh
    connections (each a call of exchange_seconds), the ranks pinned as asked; the bucket is the
    bytes less what the rate carried in the trimmed mean time less the start-up, so that the
    planner's Link gives that time back."""
    from megalite.tools.plan.pair_play import Bucket, Link

    calls = []

    def fake(net, nbytes, rounds=5, idle_s=0.0, op="all_reduce", cpus=None, **kw):
        calls.append((nbytes, rounds, idle_s, op, cpus))
        return [2.5e-3] * 9 + [40e-3]  # one stall, trimmed away
    monkeypatch.setattr(slow_links_probe, "exchange_seconds", fake)
    rate, latency = 35.8e6, 0.2e-3
    burst = slow_links_probe.bucket_bytes(None, rate, latency, probes=3, rounds=10, cpus=["0", "1"])
    assert calls == [(1 << 18, 10, 0.02, "all_to_all", ["0", "1"])] * 3
    assert burst == pytest.approx((1 << 17) - (2.5e-3 - latency) * rate)
    seconds = latency + (1 << 17) / rate  # the planner's exchange: start-up and bytes at the rate
    assert Link(Bucket(burst / rate, latency)).carry(0.0, seconds) == pytest.approx(2.5e-3)
    # slower than the bytes at the rate: no bucket; faster than the start-up: at most the bytes
    monkeypatch.setattr(slow_links_probe, "exchange_seconds", lambda *a, **k: [9e-3] * 10)
    assert slow_links_probe.bucket_bytes(None, rate, latency) == 0.0
    monkeypatch.setattr(slow_links_probe, "exchange_seconds", lambda *a, **k: [1e-4] * 10)
    assert slow_links_probe.bucket_bytes(None, rate, latency) == 1 << 17


def test_pin_without_taskset_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(slow_links.os, "geteuid", lambda: 0)
    monkeypatch.setattr(slow_links.os, "get_exec_path", lambda: [])
    with pytest.raises(SystemExit):
        slow_links.main(["--pin", "--suite", "hidden"])
    assert "--pin runs each host under taskset, which is not installed" in capsys.readouterr().err


def test_the_pairs_suite_compares_dualpipev_paired_with_zb_v_and_1f1b_at_pp2_ep2():
    a = slow_links.argparse.Namespace(suite="pairs", model="gpt-tiny", hidden_size=None, seq_length=64, iters=8,
                                      micro_batch_size=None, bucket=200_000)
    common, texts = slow_links_suites.suite_runs(a)
    specs = [slow_links.parse_run(t, 4, 1, 300.0) for t in texts]
    assert [s.name for s in specs] == ["1f1b", "1f1b-paired", "zb-v", "dualpipev", "dualpipev-paired",
                                       "1f1b-paired-dw", "zb-v-dw", "dualpipev-paired-dw"]
    assert all("--delay-wgrad-compute" in s.flags for s in specs[5:])
    line = " ".join(common)
    assert "--pp 2 --expert-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 32" in line
    runs = {name: _result(name, 300.0, steps) for name, steps in
            {"1f1b": [500, 480], "1f1b-paired": [450], "zb-v": [470], "dualpipev": [490],
             "dualpipev-paired": [440, 460]}.items()}
    derived = slow_links_suites.derive(a, runs, {})
    assert derived["step_ms"]["dualpipev-paired"] == 440 and derived["vs_1f1b"]["zb-v"] == 470 / 480
    assert derived["dualpipev_paired_below_zb_v_and_1f1b"] is True
    # the medians: 1F1B 490, DualPipeV paired 450
    assert derived["median_ms"]["1f1b"] == 490 and derived["median_ms"]["dualpipev-paired"] == 450
    assert derived["dualpipev_paired_below_zb_v_and_1f1b_by_median"] is True
    assert slow_links_suites.report(a, derived).startswith("pairs (best / median ms): 1f1b 480 / 490, "
                                                           "1f1b-paired 450 / 450")
    runs["1f1b"] = _result("1f1b", 300.0, [430, 520, 530])  # one fast round: below by best, not by median
    derived = slow_links_suites.derive(a, runs, {})
    assert derived["dualpipev_paired_below_zb_v_and_1f1b"] is False
    assert derived["dualpipev_paired_below_zb_v_and_1f1b_by_median"] is True


def test_the_hidden_suite_prints_the_planners_prediction_beside_each_measured_dimension():
    a = slow_links.argparse.Namespace(suite="hidden", model="gpt-tiny", hidden_size=None, seq_length=64, iters=12,
                                      micro_batch_size=None, bucket=200_000, exchange_latency_ms=None)
    common, texts = slow_links_suites.suite_runs(a)
    a.common_flags = common
    # the quiet run of docs/slow-links.md (f): step across, step bare (ms), megalite's bytes a step
    quiet = {"dp": (144.3, 72.9, 3763219), "zero3": (263.3, 97.4, 5644823), "ep": (360.7, 162.9, 5847424),
             "pp": (133.7, 86.3, 1048599), "cp": (486.3, 142.3, 10120211), "tp": (587.8, 154.4, 9724943)}
    runs = {}
    for text in texts:
        spec = slow_links.parse_run(text, 2, 1, 300.0)
        dim, where = spec.name.split("-")
        step = {"across": quiet[dim][0], "bare": quiet[dim][1], "ref": 0.8 * quiet[dim][1]}[where]
        runs[spec.name] = slow_links.RunResult(spec, [{"step_ms": step, "comm_bytes": quiet[dim][2],
                                                       "comm_bytes_by_kind": {dim: quiet[dim][2]}}])
    links = {300.0: {"tcp": 35.82e6, "bus": 35.70e6, "latency": 3.8e-3}, None: {"tcp": 1096e6, "bus": 895e6,
                                                                                "latency": 1e-4}}
    derived = slow_links_suites.derive(a, runs, links)
    dims = derived["dimensions"]
    assert derived["exchange_latency_ms"] == {"300.0": pytest.approx(3.8), "None": pytest.approx(0.1)}
    for dim, row in dims.items():
        assert row["predicted_exposed_ms"] > 0, dim
        assert row["predicted_over_measured"] == pytest.approx(row["predicted_exposed_ms"] / row["exposed_ms"])
        bare = sum(d["exposed_bare_ms"] for d in row["predicted"]["dimensions"].values())
        if dim in ("dp", "zero3"):  # calibrated on the reference: one rank's step, no link
            assert row["step_reference_ms"] == pytest.approx(0.8 * row["step_bare_ms"]), dim
            assert row["predicted"]["compute_ms"] == pytest.approx(row["step_reference_ms"], rel=0.05), dim
            own = row["step_bare_ms"] - row["predicted"]["compute_ms"] - bare  # the exchanges' own cost
            assert row["predicted"]["own_ms"] == pytest.approx(own) and own > 0.1 * row["step_bare_ms"], dim
        else:  # calibrated on the bare run: its compute plus what the bare links expose is its step
            assert "step_reference_ms" not in row and "own_ms" not in row["predicted"], dim
            assert row["predicted"]["compute_ms"] + bare == pytest.approx(row["step_bare_ms"], rel=0.02), dim
    assert set(dims["ep"]["predicted"]["dimensions"]) == {"ep", "dp"}  # the dense layers' reduction too
    assert set(dims["pp"]["predicted"]["dimensions"]) == {"pp", "dp"}  # the tied embedding's
    assert dims["tp"]["predicted"]["dimensions"]["tp"]["exchanges"] == 72
    report = slow_links_suites.hidden_report(derived).splitlines()
    assert report[0].split("|")[8:10] == [" predicted exposed ms ", " predicted / measured "]
    cells = [c.strip() for c in report[5].split("|")]
    assert cells[1] == "pp" and cells[8] == f"{dims['pp']['predicted_exposed_ms']:.1f}"
    assert report[8].startswith("predicted: megalite.tools.plan") and "3.800 ms" in report[8]
    # --exchange-latency-ms in place of the measured small all-reduce: less latency, less predicted
    a.exchange_latency_ms = 0.3
    lower = slow_links_suites.derive(a, runs, links)["dimensions"]
    assert all(lower[d]["predicted_exposed_ms"] < dims[d]["predicted_exposed_ms"] for d in dims)
    # the limited link's token bucket: measure_link's "burst" (a --json saved before it was measured:
    # the suite's configured bucket, as above), or --link-burst-kib; only ep's plays carry it
    a.exchange_latency_ms, a.link_burst_kib = None, 0.0
    flat = slow_links_suites.derive(a, runs, links)["dimensions"]
    assert flat["ep"]["predicted_exposed_ms"] > dims["ep"]["predicted_exposed_ms"]
    assert all(flat[d]["predicted_exposed_ms"] == pytest.approx(dims[d]["predicted_exposed_ms"]) for d in dims if d != "ep")
    a.link_burst_kib = None
    measured = {**links, 300.0: {**links[300.0], "burst": 0.0}}
    assert (slow_links_suites.derive(a, runs, measured)["dimensions"]["ep"]["predicted_exposed_ms"]
            == pytest.approx(flat["ep"]["predicted_exposed_ms"]))
    # cp's attention blocks as a saved run measured them (a live suite probes them: a.probe_compute):
    # slower than their FLOPs at the fitted rate, they hide more of each ring transfer; no other row moves
    a.link_burst_kib, a.saved_derived = 0.0, {"dimensions": {"cp": {"attention_block_ms": [40.0, 30.0]}}}
    timed = slow_links_suites.derive(a, runs, links)["dimensions"]
    cp = timed["cp"]
    assert cp["attention_block_ms"] == [40.0, 30.0] and "attention_block_ms" not in flat["cp"]
    speed, backward_speed = cp["predicted"]["attention_speed"]
    assert speed == pytest.approx(backward_speed * 30 / 40) and speed < 1
    assert cp["predicted"]["tflops"] == pytest.approx(flat["cp"]["predicted"]["tflops"])
    assert cp["predicted_exposed_ms"] < flat["cp"]["predicted_exposed_ms"]
    assert all(timed[d]["predicted_exposed_ms"] == pytest.approx(flat[d]["predicted_exposed_ms"])
               for d in dims if d != "cp")


def test_a_saved_suite_is_derived_again_with_this_checkouts_planner(tmp_path, capsys):
    """scripts/slow_links_rederive.py: a --json of the hidden suite, its figures worked out again
    without root or runs: the same derivation as the suite's own, and --exchange-latency-ms."""
    import slow_links_rederive

    a = slow_links.argparse.Namespace(suite="hidden", model="gpt-tiny", hidden_size=None, seq_length=64, iters=12,
                                      micro_batch_size=None, bucket=200_000, exchange_latency_ms=None, dims="ep,pp")
    common, texts = slow_links_suites.suite_runs(a)
    a.common_flags = common
    steps = {"ep-across": 360.7, "ep-bare": 162.9, "pp-across": 133.7, "pp-bare": 86.3}
    runs = {}
    for text in texts:
        spec = slow_links.parse_run(text, 2, 1, 300.0)
        runs[spec.name] = {"hosts": 2, "nproc": 1, "rate_mbit": spec.rate_mbit, "flags": spec.flags, "error": None,
                           "rounds": [{"step_ms": steps[spec.name], "tokens_per_s": 1e3, "comm_bytes": 5847424,
                                       "comm_bytes_by_kind": {"ep": 5847424}}]}
    links = {"300.0": {"tcp": 35.82e6, "bus": 35.70e6, "latency": 3.8e-3}, "None": {"tcp": 1096e6, "bus": 895e6,
                                                                                    "latency": 1e-4}}
    saved = tmp_path / "hidden.json"
    saved.write_text(json.dumps({"suite": "hidden", "common": common, "links": links, "runs": runs, "derived": {}}))
    out = tmp_path / "again.json"
    assert slow_links_rederive.main([str(saved), "--json", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1].startswith("overlap: dp n/a, zero3 n/a, ep ")
    # ep's pairs: the least any order of the passes exposes, beside the measured share
    assert any(line.startswith("ep: no order of these passes hides more than ") for line in printed)
    results, rates = slow_links_rederive.load(str(saved))
    assert set(rates) == {300.0, None} and results["ep-bare"].spec.rate_mbit is None
    direct = slow_links_suites.derive(a, results, rates)["dimensions"]
    again = json.loads(out.read_text())["derived"]["dimensions"]
    for dim in ("ep", "pp"):
        assert again[dim]["predicted_exposed_ms"] == pytest.approx(direct[dim]["predicted_exposed_ms"])
        assert again[dim]["predicted_exposed_ms"] > 0
    assert 0 < again["ep"]["bound_exposed_ms"] < again["ep"]["predicted_exposed_ms"] and "bound_hidden" not in again["pp"]
    assert slow_links_rederive.main([str(saved), "--exchange-latency-ms", "0.3", "--json", str(out)]) == 0
    lower = json.loads(out.read_text())["derived"]["dimensions"]
    assert lower["ep"]["predicted_exposed_ms"] < again["ep"]["predicted_exposed_ms"]


def test_saved_runs_of_the_hidden_suite_are_pooled_per_dimension(tmp_path, capsys):
    """slow_links_rederive.py with several --json: per dimension the mean measured exposure (and its
    standard error) against the mean prediction, each run's own ratio, how many are within 20%."""
    import slow_links_rederive

    a = slow_links.argparse.Namespace(suite="hidden", model="gpt-tiny", hidden_size=None, seq_length=64, iters=12,
                                      micro_batch_size=None, bucket=200_000, exchange_latency_ms=None, dims="ep")
    common, texts = slow_links_suites.suite_runs(a)
    links = {"300.0": {"tcp": 35.82e6, "bus": 35.70e6, "latency": 0.3e-3}, "None": {"tcp": 1096e6, "bus": 895e6,
                                                                                    "latency": 1e-4}}
    paths = []
    for i, across in enumerate((330.0, 360.0, 420.0)):  # the same bare step, three readings across the link
        runs = {}
        for text in texts:
            spec = slow_links.parse_run(text, 2, 1, 300.0)
            step = across if spec.name == "ep-across" else 162.9
            runs[spec.name] = {"hosts": 2, "nproc": 1, "rate_mbit": spec.rate_mbit, "flags": spec.flags,
                               "error": None, "rounds": [{"step_ms": step, "tokens_per_s": 1e3, "comm_bytes": 5847424,
                                                          "comm_bytes_by_kind": {"ep": 5847424}}]}
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps({"suite": "hidden", "common": common, "links": links, "runs": runs}))
    singles = []
    for path in paths:
        assert slow_links_rederive.main([str(path), "--json", str(tmp_path / "one.json")]) == 0
        singles.append(json.loads((tmp_path / "one.json").read_text())["derived"]["dimensions"]["ep"])
    capsys.readouterr()
    out = tmp_path / "pooled.json"
    assert slow_links_rederive.main([*map(str, paths), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    (row,) = json.loads(out.read_text())["pooled"]
    measured = [s["exposed_ms"] for s in singles]
    predicted = [s["predicted_exposed_ms"] for s in singles]
    assert measured == pytest.approx([330.0 - 162.9, 360.0 - 162.9, 420.0 - 162.9])
    assert row["dimension"] == "ep" and row["runs"] == 3
    assert row["measured_ms"] == pytest.approx(statistics.mean(measured))
    assert row["measured_se_ms"] == pytest.approx(statistics.stdev(measured) / 3 ** 0.5)
    assert row["predicted_over_measured"] == pytest.approx(statistics.mean(predicted) / statistics.mean(measured))
    assert row["per_run"] == pytest.approx([p / m for p, m in zip(predicted, measured)])
    assert row["within_20"] == sum(0.8 <= p / m <= 1.2 for p, m in zip(predicted, measured))
    assert f"| ep | 3 | {row['measured_ms']:.0f} ± " in printed
    # another suite's --json is not pooled
    other = tmp_path / "moe.json"
    other.write_text(json.dumps({"suite": "moe", "common": common, "links": links, "runs": {}}))
    with pytest.raises(SystemExit):
        slow_links_rederive.main([str(paths[0]), str(other)])
    assert "only runs of the hidden suite are pooled" in capsys.readouterr().err
    # a file that is not a saved run: one line naming it
    with pytest.raises(SystemExit, match="missing.json: not a saved run of scripts/slow_links.py --json"):
        slow_links_rederive.main([str(paths[0]), str(tmp_path / "missing.json")])


def test_gloo_exchanges_overlap_times_a_block_beside_each_exchange_in_flight(tmp_path):
    """scripts/gloo_exchanges.py --overlap: per kind the block alone, the exchange alone, the block
    with the exchange in flight, launch to done; the tax and the hidden share worked out of them."""
    _needs_netns()
    import gloo_exchanges

    out = tmp_path / "x.json"
    gloo_exchanges.main(["--overlap", "--rate-mbit", "40", "--sizes", "262144", "--calls", "2", "--block-iters", "10",
                         "--no-bare", "--json", str(out), "--kinds", "all_to_all,all_reduce"])
    rows = json.loads(out.read_text())["results"]["tbf 40 Mbit/s"]
    assert [r["kind"] for r in rows] == ["all_reduce", "all_to_all"]
    for r in rows:
        assert r["block_ms"] > 0 and r["exchange_ms"] > 0 and r["launch_to_done_ms"] >= r["block_beside_ms"] > 0
        assert r["tax"] == pytest.approx((r["block_beside_ms"] - r["block_ms"]) / r["exchange_ms"])
        assert r["hidden"] == pytest.approx(1 - (r["launch_to_done_ms"] - r["block_ms"]) / r["exchange_ms"])


def test_a_late_rank_waits_for_the_whole_transfer_and_the_early_one_for_the_lag_too(tmp_path):
    """scripts/gloo_exchanges.py --lag-ms: rank 1 comes to each exchange (the ring's receive and
    send) 80 ms late; gloo moves the bytes only once both ranks have posted, so the late rank waits
    for the transfer alone and the early one for the lag as well: why scripts/slow_links.py counts
    each wait as the least any rank had."""
    _needs_netns()
    import gloo_exchanges

    out = tmp_path / "x.json"
    gloo_exchanges.main(["--rate-mbit", "40", "--sizes", "262144", "--calls", "3", "--no-bare", "--json", str(out),
                         "--kinds", "recv_send", "--lag-ms", "80"])
    (row,) = json.loads(out.read_text())["results"]["tbf 40 Mbit/s"]
    transfer = 262144 / 5e6 * 1e3  # 256 KiB each way at 40 Mbit/s: 52 ms
    assert row["lag_ms"] == 80 and 0.7 * transfer < row["late_median_ms"] < 80
    assert row["median_ms"] == pytest.approx(80 + row["late_median_ms"], abs=20)


def test_gloo_exchanges_times_megalites_reduce_scatter_beside_gloos_across_the_link(tmp_path):
    """scripts/gloo_exchanges.py: every kind asked for, at every size, across the link; at the link's
    rate megalite's reduce-scatter (one all-to-all) sends half of what gloo's (an all-reduce) does."""
    _needs_netns()
    import gloo_exchanges

    out = tmp_path / "x.json"
    gloo_exchanges.main(["--rate-mbit", "40", "--sizes", "1048576", "--calls", "2", "--no-bare", "--json", str(out),
                         "--kinds", "reduce_scatter_gloo,reduce_scatter_megalite"])
    rows = {r["kind"]: r for r in json.loads(out.read_text())["results"]["tbf 40 Mbit/s"]}
    assert set(rows) == {"reduce_scatter_gloo", "reduce_scatter_megalite"}
    # 1 MiB at 40 Mbit/s: about 0.21 s for gloo's all-reduce, 0.105 s for the all-to-all's half
    assert rows["reduce_scatter_megalite"]["min_ms"] < 0.75 * rows["reduce_scatter_gloo"]["min_ms"], rows
    with pytest.raises(SystemExit):
        gloo_exchanges.main(["--kinds", "all_reduce,fsdp"])
