"""The links of scripts/slow_links.py measured before its runs: one TCP stream's rate, gloo's
all-reduce bus bandwidth, an exchange's start-up, and the bytes a limited link's token bucket lets
through at once once it has idled (the planner's `Cluster.link_burst_kib`). Needs the hosts of
tests/netns.py (root)."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys

import netns  # (tests/, on the path slow_links.py sets)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout (its megalite)

_DROP_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS")


def _env(threads: int, ifname: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    if ifname:
        env["GLOO_SOCKET_IFNAME"] = ifname
    return env


_EXCHANGE = """
import os, sys, time, datetime, torch, torch.distributed as dist
rank, addr, port, numel, rounds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
idle, op = float(sys.argv[7]), sys.argv[8]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=int(sys.argv[6]),
                        timeout=datetime.timedelta(seconds=60))
x, y = torch.ones(numel), torch.empty(numel)
exchange = (lambda: dist.all_to_all_single(y, x)) if op == "all_to_all" else (lambda: dist.all_reduce(x))
exchange()  # connections made, buffers touched
times = []
for _ in range(rounds):
    start = time.perf_counter()
    # the link idles (a token bucket refills) while the rank computes, as in a run: a spin, since a
    # pinned core that slept wakes late (5-6 ms exchanges)
    while time.perf_counter() - start < idle:
        pass
    dist.barrier()
    t = time.perf_counter()
    exchange()
    times.append(time.perf_counter() - t)
assert op != "all_reduce" or x[0].item() == dist.get_world_size() ** (rounds + 1), x[0].item()
print(" ".join(map(repr, times)))
dist.destroy_process_group()
"""


def exchange_seconds(net: netns.Network, nbytes: int, rounds: int = 5, port: int = 29400,
                   timeout: float = 120, idle_s: float = 0.0, op: str = "all_reduce",
                   cpus: list[str] | None = None) -> list[float]:
    """Seconds of each of `rounds` plain gloo all-reduces (op="all_to_all": all-to-alls) of `nbytes`
    (fp32) over every host, one rank a host (torch.distributed, no megalite), as host 0 timed them,
    each after `idle_s` of the ranks computing (a spin: the link idles) and a barrier. A ring
    all-reduce sends 2 (n-1)/n of the bytes from each rank, an all-to-all (n-1)/n. `cpus`: host i's
    rank on cpus[i] (a taskset list), as --pin puts a run's ranks."""
    n = len(net)
    procs = [h.popen([*(["taskset", "-c", cpus[i]] if cpus else []), sys.executable, "-c", _EXCHANGE, str(i),
                      net[0].addr, str(port), str(nbytes // 4), str(rounds), str(n), str(idle_s), op],
                     env=_env(1, h.ifname), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, h in enumerate(net.hosts)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, (_out, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"{op} probe failed (exit {p.returncode}): {err.strip()[-800:]}")
    return [float(x) for x in outs[0][0].split()]


def measure_link(net: netns.Network, rate_mbit: float | None, nbytes: int = 4 << 20,
                 cpus: list[str] | None = None, probes: int = 12) -> dict:
    """The links at `rate_mbit` (None: unlimited) as one TCP stream and as gloo's all-reduce see them
    (bytes/s; the all-reduce's "bus bandwidth" is the planner's link bandwidth); the start-up of an
    exchange; the bytes a limited link's bucket lets through at once once it idles (`bucket_bytes`,
    its ranks on `cpus` as the runs' under --pin, pooled over `probes` pairs of connections)."""
    net.limit(netns.LinkLimit(rate_mbit) if rate_mbit else None)
    tcp = net.throughput(1, 0, nbytes=max(nbytes, int((rate_mbit or 0) * 1e6 / 8)))
    bus = nbytes / statistics.median(exchange_seconds(net, nbytes))
    latency = statistics.median(exchange_seconds(net, 4, rounds=30))  # one fp32: start-up alone
    burst = bucket_bytes(net, tcp, latency, probes=probes, cpus=cpus) if rate_mbit else 0.0
    what = f"tbf {rate_mbit:g} Mbit/s" if rate_mbit else "unlimited veth"
    share = f" ({tcp * 8 / 1e6 / rate_mbit:.2f} of the rate)" if rate_mbit else ""
    print(f"link, {what}: one TCP stream host1 -> host0 {tcp / 1e6:.2f} MB/s{share}; gloo all-reduce of "
          f"{nbytes >> 20} MiB: bus bandwidth {bus / 1e6:.2f} MB/s; of 4 bytes: {latency * 1e3:.3f} ms; "
          f"bucket {burst / 1e3:.0f} kB", file=sys.stderr)
    return {"tcp": tcp, "bus": bus, "latency": latency, "burst": burst}


def bucket_bytes(net: netns.Network, rate: float, latency: float, probes: int = 12, rounds: int = 40,
                 cpus: list[str] | None = None) -> float:
    """The bucket the planner's link (megalite.tools.plan.pair_play.Link) needs to give all-to-alls of
    256 KiB (an ep exchange's size in docs/slow-links.md: 128 KiB cross each way) after 20 ms of idle
    link their mean time here: an exchange after idling takes `latency` plus the bytes the bucket
    does not hold at `rate`, so the bucket is the bytes less what the rate carried in that time. By
    trimmed mean (a step's exchanges add up; after idling a third to a half of them still take the
    full time), pooled over `probes` pairs of fresh connections (what one saves varies from one to
    the next: 0-50 kB); the ranks on `cpus`, as the runs' under --pin."""
    crossing = 1 << 17
    idle = [t for _ in range(probes)
            for t in exchange_seconds(net, 2 * crossing, rounds=rounds, idle_s=0.02, op="all_to_all", cpus=cpus)]
    return min(float(crossing), max(0.0, crossing - (_trimmed_mean(idle) - latency) * rate))


def _trimmed_mean(values: list[float]) -> float:
    """The mean without the tenth at each end (a rare exchange that stalls for tens of ms)."""
    cut = len(values) // 10
    return statistics.mean(sorted(values)[cut:len(values) - cut])


_ATTENTION = """
import sys, time, torch
from megalite.parallel.context_parallel import _block_backward, _block_forward
batch, groups, per_group, local, dim, rounds = map(int, sys.argv[1:7])
torch.set_num_threads(1)
torch.manual_seed(0)
q = torch.randn(batch, groups, per_group, local, dim)
k, v = torch.randn(batch, groups, local, dim), torch.randn(batch, groups, local, dim)
scale, half = dim ** -0.5, local // 2
out, lse = _block_forward(q, k, v, scale, True)
d_out = torch.randn_like(out)
delta = (d_out * out).sum(-1)
def piece(rows):
    return _block_backward(q[:, :, :, rows], k, v, d_out[:, :, :, rows], lse[:, :, :, rows], delta[:, :, :, rows],
                           scale, True, None, rows.start)
work = {"forward": lambda: _block_forward(q, k, v, scale, True),
        "backward": lambda: (piece(slice(0, half)), piece(slice(half, local)))}
for name, run in work.items():
    run()  # (allocations, caches)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    print(min(times) / (1 if name == "forward" else 2))  # the least: other work only ever adds time
"""


def attention_block_seconds(batch: int, heads: int, groups: int, local: int, head_dim: int, cpu: str | None = None,
                            rounds: int = 15) -> tuple[float, float]:
    """(forward, backward) seconds of one attention block of context parallelism's ring as the planner
    counts it (megalite.tools.plan.ring_items): this rank's `local` queries against its own `local`
    keys, causal (the forward step's block), and a backward piece, half of the own block's rows (the
    pieces the K/V and dK/dV transfers hide behind at cp 2; the mean of the two halves), in fp32, with
    megalite's own block code on one thread (on `cpu` (a taskset list), as --pin puts a rank), the
    least of `rounds` (a median moved 46-66 ms between runs on a noisy host): the planner's
    Cluster.attention_speed at the fitted rate (calibrate.attention_speeds)."""
    cmd = [*(["taskset", "-c", cpu] if cpu else []), sys.executable, "-c", _ATTENTION,
           *map(str, (batch, groups, heads // groups, local, head_dim, rounds))]
    env = _env(1, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"attention block probe failed (exit {run.returncode}): {run.stderr.strip()[-800:]}")
    forward, backward = map(float, run.stdout.split())
    return forward, backward
