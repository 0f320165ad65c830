"""How long each kind of gloo exchange takes between two network-namespace hosts, across a tc-tbf
link and on bare veths: the distribution (median, 90th percentile, share over a threshold) of every
collective megalite issues, and of megalite's own reduce-scatter (megalite.parallel.collectives)
beside gloo's. The measurements behind docs/slow-links.md (f), "Where the per-exchange cost goes".
Needs root (network namespaces) and iproute2.

    sudo python scripts/gloo_exchanges.py --rate-mbit 300 --sizes 65536,4194304 --calls 30 [--json out.json]

Each call of a kind is timed on rank 0 after a barrier, so a figure is the whole exchange, both
ranks' parts; --pin puts rank i on core i, --idle-ms sleeps between calls (a link gone idle, as
between two steps' exchanges).

    sudo python scripts/gloo_exchanges.py --overlap --rate-mbit 300 --sizes 1048576 --calls 10

    sudo python scripts/gloo_exchanges.py --lag-ms 20 --kinds all_to_all,recv_send --sizes 262144,2097152 --pin

--lag-ms L brings rank 1 to each call L ms after rank 0 (a spin after the barrier), and gives each
rank's own time of the call: whether the bytes flow before both ranks have posted it (the late rank
would wait L less) or only after (it waits for the whole transfer, the early rank for the lag as
well): for one exchange, the least wait any rank had is the transfer. Summed over a step's many
exchanges that reads too little (--chain).

--chain N plays a step's worth of overlapped exchanges: per call N all-to-alls, each launched after
--before-ms of compute and waited for after --hide-ms more, every compute piece a spin whose length
each rank draws apart (uniform within +/- --jitter-ms), then a blocking all-reduce (the step's end).
A spin takes the same wall time beside a transfer as without one, so what the link adds to the step
(across less bare) is communication alone, and it is the reading a wait count must give: the table
puts beside it the sum over exchanges of the least wait any rank had, and the least over ranks of a
rank's total wait (what scripts/slow_links.py reads off a step's timeline).

    sudo python scripts/gloo_exchanges.py --chain 40 --sizes 262144 --hide-ms 5 --jitter-ms 2 --pin

--overlap measures what an exchange in flight costs the compute beside it: each rank times a block of matmuls alone, the exchange alone, and the
block run while the exchange (launched with async_op=True just before) is in flight, then waits for
the exchange. Per kind and size: the block's slowdown over the exchange's time alone (the tax), and
the share of the exchange that hid (1 - (launch-to-done - block alone) / exchange alone).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("all_reduce", "reduce_scatter_gloo", "reduce_scatter_megalite", "all_gather", "all_gather_megalite",
         "all_to_all", "send_recv", "recv_send", "broadcast")


def _exchanges(rank: int, n: int) -> dict:
    import torch
    import torch.distributed as dist

    from megalite.parallel import collectives

    x, y = torch.ones(n), torch.empty(n)
    half, whole = torch.empty(n // 2), torch.empty(2 * n)
    return {"all_reduce": lambda: dist.all_reduce(x),
            "reduce_scatter_gloo": lambda: collectives._native_reduce_scatter(half, x),
            "reduce_scatter_megalite": lambda: collectives.reduce_scatter_single(half, x),
            "all_gather": lambda: collectives._native_all_gather(whole, x),
            "all_gather_megalite": lambda: collectives.all_gather_single(whole, x),
            "all_to_all": lambda: dist.all_to_all_single(y, x),
            # one exchange each way, the send posted first / the receive first (megalite's order)
            "send_recv": lambda: [w.wait() for w in (dist.isend(x, 1 - rank), dist.irecv(y, 1 - rank))],
            "recv_send": lambda: [w.wait() for w in (dist.irecv(y, 1 - rank), dist.isend(x, 1 - rank))],
            "broadcast": lambda: dist.broadcast(x, 0)}


def _async_exchanges(rank: int, n: int) -> dict:
    """Each overlappable kind launched with async_op=True: returns its Work."""
    import torch
    import torch.distributed as dist

    from megalite.parallel import collectives

    x, y = torch.ones(n), torch.empty(n)
    half, whole = torch.empty(n // 2), torch.empty(2 * n)
    return {"all_reduce": lambda: dist.all_reduce(x, async_op=True),
            "reduce_scatter_megalite": lambda: collectives.reduce_scatter_single(half, x, async_op=True),
            "all_gather": lambda: collectives._native_all_gather(whole, x, async_op=True),
            "all_gather_megalite": lambda: collectives.all_gather_single(whole, x, async_op=True),
            "all_to_all": lambda: dist.all_to_all_single(y, x, async_op=True)}


def overlap_main(a) -> list[dict]:
    """One rank's --overlap figures: per kind and size the medians over a.calls of the block alone,
    the exchange alone, the block with the exchange in flight and the exchange's launch to done."""
    import torch
    import torch.distributed as dist

    w = torch.randn(256, 256)
    h = torch.randn(256, 256)

    def block():  # a.block_iters matmuls, the same work every call
        out = h
        for _ in range(a.block_iters):
            out = torch.tanh(out @ w)
        return out

    def timed(fn) -> float:
        dist.barrier()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    out = []
    for nbytes in a.sizes:
        for kind, launch in _async_exchanges(a.rank, max(2, nbytes // 4)).items():
            if a.kinds and kind not in a.kinds:
                continue
            launch().wait()  # connections made, buffers touched
            alone, xch, beside, total = [], [], [], []
            for _ in range(a.calls):
                alone.append(timed(block))
                xch.append(timed(lambda: launch().wait()))
                dist.barrier()
                t = time.perf_counter()
                work = launch()
                block()
                beside.append((time.perf_counter() - t) * 1e3)
                work.wait()
                total.append((time.perf_counter() - t) * 1e3)
            med = statistics.median
            b0, x0, b1, t1 = med(alone), med(xch), med(beside), med(total)
            out.append({"kind": kind, "bytes": nbytes, "block_ms": b0, "exchange_ms": x0, "block_beside_ms": b1,
                        "launch_to_done_ms": t1, "tax": (b1 - b0) / x0 if x0 > 0 else None,
                        "hidden": 1 - (t1 - b0) / x0 if x0 > 0 else None})
    return out


def chain_main(a) -> list[dict]:
    """One rank's --chain figures: per size and call its waits (each exchange's and the end's), its
    compute and the step; rank 0 returns every rank's, per size the medians over calls of the step
    and of the readings of its waits."""
    import random

    import torch
    import torch.distributed as dist

    rng = random.Random(1000 + a.rank)  # each rank draws its own lengths

    def spin(ms: float) -> float:
        ms = max(0.0, ms + rng.uniform(-a.jitter_ms, a.jitter_ms))
        start = time.perf_counter()
        while time.perf_counter() - start < ms / 1e3:
            pass
        return ms

    out = []
    for nbytes in a.sizes:
        x, y, end = torch.ones(max(2, nbytes // 4)), torch.empty(max(2, nbytes // 4)), torch.ones(1)
        dist.all_to_all_single(y, x)  # connections made, buffers touched
        calls = []
        for _ in range(a.calls):
            dist.barrier()
            t0, waits, compute = time.perf_counter(), [], 0.0
            for _ in range(a.chain):
                compute += spin(a.before_ms)
                work = dist.all_to_all_single(y, x, async_op=True)
                compute += spin(a.hide_ms)
                t = time.perf_counter()
                work.wait()
                waits.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            dist.all_reduce(end)
            waits.append((time.perf_counter() - t) * 1e3)
            calls.append([(time.perf_counter() - t0) * 1e3, compute, *waits])
        mine = torch.tensor(calls, dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        out.append({"bytes": nbytes, **chain_readings(torch.stack(every).tolist())})
    return out


def chain_readings(every: list) -> dict:
    """--chain's medians over calls from every rank's [call][step ms, compute ms, wait ms...]: the
    step (the last rank's), the most compute any rank did, and three readings of the waits: the sum
    over exchanges of the least any rank had ("per_exchange_least_ms", slow_links' waited_by_all),
    the least over ranks of a rank's total ("least_total_ms": the rank with the most compute), and
    the mean over ranks of it."""
    med = statistics.median
    calls = list(zip(*every))  # per call, every rank's row
    totals = [[sum(row[2:]) for row in call] for call in calls]
    return {"step_ms": med(max(row[0] for row in call) for call in calls),
            "compute_ms": med(max(row[1] for row in call) for call in calls),
            "per_exchange_least_ms": med(sum(map(min, zip(*(row[2:] for row in call)))) for call in calls),
            "least_total_ms": med(min(t) for t in totals),
            "mean_total_ms": med(statistics.mean(t) for t in totals)}


def rank_main(a) -> None:
    """One of the two ranks: time every kind at every size, rank 0 prints the figures as JSON."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{a.addr}:{a.port}", rank=a.rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    if a.overlap or a.chain:
        out = overlap_main(a) if a.overlap else chain_main(a)
        if a.rank == 0:
            print(json.dumps(out))
        dist.destroy_process_group()
        return
    out = []
    for nbytes in a.sizes:
        for kind, fn in _exchanges(a.rank, max(2, nbytes // 4)).items():
            if a.kinds and kind not in a.kinds:
                continue
            fn()  # connections made, buffers touched
            ms = []
            for _ in range(a.calls):
                dist.barrier()
                if a.idle_ms:
                    time.sleep(a.idle_ms / 1e3)
                start = time.perf_counter()
                while a.rank == 1 and time.perf_counter() - start < a.lag_ms / 1e3:
                    pass  # (a spin: a pinned core that slept wakes late)
                t = time.perf_counter()
                fn()
                ms.append((time.perf_counter() - t) * 1e3)
            ms.sort()
            row = {"kind": kind, "bytes": nbytes, "median_ms": statistics.median(ms), "min_ms": ms[0],
                   "p90_ms": ms[(9 * len(ms)) // 10], "max_ms": ms[-1], "over_2ms": sum(m > 2.0 for m in ms) / len(ms)}
            if a.lag_ms:  # the late rank's own median beside rank 0's
                late = torch.tensor([statistics.median(ms)], dtype=torch.float64)
                dist.broadcast(late, 1)
                row.update(lag_ms=a.lag_ms, late_median_ms=late.item())
            out.append(row)
    if a.rank == 0:
        print(json.dumps(out))
    dist.destroy_process_group()


def measure(rate_mbit: float | None, a) -> list[dict]:
    sys.path[:0] = [str(ROOT / "tests")]
    import netns

    with netns.hosts(2, tag="g") as net:
        net.limit(netns.LinkLimit(rate_mbit) if rate_mbit else None)
        env = {**os.environ, "GLOO_SOCKET_IFNAME": net[0].ifname, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        argv = ["--sizes", ",".join(map(str, a.sizes)), "--calls", str(a.calls), "--idle-ms", str(a.idle_ms),
                "--kinds", ",".join(a.kinds or KINDS), "--addr", net[0].addr, "--port", "29431",
                "--block-iters", str(a.block_iters), "--lag-ms", str(a.lag_ms), *(["--overlap"] if a.overlap else []),
                "--chain", str(a.chain), "--before-ms", str(a.before_ms), "--hide-ms", str(a.hide_ms),
                "--jitter-ms", str(a.jitter_ms)]
        procs = [h.popen([*(["taskset", "-c", str(i % os.cpu_count())] if a.pin else []), sys.executable, __file__,
                          "--rank", str(i), *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i, h in enumerate(net.hosts)]
        outs = [p.communicate(timeout=a.timeout) for p in procs]
        for p, (_, err) in zip(procs, outs):
            if p.returncode != 0:
                raise SystemExit(f"gloo_exchanges: a rank failed (exit {p.returncode}): {err.strip()[-800:]}")
        return json.loads(outs[0][0].strip().splitlines()[-1])


def table(rows: list[dict], where: str) -> str:
    if rows and "least_total_ms" in rows[0]:
        lines = [f"{where}:", f"  {'bytes':>9s} {'step ms':>9s} {'compute':>9s} {'per exchange least':>19s} "
                 f"{'least total':>12s} {'mean total':>11s}"]
        lines += [f"  {r['bytes']:>9d} {r['step_ms']:9.2f} {r['compute_ms']:9.2f} {r['per_exchange_least_ms']:19.2f} "
                  f"{r['least_total_ms']:12.2f} {r['mean_total_ms']:11.2f}" for r in rows]
        return "\n".join(lines)
    if rows and "tax" in rows[0]:
        lines = [f"{where}:", f"  {'kind':24s} {'bytes':>9s} {'block ms':>9s} {'exchange':>9s} {'beside':>9s} "
                 f"{'done':>9s} {'tax':>6s} {'hidden':>7s}"]
        lines += [f"  {r['kind']:24s} {r['bytes']:>9d} {r['block_ms']:9.2f} {r['exchange_ms']:9.2f} "
                  f"{r['block_beside_ms']:9.2f} {r['launch_to_done_ms']:9.2f} {r['tax']:6.2f} {100 * r['hidden']:6.0f}%"
                  for r in rows]
        return "\n".join(lines)
    late = bool(rows) and "late_median_ms" in rows[0]
    head = f"  {'kind':24s} {'bytes':>9s} {'median ms':>10s} {'min':>8s} {'p90':>8s} {'max':>8s} {'>2 ms':>6s}"
    lines = [f"{where}:", head + (f" {'late rank':>10s}" if late else "")]
    lines += [f"  {r['kind']:24s} {r['bytes']:>9d} {r['median_ms']:10.2f} {r['min_ms']:8.2f} {r['p90_ms']:8.2f} "
              f"{r['max_ms']:8.2f} {100 * r['over_2ms']:5.0f}%" + (f" {r['late_median_ms']:10.2f}" if late else "")
              for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate-mbit", type=float, default=300.0, help="the link's rate (0: only the bare veths)")
    ap.add_argument("--sizes", default="65536,4194304", help="bytes of each rank's tensor, comma-separated")
    ap.add_argument("--calls", type=int, default=30, help="timed calls of each kind and size")
    ap.add_argument("--kinds", default=None, help=f"some of {','.join(KINDS)} (default: all)")
    ap.add_argument("--idle-ms", type=float, default=0.0, help="sleep between calls")
    ap.add_argument("--pin", action="store_true", help="rank i on core i")
    ap.add_argument("--lag-ms", type=float, default=0.0,
                    help="rank 1 comes to each call this late; the table adds its own median (the late rank)")
    ap.add_argument("--overlap", action="store_true",
                    help="time a block of matmuls with each exchange in flight (the compute a transfer takes)")
    ap.add_argument("--block-iters", type=int, default=40, help="--overlap: 256x256 matmuls in the block")
    ap.add_argument("--chain", type=int, default=0,
                    help="a step of this many overlapped all-to-alls per call, read as slow_links reads waits")
    ap.add_argument("--before-ms", type=float, default=2.0, help="--chain: compute before each launch")
    ap.add_argument("--hide-ms", type=float, default=5.0, help="--chain: compute between a launch and its wait")
    ap.add_argument("--jitter-ms", type=float, default=0.0, help="--chain: each rank's compute pieces vary this much")
    ap.add_argument("--no-bare", action="store_true", help="skip the bare veths")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # a rank's own process
    ap.add_argument("--addr", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.sizes = [int(s) for s in str(a.sizes).split(",")]
    a.kinds = a.kinds.split(",") if a.kinds else None
    if a.overlap:  # the kinds launched with async_op=True (_async_exchanges)
        overlappable = ["all_reduce", "reduce_scatter_megalite", "all_gather", "all_gather_megalite", "all_to_all"]
        a.kinds = a.kinds or overlappable
        if [k for k in a.kinds if k not in overlappable] or a.idle_ms:
            raise SystemExit(f"--overlap times {', '.join(overlappable)} only, without --idle-ms")
    if a.chain and (a.overlap or a.lag_ms or a.idle_ms):
        raise SystemExit("--chain plays its own step: without --overlap, --lag-ms or --idle-ms")
    unknown = [k for k in a.kinds or () if k not in KINDS]
    if unknown:
        raise SystemExit(f"--kinds: unknown {', '.join(unknown)} (the kinds are {', '.join(KINDS)})")
    if a.rank is not None:
        rank_main(a)
        return 0
    results = {}
    if a.rate_mbit:
        results[f"tbf {a.rate_mbit:g} Mbit/s"] = measure(a.rate_mbit, a)
    if not a.no_bare:
        results["bare veths"] = measure(None, a)
    for where, rows in results.items():
        print(table(rows, where))
    if a.chain and len(results) == 2:  # what the link adds, by the step and by each reading
        across, bare = results.values()
        for x, y in zip(across, bare):
            added = {k: x[k] - y[k] for k in ("step_ms", "per_exchange_least_ms", "least_total_ms", "mean_total_ms")}
            print(f"  {x['bytes']} bytes, the link adds: step {added['step_ms']:.2f} ms; waits read per exchange "
                  f"{added['per_exchange_least_ms']:.2f}, by the least total {added['least_total_ms']:.2f}, "
                  f"by the mean total {added['mean_total_ms']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                            "cpus": os.cpu_count(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
