"""The suites of scripts/slow_links.py: the runs of each measurement of docs/slow-links.md and what is
derived from their results (RunResult, the links as measured). The derivations are plain functions
of those, testable without root or a network (tests/test_slow_links.py)."""
from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # slow_links imports this module: the types only
    from slow_links import RunResult, RunSpec

from slow_links_predict import hidden_predictions, reference_run  # (beside this file)
from slow_links_waits import WAIT_KINDS, add_waits, waits_lines

SUITES = ("overlap", "bf16", "planner", "diloco", "moe", "hidden", "pairs")


def _model(a) -> list[str]:
    return ["--model", a.model, "--seq-length", str(a.seq_length), *(["--hidden-size", str(a.hidden_size)]
                                                                     if a.hidden_size else [])]


def suite_runs(a) -> tuple[list[str], list[str]]:
    """(common flags, run specs) of suite a.suite."""
    model, it = _model(a), ["--train-iters", str(a.iters), "--log-interval", "1"]
    noeval = ["--eval-iters", "0"]
    b = a.micro_batch_size or (16 if a.suite == "overlap" else 8)
    if a.suite == "overlap":  # one micro-batch a step, so the whole backward can hide the reduction
        common = ["--mock-data", *model, *it, *noeval, "--micro-batch-size", str(b), "--ddp-bucket-size", str(a.bucket)]
        return common, [f"compute=solo=1 rate=off timeline=1 --global-batch-size {b}",
                        f"overlap=timeline=1 --global-batch-size {2 * b}",  # megalite's default: during backward
                        f"no-overlap=timeline=1 --global-batch-size {2 * b} --overlap-grad-reduce false",
                        # the reduction's start held back to the end of backward by one bucket for everything
                        f"one-bucket=timeline=1 --global-batch-size {2 * b} --ddp-bucket-size 1000000000"]
    if a.suite == "bf16":
        common = ["--mock-data", *model, *it, *noeval, "--micro-batch-size", str(b), "--global-batch-size", str(2 * b),
                  "--ddp-bucket-size", str(a.bucket)]
        return common, ["fp32-wire=timeline=1 --grad-reduce-dtype fp32",
                        "bf16-wire=timeline=1 --grad-reduce-dtype bf16"]
    if a.suite == "planner":
        g = 4 * b
        common = ["--mock-data", *model, *it, *noeval, "--micro-batch-size", str(b), "--global-batch-size", str(g),
                  "--ddp-bucket-size", str(a.bucket)]
        return common, ["compute=solo=1 rate=off", "tp2-across=--tp 2", "pp2-across=--pp 2", "dp2-across=",
                        # the same on the bare veths: what the layouts cost without the slow link
                        "tp2-fast=rate=off --tp 2", "pp2-fast=rate=off --pp 2", "dp2-fast=rate=off"]
    if a.suite == "moe":  # expert parallelism across the link against data parallelism of the experts
        common = ["--mock-data", *model, *it, *noeval, "--micro-batch-size", str(b), "--global-batch-size", str(4 * b),
                  "--ddp-bucket-size", str(a.bucket), *MOE_FLAGS,
                  # every byte exposed, as the formula counts it: the reduction after backward, not during
                  "--overlap-grad-reduce", "false"]
        return common, ["ep2-across=--ep 2", "ep2-fast=rate=off --ep 2", "ep1-across=", "ep1-fast=rate=off"]
    if a.suite == "hidden":  # each dimension's own batch and sequence flags: hidden_runs
        return ["--mock-data", *model, *it, *noeval, "--ddp-bucket-size", str(a.bucket)], hidden_runs(a, b)
    if a.suite == "pairs":  # pp 2 x ep 2, one rank a host (--hosts 4): every group crosses a link
        common = ["--mock-data", *model, *it, *noeval, "--ddp-bucket-size", str(a.bucket), *MOE_FLAGS,
                  "--pp", "2", "--expert-model-parallel-size", "2", "--micro-batch-size", str(max(1, b // 4)),
                  "--global-batch-size", str(4 * b)]  # 8 micro-batches a pipeline
        return common, PAIRS_RUNS
    if a.suite == "diloco":  # the embedded corpus (no --mock-data), the same tokens for both
        common = [*model, *it, "--micro-batch-size", str(b), "--global-batch-size", str(2 * b),
                  "--eval-iters", "8", "--eval-interval", str(a.iters)]
        return common, ["dp=", f"diloco-h{a.interval}=--local-sgd-interval {a.interval} --outer-lr {a.outer_lr} "
                               f"--outer-momentum {a.outer_momentum}"]
    raise SystemExit(f"unknown suite {a.suite!r}")


# The moe suite's model: 8 experts, top-2, every MLP a MoE layer.
MOE_FLAGS = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
             "--disable-bias-linear"]  # experts without biases, as the runs in docs/runs measured them


def moe_comparison(results: dict[str, RunResult], links: dict) -> dict:
    """What the slow link adds to each layout's step (across minus the same on bare veths), against
    the formula's exposed time: every byte megalite counted this rank sending in a step (the experts'
    all-to-alls, kind "ep", the gradients' all-reduce, kind "dp", both serial here, and the log
    line's few "metrics" bytes), over the link's one-stream rate. One rank a host: every exchange
    crosses the link."""
    out: dict = {"link_mb_per_s": {str(k): v["tcp"] / 1e6 for k, v in links.items()}, "layouts": {}}
    for name in ("ep2", "ep1"):
        across, fast = results.get(f"{name}-across"), results.get(f"{name}-fast")
        if not (across and fast and across.rounds and fast.rounds) or across.spec.rate_mbit not in links:
            continue
        kinds = across.rounds[-1].get("comm_bytes_by_kind") or {}  # the same every round
        rate = links[across.spec.rate_mbit]["tcp"]
        measured = across.figure("step_ms") - fast.figure("step_ms")
        predicted = sum(kinds.values()) / rate * 1e3
        out["layouts"][name] = {"bytes_per_step_by_kind": kinds, "measured_exposed_ms": measured,
                                "formula_exposed_ms": predicted,
                                "formula_over_measured": predicted / measured if measured > 0 else None}
    return out


def _ratio(x, y):
    return x / y if x is not None and y else None


def derive(a, results: dict[str, RunResult], links: dict) -> dict:
    """The suite's ratios (see docs/slow-links.md)."""
    t = {name: r.figure("step_ms") for name, r in results.items()}
    out: dict = {}
    if a.suite == "overlap" and t.get("compute") and t.get("overlap"):
        # hidden fraction: of the communication a serial reduction exposes (no-overlap, or one bucket
        # launched when backward ends), the part that overlapping the buckets with backward hides
        out = {"overlap_vs_compute": t["overlap"] / t["compute"], "exposed_ms_overlap": t["overlap"] - t["compute"]}
        waits = {n: r.span("grad-reduce") for n, r in results.items()}
        out["grad_reduce_wait_ms"] = waits  # rank 0's wait for the reduction after backward (timeline)
        for serial in ("no-overlap", "one-bucket"):
            if waits.get(serial) and waits.get("overlap") is not None:
                out[f"hidden_fraction_by_wait_vs_{serial}"] = 1 - waits["overlap"] / waits[serial]
            if t.get(serial):
                comm = t[serial] - t["compute"]
                out[f"overlap_vs_{serial}"] = t["overlap"] / t[serial]
                out[f"comm_ms_{serial}"] = comm
                out[f"hidden_fraction_vs_{serial}"] = (t[serial] - t["overlap"]) / comm if comm > 0 else None
    elif a.suite == "bf16":
        out = {"step_bf16_vs_fp32": _ratio(t.get("bf16-wire"), t.get("fp32-wire")),
               "grad_reduce_wait_bf16_vs_fp32": _ratio(results["bf16-wire"].span("grad-reduce"),
                                                       results["fp32-wire"].span("grad-reduce")),
               "wire_bytes_bf16_vs_fp32": _ratio(results["bf16-wire"].figure("wire_bytes_per_token"),
                                                 results["fp32-wire"].figure("wire_bytes_per_token")),
               "bytes_bf16_vs_fp32": _ratio(results["bf16-wire"].figure("comm_bytes"),
                                            results["fp32-wire"].figure("comm_bytes"))}
    elif a.suite == "planner" and links:
        out = planner_comparison(a, results, links)
    elif a.suite == "moe" and links:
        out = moe_comparison(results, links)
    elif a.suite == "pairs":
        out = pairs_comparison(results)
    elif a.suite == "hidden":
        out = hidden_overlap(results, links)
        hidden_predictions(a, results, links, out)
    elif a.suite == "diloco":
        dp, lo = results.get("dp"), results.get(f"diloco-h{a.interval}")
        if dp and lo and dp.rounds and lo.rounds:
            out = {"bytes_per_token_dp_over_diloco": _ratio(dp.figure("comm_bytes_per_token"),
                                                           lo.figure("comm_bytes_per_token")),
                   "wire_bytes_per_token_dp_over_diloco": _ratio(dp.figure("wire_bytes_per_token"),
                                                                lo.figure("wire_bytes_per_token")),
                   "wall_per_token_diloco_vs_dp": _ratio(dp.figure("tokens_per_s"), lo.figure("tokens_per_s")),
                   "loss_diloco_vs_dp": _ratio(lo.figure("loss"), dp.figure("loss")),
                   "loss_last16_diloco_vs_dp": _ratio(lo.figure("loss_last16"), dp.figure("loss_last16")),
                   "valid_loss_diloco_vs_dp": _ratio(lo.figure("valid_loss"), dp.figure("valid_loss"))}
    return out


def memory_bandwidth() -> float:
    """Bytes/s of one thread streaming through memory (read + write of a 64 MiB copy): the planner's
    --hbm-gbps for this machine's optimizer step."""
    import torch

    torch.set_num_threads(1)
    src, dst = torch.ones(16 << 20), torch.empty(16 << 20)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best


def planner_comparison(a, results: dict[str, RunResult], links: dict) -> dict:
    """megalite.tools.plan.predict for every run, with this machine's compute rate fitted on the
    one-rank run (`compute`: the rate that makes its predicted step time the measured one) and the
    measured link as the inter-node bandwidth (one rank a host: every group crosses the link)."""
    from megalite import arguments
    from megalite.tools.plan import Cluster, Layout, predict
    from megalite.tools.plan.inputs import Run

    parser = arguments.build_parser("slow_links", default_model="gpt-tiny")
    hbm = memory_bandwidth()

    def prediction(spec: RunSpec, rate_tflops: float):
        args = parser.parse_args([*a.common_flags, *spec.flags])
        config = arguments.model_config(args)
        world = spec.nproc if spec.solo else spec.hosts * spec.nproc
        dp = world // (args.parallel.tp * args.parallel.pp)
        link = links[spec.rate_mbit]["bus"] if spec.rate_mbit in links else hbm  # solo: no link used
        cluster = Cluster(gpus=world, gpus_per_node=spec.nproc, gpu_memory_gib=1e6, intra_node_gbps=hbm / 1e9,
                          inter_node_gbps=link / 1e9, peak_tflops=rate_tflops, efficiency=1.0,
                          hbm_gbps=hbm / 1e9)
        layout = Layout(tp=args.parallel.tp, pp=args.parallel.pp, dp=dp, micro_batch_size=args.training.micro_batch_size)
        run = Run(args.training.global_batch_size, args.model.seq_length, "fp32", args.data_parallel.ddp_bucket_size,
                  grad_reduce_dtype=args.data_parallel.grad_reduce_dtype)
        return predict(config, layout, cluster, run=run)

    base = results.get("compute")
    measured = base.figure("step_ms") if base else None
    if not measured:
        return {}
    guess = prediction(base.spec, 1e-3).time
    rate = 1e-3 * guess.compute / (measured / 1e3 - (guess.total - guess.compute))
    out = {"fitted_tflops": rate, "memory_gbps": hbm / 1e9,
           "link_gbps": {str(k): v["bus"] / 1e9 for k, v in links.items()}, "layouts": {}}
    for name, r in results.items():
        step = r.figure("step_ms")
        if step is None:
            continue
        p = prediction(r.spec, rate).time
        out["layouts"][name] = {"predicted_ms": p.total * 1e3, "measured_ms": step,
                                "predicted_over_measured": p.total * 1e3 / step,
                                "parts_ms": {k: getattr(p, k) * 1e3 for k in ("compute", "tp_comm", "pp_comm",
                                                                               "bubble", "dp_comm", "optimizer")}}
    across = [n for n in out["layouts"] if n.endswith("-across")]
    out["link_cost"] = {}  # what the slow link adds to each layout's step: across minus the same on bare veths
    for name in across:
        fast = out["layouts"].get(name.replace("-across", "-fast"))
        if fast:
            here = out["layouts"][name]
            measured, predicted = here["measured_ms"] - fast["measured_ms"], here["predicted_ms"] - fast["predicted_ms"]
            out["link_cost"][name] = {"measured_ms": measured, "predicted_ms": predicted,
                                      "predicted_over_measured": predicted / measured if measured > 0 else None}
    out["ranking_predicted"] = sorted(across, key=lambda n: out["layouts"][n]["predicted_ms"])
    out["ranking_measured"] = sorted(across, key=lambda n: out["layouts"][n]["measured_ms"])
    return out


# ---- hidden: how much of each parallel dimension's communication compute hides ----------------------------------

HIDDEN = ("dp", "zero3", "ep", "pp", "cp", "tp")  # the final line's order
NOISY = 0.10  # a run's rounds further apart than this: too noisy to judge the planner on alone
CP_SEQ = 256  # context parallelism halves the sequence: long enough that each rank's half is a real block


def _dim_scales(a) -> dict[str, int]:
    scales = {}
    for item in getattr(a, "dim_scale", None) or []:
        dim, _, k = item.partition("=")
        if dim not in HIDDEN or not k.isdigit() or int(k) < 1:
            raise SystemExit(f"--dim-scale {item!r}: expected DIM=K with DIM one of {', '.join(HIDDEN)} and K >= 1")
        scales[dim] = int(k)
    return scales


def _dim_flags(a) -> dict[str, str]:
    """--dim-flags DIM=FLAGS: pretrain_gpt.py flags after DIM's own (the last of a flag wins), both runs."""
    extra: dict[str, str] = {}
    for item in getattr(a, "dim_flags", None) or []:
        dim, _, flags = item.partition("=")
        if dim not in HIDDEN or not flags.strip():
            raise SystemExit(f"--dim-flags {item!r}: expected DIM=FLAGS with DIM one of {', '.join(HIDDEN)}")
        extra[dim] = f"{extra.get(dim, '')} {flags.strip()}".strip()
    return extra


def hidden_runs(a, b: int) -> list[str]:
    """Each dimension across the link and on bare veths (rate=off), two hosts one rank each, the pair
    adjacent in every round. Every layout trains 2b sequences of --seq-length tokens a step (cp: the
    same tokens as sequences of CP_SEQ), times its --dim-scale, with megalite's default overlap
    settings (tp: with --tp-comm-overlap, not on by default). --dims picks dimensions; --dim-flags adds
    a dimension's own flags after these (a longer sequence for cp, a wider model for tp). After the
    pair, where it has one, the dimension's reference run (reference_run), `<dim>-ref`. The pairs of the
    dimensions whose waits the suite reads (slow_links_waits: all of them) record their timelines."""
    dims = HIDDEN if not getattr(a, "dims", None) else tuple(a.dims.split(","))
    unknown = [d for d in dims if d not in HIDDEN]
    if unknown:
        raise SystemExit(f"--dims: unknown {', '.join(unknown)} (the dimensions are {', '.join(HIDDEN)})")
    scales, extra = _dim_scales(a), _dim_flags(a)

    def flags(d: str) -> str:
        mb, s = b * scales.get(d, 1), a.seq_length
        g = 2 * mb
        cp_seq = max(CP_SEQ, s)
        cp_b = max(1, g * s // cp_seq)
        return {"dp": f"--micro-batch-size {mb} --global-batch-size {g}",  # one micro-batch a rank, as in overlap
                "zero3": f"--micro-batch-size {mb} --global-batch-size {g} --zero-stage 3",
                # dense layers DP 2, experts EP 2: 4 micro-batches a rank (K x 4 with --dim-scale ep=K: the
                # pairs need micro-batches, the first forward and last backward run alone), each forward
                # but the first beside a backward (--overlap-moe-expert-parallel-comm: megalite.parallel.lanes)
                "ep": f"--micro-batch-size {max(1, b // 4)} --global-batch-size {g} {' '.join(MOE_FLAGS)} "
                      f"--expert-model-parallel-size 2 --overlap-moe-expert-parallel-comm",
                "pp": f"--pp 2 --micro-batch-size {max(1, mb // 2)} --global-batch-size {g}",  # 4 micro-batches
                "cp": f"--cp 2 --seq-length {cp_seq} --micro-batch-size {cp_b} --global-batch-size {cp_b}",
                # the all-gathers and reduce-scatters pipelined with the GEMMs (megalite.parallel.tp_overlap)
                "tp": f"--tp 2 --sequence-parallel --tp-comm-overlap --micro-batch-size {mb} --global-batch-size {g}"}[d]
    out = []
    for d in dims:
        own = f"{flags(d)}{' ' + extra[d] if d in extra else ''}"
        timeline = "timeline=1 " if d in WAIT_KINDS else ""  # its waits: slow_links_waits
        out += [f"{d}-across={timeline}{own}", f"{d}-bare=rate=off {timeline}{own}"]
        ref = reference_run(d, own)
        out += [ref] if ref else []
    return out


def hidden_overlap(results: dict[str, RunResult], links: dict) -> dict:
    """Per dimension (runs `<dim>-across` and `<dim>-bare`; links: rate -> {"tcp", "bus"} in bytes/s):
    the step across the throttled link and on bare veths (best round), the communication time, every
    byte megalite counted rank 0 sending in a step (all kinds: one rank a host, so every group spans
    the link) over the link's one-TCP-stream rate, the exposed part (across minus bare) and the
    hidden fraction 1 - exposed / communication, unclamped. The TCP rate, not gloo's all-reduce bus
    bandwidth: the counted bytes include all-to-alls and sends as well as all-reduces, and a step's
    communication time is what the link needs for its bytes; the bus figure adds gloo's own
    reduction work on this shared CPU (the two agree within a few percent: docs/slow-links.md).
    A dimension without a figure has "error" (why) instead of "hidden"."""
    out: dict = {"rate": "tcp", "link_mb_per_s": {str(k): {w: v[w] / 1e6 for w in ("tcp", "bus")}
                                                  for k, v in links.items()}, "dimensions": {}}
    for dim in HIDDEN:
        across, bare = results.get(f"{dim}-across"), results.get(f"{dim}-bare")
        row: dict = {}
        out["dimensions"][dim] = row
        if across is None or bare is None:
            row["error"] = "not run"
            continue
        failed = [f"{r.spec.name}: {r.error or 'no steps recorded'}" for r in (across, bare)
                  if r.figure("step_ms") is None]
        if failed:
            row["error"] = "; ".join(failed)
            continue
        row.update(step_across_ms=across.figure("step_ms"), step_bare_ms=bare.figure("step_ms"),
                   comm_bytes=across.figure("comm_bytes"),
                   comm_bytes_by_kind=across.rounds[-1].get("comm_bytes_by_kind") or {})  # the same every round
        row["exposed_ms"] = row["step_across_ms"] - row["step_bare_ms"]
        add_waits(row, dim, across, bare)
        ref = results.get(f"{dim}-ref")
        if ref is not None and ref.figure("step_ms") is not None:  # the planner's compute reference
            row["step_reference_ms"] = ref.figure("step_ms")
        spreads = [s for s in (across.spread_ratio(), bare.spread_ratio()) if s is not None]
        if spreads:  # how steady the machine was: the further apart of the two runs' rounds
            row["rounds_spread"] = max(spreads)
        rate = links.get(across.spec.rate_mbit, {}).get("tcp") if across.spec.rate_mbit else None
        if not rate:
            row["error"] = "no limited link measured for it (--rate-mbit 0?)"
        elif not row["comm_bytes"]:
            row["error"] = f"{across.spec.name}: megalite counted no bytes (comm_bytes absent or 0)"
        else:
            row["comm_ms"] = row["comm_bytes"] / rate * 1e3
            row["hidden"] = 1 - row["exposed_ms"] / row["comm_ms"]
            if "waited_ms" in row:  # the same share read off the waits (slow_links_waits)
                row["hidden_by_waits"] = 1 - row["waited_ms"] / row["comm_ms"]
            if bare.spec.rate_mbit in links:  # the same bytes at the bare veths' rate: what `bare` spends on them
                row["comm_ms_bare"] = row["comm_bytes"] / links[bare.spec.rate_mbit]["tcp"] * 1e3
    return out


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def overlap_line(derived: dict) -> str:
    """The suite's last line: every dimension's hidden percentage as measured, n/a where there is none."""
    dims = derived.get("dimensions", {})
    return ("overlap: " + ", ".join(f"{d} {_pct(dims.get(d, {}).get('hidden'))}" for d in HIDDEN)
            + " of communication hidden")


def hidden_report(derived: dict) -> str:
    """A table of the derived figures, why each n/a is one, then overlap_line."""
    def ms(row, key):
        return f"{row[key]:.1f}" if row.get(key) is not None else "-"
    head = ["dimension", "step ms across", "step ms bare", "comm bytes/step (rank 0, by kind)", "comm ms",
            "exposed ms", "hidden", "predicted exposed ms", "predicted / measured"]
    rows, why = [], []
    for dim, row in derived.get("dimensions", {}).items():
        kinds = "; ".join(f"{k} {v:,.0f}" for k, v in sorted(row.get("comm_bytes_by_kind", {}).items(),
                                                             key=lambda kv: -kv[1]))
        ratio = row.get("predicted_over_measured")
        rows.append([dim, ms(row, "step_across_ms"), ms(row, "step_bare_ms"),
                     f"{row['comm_bytes']:,.0f} ({kinds})" if row.get("comm_bytes") else "-", ms(row, "comm_ms"),
                     ms(row, "exposed_ms"), _pct(row.get("hidden")), ms(row, "predicted_exposed_ms"),
                     f"{ratio:.2f}" if ratio is not None else "-"])
        if "error" in row:
            why.append(f"{dim}: n/a: {row['error']}")
        if "predicted_error" in row:
            why.append(f"{dim}: no prediction: {row['predicted_error']}")
        if row.get("rounds_spread", 0) > NOISY:
            why.append(f"{dim}: a run's rounds are {_pct(row['rounds_spread'])} apart: on a machine this noisy one "
                       "run's exposure scatters by as much as the planner's 20%; pool several runs "
                       "(scripts/slow_links_rederive.py A.json B.json ...)")
        own = row.get("predicted", {}).get("own_ms")
        if own is not None:
            why.append(f"{dim}: compute fitted to {dim}-ref ({row['step_reference_ms']:.0f} ms a step, reference_run); "
                       f"the bare step's {own:.0f} ms beyond the planner's are its exchanges' own cost, "
                       "covering no transfer")
        if "bound_hidden" in row:
            parts = row["predicted"]["bound_exposed_ms"]
            why.append(f"{dim}: no order of these passes hides more than {_pct(row['bound_hidden'])} (at least "
                       f"{row['bound_exposed_ms']:.0f} ms exposed: the pairs {parts['pairs']:.0f}, the first forward "
                       f"{parts['first_forward']:.0f}, the last backward with the DP reduction "
                       f"{parts['last_backward']:.0f}"
                       + (f", the gathers after the update {parts['after_update']:.0f}" if "after_update" in parts else "")
                       + "; megalite.tools.plan.ep_bound)")
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(x, widths)) + " |" for x in [head, *rows]]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    if derived.get("exchange_latency_ms"):  # what the predictions were calibrated with
        lines.append("predicted: megalite.tools.plan at each link's measured rate and per-exchange latency ("
                     + ", ".join(f"{'bare' if k == 'None' else k + ' Mbit/s'} {v:.3f} ms"
                                 for k, v in derived["exchange_latency_ms"].items())
                     + "), compute fitted to each bare step or reference run; predicted / measured of the exposed ms")
    return "\n".join([*lines, *why, *waits_lines(derived), overlap_line(derived)])


# ---- pairs: DualPipeV's overlapped pairs against ZB-V and 1F1B, pp 2 x ep 2 across the links -------------------------

_DW = " --delay-wgrad-compute"  # each schedule again with the weights' work lent to the waits
PAIRS_RUNS = ["1f1b=", "1f1b-paired=--overlap-moe-expert-parallel-comm", "zb-v=--pipeline-schedule zb-v",
              "dualpipev=--pipeline-schedule dualpipev",
              "dualpipev-paired=--pipeline-schedule dualpipev --overlap-moe-expert-parallel-comm",
              "1f1b-paired-dw=--overlap-moe-expert-parallel-comm" + _DW, "zb-v-dw=--pipeline-schedule zb-v" + _DW,
              "dualpipev-paired-dw=--pipeline-schedule dualpipev --overlap-moe-expert-parallel-comm" + _DW]


def pairs_comparison(results: dict[str, RunResult]) -> dict:
    """Each schedule's step (best round, and the median of the rounds: on four ranks sharing two
    cores one round can be set by the machine) and its ratio to 1F1B's, and whether DualPipeV with
    its pairs overlapped is below ZB-V's and 1F1B's by each."""
    t = {name: r.figure("step_ms") for name, r in results.items() if r.rounds}
    med = {name: statistics.median(x["step_ms"] for x in r.rounds if x.get("step_ms") is not None)
           for name, r in results.items() if name in t and t[name] is not None}
    out = {"step_ms": t, "median_ms": med, "vs_1f1b": {n: _ratio(v, t.get("1f1b")) for n, v in t.items()}}
    if all(n in t for n in ("dualpipev-paired", "zb-v", "1f1b")):
        for key, x in (("", t), ("_by_median", med)):
            out["dualpipev_paired_below_zb_v_and_1f1b" + key] = x["dualpipev-paired"] < min(x["zb-v"], x["1f1b"])
    return out


def report(a, derived: dict) -> str | None:
    """What the suite prints after the runs' table (None: the derived figures as JSON)."""
    if a.suite == "pairs":
        t = derived.get("step_ms", {})
        med = derived.get("median_ms", {})
        return "pairs (best / median ms): " + ", ".join(f"{n} {v:.0f} / {med[n]:.0f}" for n, v in t.items()) + (
            f" (dualpipev paired below zb-v and 1f1b: {derived['dualpipev_paired_below_zb_v_and_1f1b']}, "
            f"by medians {derived['dualpipev_paired_below_zb_v_and_1f1b_by_median']})"
            if "dualpipev_paired_below_zb_v_and_1f1b" in derived else "")
    return hidden_report(derived) if a.suite == "hidden" else None
