"""A link with a token bucket (tc-tbf, the emulated link of docs/slow-links.md) in the planner's ep
plays: `pair_play.Link`, `Cluster.link_burst_kib`, and what the hidden suite feeds them."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from megalite.models import preset
from megalite.tools import plan as P
from megalite.tools.plan.ep_bound import ep_bound_of
from megalite.tools.plan.exposed import link_bucket, pair_items, pass_counts
from megalite.tools.plan.pair_play import Bucket, Link, alone_exposed, pair_exposed, played_pair

MOE = preset("moe-tiny")
RUN = P.Run(16, 64, "fp32", 200_000, overlap_moe_ep_comm=True)
# one GPU a node, 0.1 GB/s: bytes decide each exchange, and compute takes about as long
NARROW = P.Cluster(gpus=2, gpus_per_node=1, inter_node_gbps=0.1, peak_tflops=0.01, efficiency=1,
                   collective_latency_ms=0.05)


def test_the_bucket_lets_its_bytes_through_at_once_and_refills_while_the_link_idles():
    link = Link(Bucket(burst=2.0, latency=0.5))  # 2 s of the rate's bytes; each exchange starts after 0.5
    assert link.carry(0.0, 3.5) == 1.5  # bytes 0.5-3.5 at the rate, 2 of them at once: done at 1.5
    assert link.carry(1.5, 3.5) == 4.5  # right after: 0.5 refilled during the start-up
    assert link.carry(10.0, 3.5) == 11.5  # idle long enough: full again (never more than the burst)
    assert link.carry(20.0, 1.5) == 20.5  # a transfer smaller than the bucket: all at once, 1 left
    assert link.carry(20.5, 1.5) == 21.0  # 1 + 0.5 refilled: again all at once
    assert link.carry(21.0, 0.5) == 21.5  # all start-up (the counts): the bucket plays no part
    plain = Link()
    assert plain.carry(3.0, 2.0) == 5.0 and plain.carry(5.0, 2.0) == 7.0  # a real fabric: seconds as given


def test_the_plays_with_a_bucket():
    forward, backward = [(1.0, 3.0), (1.0, 0.0)], [(2.0, 1.0)]
    # no bucket: the plays as before (F 0-1, its exchange 1-4; B 1-3, its exchange 4-5; F 4-5)
    assert played_pair(forward, backward) == played_pair(forward, backward, 0.0, Bucket()) == 5.0
    # a bucket of 2: F's exchange 1-2; B 1-3, its exchange at 3 finds 1 refilled: done at 3; F 3-4
    assert played_pair(forward, backward, bucket=Bucket(2.0, 0.0)) == 4.0
    assert pair_exposed(forward, backward, bucket=Bucket(2.0, 0.0)) == 0.0
    # alone: compute 1, exchange 3 (2 at once: done at 2), compute 3 (to 5, the bucket full again),
    # exchange 4 (done at 7): 3 exposed of 7
    assert alone_exposed([(1.0, 3.0), (3.0, 4.0)]) == 7.0
    assert alone_exposed([(1.0, 3.0), (3.0, 4.0)], bucket=Bucket(2.0, 0.0)) == 3.0
    # back to back the bucket saves only its first fill
    assert alone_exposed([(0.0, 3.0), (0.0, 3.0), (0.0, 0.0)], bucket=Bucket(2.0, 0.0)) == 4.0


def test_the_planner_carries_ep_exchanges_through_the_links_bucket():
    layout = P.Layout(dp=2, ep=2, micro_batch_size=2)
    plain = P.predict(MOE, layout, NARROW, run=RUN)
    assert link_bucket(plain.costs) == Bucket()
    x = plain.exposed["ep"]
    bucketed = {kib: P.predict(MOE, layout, replace(NARROW, link_burst_kib=kib), run=RUN).exposed["ep"]
                for kib in (0.0, 8.0, 16.0, 32.0, 1e6)}
    assert bucketed[0.0] == x  # no bucket: the prediction as it was
    # the same bytes and exchanges; less exposed as the bucket grows
    assert all(b.bytes == x.bytes and b.exchanges == x.exchanges and b.comm == x.comm for b in bucketed.values())
    assert x.exposed > bucketed[8.0].exposed > bucketed[16.0].exposed > bucketed[32.0].exposed
    # a bucket larger than any exchange: only what the start-ups leave exposed
    assert bucketed[32.0].exposed == pytest.approx(bucketed[1e6].exposed) and bucketed[1e6].exposed < x.exposed / 4
    big = P.predict(MOE, layout, replace(NARROW, link_burst_kib=16.0), run=RUN)
    assert link_bucket(big.costs).burst == pytest.approx(16 * 1024 / big.costs.bw_ep)
    # the bound (ep_bound.py) stays below the play: each exchange as short as the bucket could make it
    bound, (forward, backward) = ep_bound_of(big), pair_items(big.costs, big.stages[0])
    pairs = pass_counts(big.costs, 0)[0]
    assert 0 < bound["pairs"] <= pairs * pair_exposed(forward, backward, bucket=link_bucket(big.costs)) * (1 + 1e-9)
    assert bound["pairs"] < ep_bound_of(plain)["pairs"]  # (and below the bound without the bucket)
    # every pass alone (no pairs) is played with the bucket too
    alone = P.predict(MOE, layout, replace(NARROW, link_burst_kib=16.0), run=replace(RUN, overlap_moe_ep_comm=False))
    assert alone.exposed["ep"].exposed < alone.exposed["ep"].comm
    with pytest.raises(ValueError, match="link_burst_kib must be >= 0"):
        replace(NARROW, link_burst_kib=-1.0)


def test_the_command_line_takes_the_bucket(capsys):
    args = ["--model", "moe-tiny", "--gpus", "2", "--gpus-per-node", "1", "--global-batch-size", "16",
            "--seq-length", "64", "--inter-node-gbps", "0.1", "--peak-tflops", "0.01", "--efficiency", "1",
            "--ep", "2", "--pp", "1", "--overlap-moe-expert-parallel-comm", "--json"]
    best = {}
    for kib in ("0", "16"):
        P.main([*args, "--link-burst-kib", kib])
        out = json.loads(capsys.readouterr().out)
        assert out["cluster"]["link_burst_kib"] == float(kib)
        best[kib] = min(b["exposed_comm"]["ep"]["exposed_s"] for b in out["best"])
    assert best["16"] < best["0"]
    with pytest.raises(SystemExit):
        P.main([*args, "--link-burst-kib", "-1"])
    assert "link_burst_kib must be >= 0" in capsys.readouterr().err
