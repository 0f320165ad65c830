"""Slow links: two network-namespace hosts whose links a token bucket (tc-tbf) limits
(tests/netns.py `LinkLimit`), and scripts/slow_links.py's launcher training across them.

Needs root (network namespaces) and iproute2 (`ip`, `tc`). Skipped when not root, except in CI (CI
set), where the tests fail instead, as in tests/test_multinode.py."""
from __future__ import annotations

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
    bus = nbytes / statistics.median(slow_links.allreduce_seconds(net, nbytes, rounds=3))
    assert 0.4 * rate <= bus <= 1.1 * rate, f"all-reduce bus bandwidth {bus / 1e6:.2f} MB/s at {RATE} Mbit/s"
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
