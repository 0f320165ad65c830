"""Multi-node for real: two "hosts" (network namespaces on a bridge, tests/netns.py), each with its
own address and its own torchrun, train one job together over the virtual network; the same job
through a two-node Slurm cluster (a slurmd in each host); and a host that dies mid-run.

Needs root (network namespaces) and iproute2. Skipped when not root, except in CI (CI set), where
the tests fail instead: a CI machine that cannot create namespaces has lost this coverage."""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import netns
from cli import ROOT, records
from helpers import wait_for
from slurm_cluster import SLURM, SlurmTestCluster, in_ci, job_env, job_log, require_slurm

PORT = 29500  # inside a fresh namespace every port is free
# Global batch 8: 4 micro-batches a step at pp 2 (1F1B reaches its steady state), half the default's
# compute; validation on one batch (the default's four cost as much as several steps).
MODEL = ["--mock-data", "--log-interval", "1", "--seq-length", "32", "--global-batch-size", "8", "--eval-iters", "1"]
LAYOUT = ["--tp", "2", "--pp", "2"]
ITERS = ["--train-iters", "4"]  # the losses after three optimizer steps must match too
TOL = 1e-5  # relative, fp32
# --distributed-timeout-minutes of the runs that lose a host: 12 s. The longest a rank waits on another
# in a healthy run here is start-up skew, the first step's pipeline fill or a peer's checkpoint
# report, each 1-3 s on a loaded 2-core machine (a whole first step of 8 micro-batches took 4.3 s at
# load 8); a loss is seen only after this wait (the partition always, a host killed while saving too).
LOST_HOST_TIMEOUT_MIN = "0.2"


def _env(**extra) -> dict:
    return job_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def _needs_netns():
    if os.geteuid() != 0 and not in_ci():
        pytest.skip("network namespaces need root (run as root, or in CI where this test must pass)")


@pytest.fixture
def hosts():
    """Two fresh hosts (host0, host1), removed after the test whatever happens."""
    _needs_netns()
    try:
        with netns.hosts(2, tag="t") as net:
            yield net
    except netns.NetnsError as e:
        pytest.fail(f"cannot create network-namespace hosts: {e} (CI={os.environ.get('CI', '')!r}, "
                    f"uid {os.geteuid()}; .ci/setup_netns.sh installs iproute2)")


def _train_single(*args: str, timeout: float = 180) -> tuple[int, str]:
    """pretrain_gpt.main(args) on one rank of `run_ranks` (forked from its warm fork server: no
    interpreter start-up); the single-process runs are references, their launch is not under test."""
    from megalite.testing import run_ranks
    from training_ranks import entry_main

    code, _, err = run_ranks(entry_main, 1, args=(list(args),), timeout=timeout)[0]
    return code, err


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run that the multi-host runs must reproduce: (train, valid) records."""
    tmp = tmp_path_factory.mktemp("reference")
    code, err = _train_single(*MODEL, *ITERS, "--metrics-file", str(tmp / "m.jsonl"))
    assert code == 0, err[-3000:]
    return records(tmp / "m.jsonl"), records(tmp / "m.jsonl", "valid")


def _assert_same_losses(metrics: Path, reference, detail: str = ""):
    train, valid = reference
    got = records(metrics)
    assert [r["iteration"] for r in got] == [r["iteration"] for r in train], detail
    for mine, ref in zip(got, train):
        err = abs(mine["loss"] - ref["loss"]) / abs(ref["loss"])
        assert err <= TOL, f"iteration {ref['iteration']}: loss {mine['loss']} vs {ref['loss']} (rel {err:.2e})"
    got_valid = records(metrics, "valid")
    assert [r["iteration"] for r in got_valid] == [r["iteration"] for r in valid]
    for mine, ref in zip(got_valid, valid):
        assert abs(mine["valid_loss"] - ref["valid_loss"]) <= TOL * abs(ref["valid_loss"]), (mine, ref)


def _launch(net: netns.Network, tmp: Path, train_args: list[str]) -> list[subprocess.Popen]:
    """One torchrun per host, static rendezvous at host0; output to tmp/host<i>.{out,err}."""
    procs = []
    for node_rank, host in enumerate(net.hosts):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(net)), "--nproc_per_node", "2",
               "--node_rank", str(node_rank), "--master_addr", net[0].addr, "--master_port", str(PORT),
               str(ROOT / "pretrain_gpt.py"), *train_args]
        with open(tmp / f"host{node_rank}.out", "w") as out, open(tmp / f"host{node_rank}.err", "w") as err:
            procs.append(host.popen(cmd, env=_env(GLOO_SOCKET_IFNAME=host.ifname), stdout=out, stderr=err,
                                    cwd=tmp))
    return procs


def _still_running(root: int) -> str:
    """The processes under `root` (torchrun and its ranks) with each thread's state and kernel wait
    channel: where a host that outlived its ranks' lines is stuck, for the failure message."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
        except (ValueError, OSError, IndexError):
            continue
    lines, todo = [], [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            cmd = (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))[:160]
            threads = []
            for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
                name = (task / "comm").read_text().strip()
                state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                threads.append(f"{name}:{state}:{(task / 'wchan').read_text().strip() or '-'}")
        except OSError:
            continue
        lines.append(f"{pid} {cmd}\n    threads {', '.join(threads)}")
    return "----- still running -----\n" + "\n".join(lines)


def _output(tmp: Path, i: int, tail: int = 4000) -> str:
    parts = []
    for kind in ("out", "err"):
        path = tmp / f"host{i}.{kind}"
        if path.exists():
            parts.append(f"----- host{i} std{kind} -----\n{path.read_text(errors='replace')[-tail:]}")
    return "\n".join(parts)


def test_two_hosts_train_like_one_process(hosts, tmp_path, reference):
    # Pipeline split across the hosts: ranks 0, 1 (host0) are stage 0, ranks 2, 3 (host1) stage 1,
    # tensor parallelism inside each host; every byte between stages crosses the bridge.
    metrics = tmp_path / "m.jsonl"
    procs = _launch(hosts, tmp_path, [*MODEL, *LAYOUT, *ITERS, "--metrics-file", str(metrics)])
    deadline = time.monotonic() + 240
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"two-host run did not end within 240 s\n{_output(tmp_path, 0)}\n{_output(tmp_path, 1)}")
    detail = f"{_output(tmp_path, 0)}\n{_output(tmp_path, 1)}"
    assert [p.returncode for p in procs] == [0, 0], detail
    assert "4 ranks as tp=2 pp=2 dp=1" in (tmp_path / "host0.out").read_text(), detail
    _assert_same_losses(metrics, reference, detail)


def test_a_host_that_dies_ends_the_job_and_leaves_a_loadable_checkpoint(hosts, tmp_path):
    from megalite import checkpoint

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    long_run = [*MODEL, *LAYOUT, "--train-iters", "100000", "--distributed-timeout-minutes", LOST_HOST_TIMEOUT_MIN,
                "--save", str(ckpt), "--save-interval", "2"]
    procs = _launch(hosts, tmp_path, [*long_run, "--metrics-file", str(metrics)])
    logs = lambda: f"{_output(tmp_path, 0)}\n{_output(tmp_path, 1)}"  # noqa: E731
    wait_for(lambda: (ckpt / "latest").exists() and metrics.exists() and len(records(metrics)) >= 4, 150,
              lambda: f"no checkpoint and 4 iterations in 150 s\n{logs()}", procs)

    # host1 goes away: torchrun and its ranks, all at once, with no chance to say goodbye.
    killed = hosts[1].kill_all(signal.SIGKILL)
    assert killed, "no process found in host1's namespace"
    try:
        procs[0].wait(timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"host0 still running 90 s after host1 died (hang)\n{_output(tmp_path, 0)}")
    procs[1].wait(timeout=10)
    err = (tmp_path / "host0.err").read_text(errors="replace")
    assert procs[0].returncode != 0, _output(tmp_path, 0)
    # Nothing of the job is left on host0 either (torchrun ends its ranks before it exits).
    wait_for(lambda: not hosts[0].pids(), 15, lambda: f"processes left in host0: {hosts[0].pids()}")

    lines = [x for x in err.splitlines() if x.startswith("megalite: error: rank ")]
    assert lines, f"no 'megalite: error: rank R ...' line on host0's stderr:\n{err[-4000:]}"
    ours = [x for x in lines if x.split()[3] in ("0", "1")]  # printed by host0's ranks 0, 1
    assert ours and all("lost contact with another rank" in x or "timed out" in x for x in ours), lines
    named = [x.split("lost:", 1)[1] for x in ours if "lost:" in x]
    if named:
        assert any("rank 2" in x or "rank 3" in x for x in named), f"the lost ranks are 2 and 3: {lines}"
    else:
        print(f"note: the error line names no lost ranks (no 'lost:' part): {ours[0]}")

    # The last complete checkpoint loads, by itself and into a fresh single-process run that
    # continues where the two-host job stopped (another layout: resharded on load).
    saved = int((ckpt / "latest").read_text().strip().split("_")[1])
    assert saved >= 2 and saved % 2 == 0, saved
    config, kind, state = checkpoint.load_full_state_dict(ckpt)
    assert kind == "gpt" and state and all(math.isfinite(float(t.float().abs().sum())) for t in state.values())
    resumed = tmp_path / "resumed.jsonl"
    code, err = _train_single(*MODEL, "--train-iters", "100000", "--load", str(ckpt),
                              "--exit-interval", str(saved + 2), "--metrics-file", str(resumed))
    assert code == 0, err[-3000:]
    after = records(resumed)
    assert [r["iteration"] for r in after] == [saved + 1, saved + 2], after
    # Where the two-host run logged those iterations before it died, the resumed run matches them.
    before = {r["iteration"]: r["loss"] for r in records(metrics)}
    for r in after:
        if r["iteration"] in before:
            assert abs(r["loss"] - before[r["iteration"]]) <= TOL * abs(before[r["iteration"]]), (r, before)


def test_a_partitioned_host_times_out(hosts, tmp_path):
    # host1's link goes down: no connection is closed, host0 learns only from time-outs. Every
    # collective and pipeline transfer must be bounded by --distributed-timeout-minutes.
    metrics = tmp_path / "m.jsonl"
    procs = _launch(hosts, tmp_path, [*MODEL, *LAYOUT, "--train-iters", "100000", "--distributed-timeout-minutes",
                                      LOST_HOST_TIMEOUT_MIN, "--metrics-file", str(metrics)])
    wait_for(lambda: metrics.exists() and len(records(metrics)) >= 3, 150,
              lambda: f"no 3 iterations in 150 s\n{_output(tmp_path, 0)}", procs)
    hosts[1].unplug()
    try:
        procs[0].wait(timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"host0 still running 90 s after host1 was cut off (limit 12 s)\n{_output(tmp_path, 0)}\n"
                    f"{_still_running(procs[0].pid)}")
    assert procs[0].returncode != 0
    err = (tmp_path / "host0.err").read_text(errors="replace")
    lines = [x for x in err.splitlines() if x.startswith("megalite: error: rank ")]
    assert lines and all("timed out" in x or "lost contact" in x for x in lines), err[-4000:]


# ---- two-node Slurm: slurmctld on the bridge, one slurmd per host --------------------------------

class SlurmNodes(SlurmTestCluster):
    script_name = "two_node_cluster.sh"

    def __init__(self, net: netns.Network, state: Path):
        super().__init__(state, slurmd_port="16828",  # inside the hosts: free, whatever the machine runs
                         PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME=netns.INNER_IFNAME, **net.env())
        self.env.pop("OMP_NUM_THREADS", None)  # the sbatch script sets it from the CPUs per rank


@pytest.fixture
def slurm_nodes(tmp_path_factory):
    _needs_netns()
    require_slurm()
    try:
        with netns.hosts(2, names=["node0", "node1"], tag="s") as net, \
                SlurmNodes(net, tmp_path_factory.mktemp("slurm-nodes")).started() as cluster:
            yield cluster
    except netns.NetnsError as e:
        pytest.fail(f"cannot create network-namespace hosts: {e}")


def test_sbatch_on_two_slurm_nodes_trains_like_one_process(slurm_nodes, tmp_path, reference):
    metrics = tmp_path / "m.jsonl"
    detail = slurm_nodes.sbatch_wait(tmp_path, "-N", "2", "--ntasks-per-node", "1", str(SLURM / "pretrain_gpt.sbatch"),
                                     *MODEL, *LAYOUT, *ITERS, "--metrics-file", str(metrics), timeout=240)
    log = job_log(tmp_path, tail=None)
    # Two nodes, rendezvous at the first node's Slurm name (resolved inside the hosts), 4 ranks.
    assert "on 2 node(s) x 2 ranks" in log and "rendezvous node0:" in log, log[-6000:]
    assert "4 ranks as tp=2 pp=2 dp=1" in log and "training step ended with exit code 0" in log, log[-6000:]
    _assert_same_losses(metrics, reference, detail)


# ---- the fixture and the scripts themselves --------------------------------------------------------------------------

def test_hosts_are_removed_on_error_and_stale_ones_at_start():
    _needs_netns()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale_ns, stale_br = f"mlt{dead.pid}h0", f"mlt{dead.pid}br"
    try:
        netns._ip("netns", "add", stale_ns)
        netns._ip("link", "add", stale_br, "type", "bridge")
    except netns.NetnsError as e:
        pytest.fail(f"cannot create a network namespace: {e}")
    with pytest.raises(RuntimeError, match="boom"):
        with netns.hosts(1, tag="u", check=False) as net:
            sleeper = net[0].popen(["sleep", "60"])
            raise RuntimeError("boom")
    assert sleeper.poll() is not None, "a process in the host outlived it"
    names = netns._ip("netns", "list").stdout + netns._ip("-o", "link", "show").stdout
    for gone in (stale_ns, stale_br, net[0].netns, net.bridge, net[0].veth):
        assert gone not in names, f"{gone} left behind"
    assert not os.path.exists(os.path.join(netns.NETNS_ETC, net[0].netns))


def test_shell_scripts_parse():
    for path in (SLURM / "two_node_cluster.sh", ROOT / ".ci" / "setup_netns.sh"):
        run = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert run.returncode == 0, f"{path}: {run.stderr}"
