"""The hidden suite's predictions (scripts/slow_links.py --suite hidden): beside each dimension's
measured exposure, what megalite's planner predicts for the same run on the links as measured."""
from __future__ import annotations

import os
import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # slow_links imports the suites, which import this module: the types only
    from slow_links import RunResult


def _last(words: list[str], flag: str, default: int) -> int:
    """The value argparse takes for `flag` from `words`: the last given."""
    given = [words[i + 1] for i, w in enumerate(words[:-1]) if w == flag]
    return int(given[-1]) if given else default


def reference_run(dim: str, flags: str) -> str | None:
    """The run `dim`'s compute rate is fitted to (megalite.tools.plan.calibrate.Reference), where its
    bare run's exchanges cost the ranks time of their own that covers no transfer: tp's pieces at one
    piece a shard (on the bare veths); dp and ZeRO-3 on one rank with one rank's work (half the global
    batch, no ZeRO: no reduction, gather or release). None where the bare run is the reference."""
    words = shlex.split(flags)
    if dim == "tp" and _last(words, "--tp-comm-overlap-splits", 1) > 1:
        return f"tp-ref=rate=off {flags} --tp-comm-overlap-splits 1"
    if dim in ("dp", "zero3"):
        half = _last(words, "--global-batch-size", 2) // 2
        no_zero = " --zero-stage 0" if dim == "zero3" else ""
        return f"{dim}-ref=hosts=1 rate=off {flags} --global-batch-size {half}{no_zero}"
    return None


def attention_blocks(a, dim: str, pred) -> tuple[float, float] | None:
    """Seconds of one attention block of `pred`'s ring (forward, backward piece) for the planner's
    attention speeds: what a saved run measured (`a.saved_derived`, re-deriving it), or, in a live
    suite (`a.probe_compute`), measured now (slow_links_probe.attention_block_seconds, on the first
    ranks' CPU under --pin); None: neither (the blocks at the layer's average rate)."""
    ms = getattr(a, "saved_derived", {}).get("dimensions", {}).get(dim, {}).get("attention_block_ms")
    if ms:
        return ms[0] / 1e3, ms[1] / 1e3
    if not getattr(a, "probe_compute", False):
        return None
    from slow_links_probe import attention_block_seconds

    config, layout, tp = pred.config, pred.layout, pred.layout.tp
    heads = config.num_attention_heads // tp
    groups = (config.num_query_groups or config.num_attention_heads) // tp
    cpu = str(min(os.sched_getaffinity(0))) if getattr(a, "pin", False) else None
    return attention_block_seconds(layout.micro_batch_size, heads, groups, pred.run.seq_length // layout.cp,
                                   config.head_dim, cpu)


def hidden_predictions(a, results: dict[str, RunResult], links: dict, derived: dict) -> None:
    """Beside each measured dimension of `derived` (hidden_overlap's), the planner's prediction of what
    the link adds to its step (megalite.tools.plan.calibrate): its layout from the run's flags, every
    group across the link, the links' measured one-stream rate and per-exchange latency (the small
    all-reduce of measure_link, or --exchange-latency-ms), their tbf bucket (measure_link's, or
    slow_links_rederive.py's --link-burst-kib), the compute fitted to the bare run's step, or to the
    dimension's reference run where it has one (`<dim>-ref`: reference_run).
    A run with --overlap-moe-expert-parallel-comm is predicted with that overlap. Adds
    "predicted_exposed_ms", "predicted_over_measured", "predicted_over_waited" (where the row has the
    timeline's waits: slow_links_waits) and "predicted" (the details) to each row, or
    "predicted_error". A run with context parallelism is predicted with its attention blocks'
    measured seconds (attention_blocks; "attention_block_ms" in the row)."""
    from megalite import arguments
    from megalite.tools.plan import Cluster
    from megalite.tools.plan.calibrate import MeasuredLink, Reference, predicted_link_cost
    from megalite.training.plan_check import check_run
    from netns_tools import LinkLimit
    from slow_links_suites import suite_runs  # (that module imports this one)
    from slow_links_waits import predicted_over_waited

    parser = arguments.build_parser("slow_links", default_model="gpt-tiny")
    common = getattr(a, "common_flags", None) or suite_runs(a)[0]
    override, burst_kib = getattr(a, "exchange_latency_ms", None), getattr(a, "link_burst_kib", None)

    def measured(rate):
        link = links[rate]
        # a --json saved before measure_link measured the bucket: the suite's configured one
        burst = link.get("burst", LinkLimit(rate).burst_bytes if rate else 0.0)
        burst = burst if burst_kib is None or rate is None else burst_kib * 1024
        return MeasuredLink(link["tcp"], override / 1e3 if override is not None else link.get("latency", 0.0), burst)

    def planned(spec):
        world = spec.hosts * spec.nproc
        args = parser.parse_args([*common, *spec.flags])
        return check_run(args, world, gpu_memory_bytes=1e15, cluster=Cluster(gpus=world, gpus_per_node=1))[1]

    derived["exchange_latency_ms"] = {str(k): (override if override is not None else v.get("latency", 0.0) * 1e3)
                                      for k, v in links.items()}
    for dim, row in derived.get("dimensions", {}).items():
        across, bare = results.get(f"{dim}-across"), results.get(f"{dim}-bare")
        if "comm_ms" not in row or across.spec.rate_mbit not in links or bare.spec.rate_mbit not in links:
            continue
        try:
            pred = planned(across.spec)
            reference = None
            if "step_reference_ms" in row:  # the compute fitted to the reference run (reference_run)
                ref = results[f"{dim}-ref"]
                of_ref = planned(ref.spec)
                reference = Reference(of_ref.layout, of_ref.run, row["step_reference_ms"] / 1e3,
                                      measured(ref.spec.rate_mbit) if ref.spec.rate_mbit in links
                                      else MeasuredLink(1e18, 0.0))  # one rank: no link
            blocks = attention_blocks(a, dim, pred) if pred.layout.cp > 1 else None
            if blocks:
                row["attention_block_ms"] = [x * 1e3 for x in blocks]
            # the run's --tp-comm-overlap and --overlap-moe-expert-parallel-comm come with its flags
            got = predicted_link_cost(pred.config, pred.layout, pred.run, measured(across.spec.rate_mbit),
                                      measured(bare.spec.rate_mbit), row["step_bare_ms"] / 1e3, reference,
                                      attention_block_s=blocks)
        except (ValueError, SystemExit) as e:
            row["predicted_error"] = f"the planner: {e}"
            continue
        row["predicted"] = got
        row["predicted_exposed_ms"] = got["exposed_ms"]
        row["predicted_over_measured"] = got["exposed_ms"] / row["exposed_ms"] if row["exposed_ms"] > 0 else None
        predicted_over_waited(row)
        if "bound_exposed_ms" in got:  # the least any order of the passes exposes, less the bare links' play
            bare_ms = sum(d["exposed_bare_ms"] for d in got["dimensions"].values())
            row["bound_exposed_ms"] = got["bound_exposed_ms"]["exposed"] - bare_ms
            row["bound_hidden"] = 1 - row["bound_exposed_ms"] / row["comm_ms"]
