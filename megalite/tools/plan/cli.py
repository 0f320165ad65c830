"""python -m megalite.tools.plan: the command line."""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict

from megalite.models.config import TransformerConfig
from megalite.models.presets import PRESETS
from megalite.tools.plan.command import model_flags
from megalite.tools.plan.exposed import format_exposed
from megalite.tools.plan.inputs import GIB, GPT_PRESETS, RECOMPUTE, SCHEDULES, Cluster, Run, active_parameters, total_parameters
from megalite.tools.plan.json_forms import config_json, rejected_json
from megalite.tools.plan.report import explain, format_rejections, format_table, zero_stage_note
from megalite.tools.plan.muon import optimizer_of
from megalite.tools.plan.search import PlanResult, local_sgd_of, plan


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m megalite.tools.plan",
                                 description="Enumerate megalite parallel layouts; predict memory and step time.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = ap.add_argument_group("model (a preset, or the shape flags of pretrain_gpt.py)")
    g.add_argument("--model", choices=GPT_PRESETS, help="GPT preset")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--ffn-hidden-size", type=int, help="default 4 x hidden")
    g.add_argument("--vocab-size", type=int, help="default: the preset's, else 50257")
    g.add_argument("--q-lora-rank", type=int, help="MLA models: the queries' latent width (default: the preset's)")
    g.add_argument("--kv-lora-rank", type=int, help="MLA models: the keys' and values' latent width")
    g.add_argument("--mtp-num-layers", type=int, help="multi-token prediction modules (default: the preset's)")
    g = ap.add_argument_group("cluster")
    g.add_argument("--gpus", type=int, required=True)
    g.add_argument("--gpu-memory-gib", type=float, default=80.0)
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--intra-node-gbps", type=float, default=450.0, help="GB/s per GPU per direction (NVLink)")
    g.add_argument("--inter-node-gbps", type=float, default=50.0, help="GB/s per GPU per direction (network)")
    g.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU")
    g.add_argument("--efficiency", type=float, default=0.5, help="fraction of peak the matmuls sustain")
    g.add_argument("--hbm-gbps", type=float, default=3350.0, help="GPU memory bandwidth (optimizer step)")
    g.add_argument("--overhead-gib", type=float, default=2.0, help="fixed per-GPU framework/CUDA overhead")
    g.add_argument("--fp8-speedup", type=float, default=2.0, help="--fp8: dense FP8 peak over bf16's (H100/H200: 2)")
    g.add_argument("--collective-latency-ms", type=float, default=0.05,
                   help="start-up of every exchange: a collective, an all-to-all, a batch of pipeline sends, a "
                        "ring step (per gradient bucket)")
    g.add_argument("--link-burst-kib", type=float, default=0.0,
                   help="a link's token bucket: KiB that cross at once after it idles (tc-tbf's burst; 0: none)")
    g.add_argument("--attention-speed", type=float, default=1.0,
                   help="the attention core's FLOP/s over a layer's average: the blocks a context-parallel ring "
                        "transfer hides behind (scripts/slow_links.py measures it; 1: by FLOPs)")
    g.add_argument("--attention-backward-speed", type=float, help="the same for the core's backward pieces "
                                                                   "(default: --attention-speed)")
    g = ap.add_argument_group("training run")
    g.add_argument("--global-batch-size", type=int, required=True)
    g.add_argument("--seq-length", type=int, help="default: the preset's positions")
    prec = g.add_mutually_exclusive_group()
    prec.add_argument("--bf16", action="store_const", const="bf16", dest="dtype", help="(default)")
    prec.add_argument("--fp16", action="store_const", const="fp16", dest="dtype")
    prec.add_argument("--fp32", action="store_const", const="fp32", dest="dtype")
    g.add_argument("--fp8", action="store_true", help="the transformer layers' GEMMs in FP8 (pretrain_gpt.py "
                                                      "--fp8-format; docs/fp8.md)")
    g.add_argument("--ddp-bucket-size", type=int, default=40_000_000)
    g.add_argument("--attention-backend", choices=["sdpa", "fused", "torch"], default="sdpa")
    g.add_argument("--grad-reduce-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="dtype gradients are reduced in (at ZeRO stages 2-3 also the stored gradient shards' dtype)")
    g.add_argument("--local-sgd-interval", type=int, default=0, metavar="H",
                   help="local SGD / DiLoCo: replicas reduce no gradients per step; an outer all-reduce every H "
                        "steps (docs/local-sgd.md)")
    g.add_argument("--local-sgd-fragments", type=int, default=1, metavar="F", help="local SGD: streaming fragments")
    g.add_argument("--outer-grad-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="local SGD: dtype of the pseudo-gradients on the wire")
    g.add_argument("--local-sgd-async", action="store_true", help="local SGD: outer all-reduce hidden behind the "
                   "next H steps")
    g.add_argument("--optimizer", choices=["adam", "muon"], default="adam",
                   help="muon: one fp32 moment for the weight matrices, and their Newton-Schulz GEMMs each step "
                        "(ZeRO stage 0 only; docs/optimizer.md)")
    g.add_argument("--muon-tp-mode", choices=["blockwise", "duplicated", "distributed"], default="blockwise")
    g.add_argument("--muon-num-ns-steps", type=int, default=5)
    g.add_argument("--exp-avg-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="Adam's first moment as stored (pretrain_gpt.py's, with --use-precision-aware-optimizer)")
    g.add_argument("--exp-avg-sq-dtype", choices=["fp32", "bf16"], default="fp32", help="Adam's second moment")
    g.add_argument("--tp-comm-overlap", action="store_true",
                   help="predict sequence parallelism's collectives pipelined with the GEMMs (pretrain_gpt.py's flag)")
    g.add_argument("--tp-comm-overlap-splits", type=int, default=1, metavar="N",
                   help="with --tp-comm-overlap: each sequence shard's GEMMs and transfers in N pieces "
                        "(pretrain_gpt.py's flag)")
    g.add_argument("--overlap-moe-expert-parallel-comm", action="store_true",
                   help="predict pretrain_gpt.py's pairs: each forward but the first beside another micro-batch's "
                        "backward, each all-to-all behind the other pass's compute up to its next exchange "
                        "(pair_play.py)")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="predict ZeRO stages 1-2's parameter all-gathers behind the next forward (pretrain_gpt.py's "
                        "flag; gather_play.py)")
    g.add_argument("--moe-dispatch-chunks", type=int, default=1, metavar="N",
                   help="predict pretrain_gpt.py's flag: a MoE layer's exchanges and experts in N groups, each "
                        "group's GEMMs beside the next group's exchange, in the passes outside pairs (exposed.py)")
    g.add_argument("--delay-wgrad-compute", action="store_true",
                   help="predict pretrain_gpt.py's flag: each backward's weight-gradient work done while "
                        "exchanges are in flight (pair_play.py)")
    g.add_argument("--pipeline-extra-warmup", type=int, choices=(0, 1), default=0,
                   help="predict pretrain_gpt.py's flag: one more forward ahead on every stage but the last, where "
                        "the layout's schedule has it (1f1b with one chunk a rank, zb-h1): one more micro-batch's "
                        "activations, the steady state's boundary transfers off the path")
    g = ap.add_argument_group("restrict the search")
    g.add_argument("--tp", type=int)
    g.add_argument("--pp", type=int)
    g.add_argument("--vpp", type=int, help="1 = no interleaving")
    g.add_argument("--pipeline-schedule", choices=SCHEDULES,
                   help="default: all (zb-h1 where pp > 1 and vpp 1: a third of 1F1B's bubble, p micro-batches "
                        "in flight on every stage; zb-v where pp > 1 and the layers per stage are even: two chunks "
                        "per rank in a V, a sixth of the bubble; dualpipev there too, with at least 2 x pp "
                        "micro-batches: ZB-H1's bubble, forwards paired with backwards)")
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--recompute", choices=RECOMPUTE)
    g.add_argument("--sequence-parallel", choices=["on", "off"])
    g.add_argument("--distributed-optimizer", choices=["on", "off"], help="on: --zero-stage 1; off: 0")
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3],
                   help="ZeRO stage (1 = distributed optimizer; 2 also gradients, 3 also parameters sharded); "
                        "default: every stage")
    g.add_argument("--cp", type=lambda x: x if x == "all" else int(x),
                   help="context-parallel size, or 'all' (default: 1, and every size only when nothing fits at 1)")
    g.add_argument("--ep", "--expert-model-parallel-size", dest="ep", type=int,
                   help="MoE models: expert-parallel size (default: every divisor of the experts)")
    g.add_argument("--etp", "--expert-tensor-parallel-size", dest="etp", type=int,
                   help="MoE models: expert-tensor-parallel size (default: 1 and tp)")
    g.add_argument("--max-tp", type=int, help="largest tp (default: GPUs per node)")
    g.add_argument("--compare", action="append", default=[], metavar="LAYOUT",
                   help="also predict this layout, printed after the plan: comma-separated key=value of tp, pp, dp, "
                        "cp, vpp, ep, etp, mb, recompute, sp (on/off), zero, schedule, layers (--pipeline-layers as a sum of "
                        "counts: 3+4*14+2 is 3, fourteen 4s, 2); keys left out are searched (the fastest that fits, "
                        "else the one needing the least memory), cp 1 unless given; may be repeated")
    g = ap.add_argument_group("output")
    g.add_argument("--top", type=int, default=5)
    g.add_argument("--explain", action="store_true", help="the formulas with numbers for the best layout")
    g.add_argument("--json", action="store_true", help="machine-readable output")
    return ap


def config_from_args(args, ap: argparse.ArgumentParser) -> TransformerConfig:
    given = vars(args)
    shape = {k: given[k] for k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                   "vocab_size", "q_lora_rank", "kv_lora_rank", "mtp_num_layers")
             if given[k] is not None}
    if args.model:
        base = dict(PRESETS[args.model])
    else:
        missing = [f"--{k.replace('_', '-')}" for k in ("num_layers", "hidden_size", "num_attention_heads")
                   if k not in shape]
        if missing:
            ap.error(f"give --model or the shape: {' '.join(missing)} missing")
        base = {"vocab_size": 50257, "max_position_embeddings": args.seq_length or 1024}
    try:
        return TransformerConfig(**{**base, **shape})
    except ValueError as e:
        ap.error(str(e))


def cluster_from_args(args, ap: argparse.ArgumentParser, seq: int) -> Cluster:
    try:
        cluster = Cluster(gpus=args.gpus, gpu_memory_gib=args.gpu_memory_gib, gpus_per_node=args.gpus_per_node,
                          intra_node_gbps=args.intra_node_gbps, inter_node_gbps=args.inter_node_gbps,
                          peak_tflops=args.peak_tflops, efficiency=args.efficiency, hbm_gbps=args.hbm_gbps,
                          overhead_gib=args.overhead_gib, fp8_speedup=args.fp8_speedup,
                          collective_latency_ms=args.collective_latency_ms, link_burst_kib=args.link_burst_kib,
                          attention_speed=args.attention_speed,
                          attention_backward_speed=args.attention_backward_speed)
        Run(args.global_batch_size, seq, args.dtype or "bf16", args.ddp_bucket_size, args.attention_backend,
            grad_reduce_dtype=args.grad_reduce_dtype, **(local_sgd_of(args) or {}))
    except ValueError as e:
        ap.error(str(e))
    return cluster


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    config = config_from_args(args, ap)
    if args.zero_stage is not None and args.distributed_optimizer is not None and \
            (args.zero_stage >= 1) != (args.distributed_optimizer == "on"):
        ap.error(f"--distributed-optimizer {args.distributed_optimizer} contradicts --zero-stage {args.zero_stage} "
                 f"(the distributed optimizer is stage 1 and above): give one of them")
    if args.optimizer == "muon" and (args.zero_stage or args.distributed_optimizer == "on"):
        ap.error("--optimizer muon orthogonalizes whole matrices: drop --zero-stage / --distributed-optimizer on")
    if args.local_sgd_interval and (args.zero_stage or args.distributed_optimizer == "on"):
        ap.error("--local-sgd-interval keeps each replica's optimizer whole: drop --zero-stage / "
                 "--distributed-optimizer on")
    if (args.ep or args.etp) and not config.is_moe:
        ap.error(f"--ep/--etp are for mixture-of-experts models: {args.model or 'this model'} has no experts")
    dtype = args.dtype or "bf16"
    seq = args.seq_length or config.max_position_embeddings
    cluster = cluster_from_args(args, ap, seq)
    result = plan(config, cluster, args.global_batch_size, seq, dtype=dtype, ddp_bucket_size=args.ddp_bucket_size,
                  attention_backend=args.attention_backend, max_tp=args.max_tp, tp=args.tp, pp=args.pp,
                  vpp=args.vpp, micro_batch_size=args.micro_batch_size,
                  recompute=(args.recompute,) if args.recompute else RECOMPUTE,
                  sequence_parallel=_on_off(args.sequence_parallel),
                  distributed_optimizer=_on_off(args.distributed_optimizer), zero_stage=args.zero_stage,
                  grad_reduce_dtype=args.grad_reduce_dtype, cp=args.cp, local_sgd=local_sgd_of(args), ep=args.ep,
                  etp=args.etp, schedule=_schedules_of(args), fp8_layers=config.num_layers if args.fp8 else 0,
                  overlap=overlap_of(args), optimizer=optimizer_of(args))
    name = args.model or "custom GPT"
    flags = model_flags(config, args.model) + (["--fp8-format", "hybrid"] if args.fp8 else [])
    compared = []
    for spec in args.compare:
        try:
            compared.append((spec, compare(config, cluster, args, seq, spec)))
        except ValueError as e:
            ap.error(f"--compare {spec}: {e}")
    if result.best is None:
        msg = _nothing_fits(result, name, cluster)
        if args.json:
            print(json.dumps({"error": msg, "evaluated": result.evaluated, "feasible": 0,
                              "rejected": rejected_json(result),
                              "closest": result.closest.to_dict(flags) if result.closest else None,
                              **_compared_json(compared, flags)}, indent=1))
        else:
            _print_compared(compared, result.best, flags)
        print(msg, file=sys.stderr)
        return 1
    top = result.predictions[:max(args.top, 1)]
    command = result.best.command(flags)
    if args.json:
        active = {"active_parameters": active_parameters(config, seq)} if config.is_moe else {}
        if config.mtp_num_layers:  # the main model alone too, as DeepSeek-V3's figures count it
            active.update(parameters_without_mtp=total_parameters(config, seq, mtp=False),
                          active_parameters_without_mtp=active_parameters(config, seq, mtp=False))
        print(json.dumps({"model": name, "parameters": total_parameters(config, seq), **active,
                          "config": config_json(config),
                          "cluster": asdict(cluster), "global_batch_size": args.global_batch_size, "seq_length": seq,
                          "dtype": dtype, "evaluated": result.evaluated, "feasible": len(result),
                          "best": [x.to_dict(flags) for x in top], "rejected": rejected_json(result),
                          "command": command, **_compared_json(compared, flags)}, indent=1))
        return 0
    nodes = math.ceil(cluster.gpus / cluster.gpus_per_node)
    print(_header(name, config, cluster, args.global_batch_size, seq,
                  dtype + (f", FP8 GEMMs at {cluster.fp8_speedup:g}x (MFU against the {dtype} peak)" if args.fp8 else "")))
    print(f"evaluated {result.evaluated:,} layout{'s' if result.evaluated != 1 else ''}: {len(result):,} fit\n")
    print(format_table(top))
    print()
    print(format_rejections(result))
    print("\nrun the best with" + (" (plus your rendezvous flags, e.g. --rdzv-backend c10d --rdzv-endpoint "
                                  "HOST:29500):" if nodes > 1 else ":"))
    print(f"  {command}")
    note = zero_stage_note(result.best)
    if note:
        print(note)
    print()
    print(format_exposed(result.best))
    if args.explain:
        print()
        print(explain(result.best))
    _print_compared(compared, result.best, flags)
    return 0


COMPARE_KEYS = ("tp", "pp", "dp", "cp", "vpp", "ep", "etp", "mb", "recompute", "sp", "zero", "layers", "schedule")


def _schedules_of(args) -> tuple:
    return (args.pipeline_schedule,) if args.pipeline_schedule else SCHEDULES


def parse_layout(spec: str) -> dict:
    """--compare's LAYOUT, "tp=1,pp=16,ep=64,zero=1": the sizes it fixes, by key (COMPARE_KEYS);
    layers=3+4*14+2 is the explicit split [3, 4 (14 times), 2]."""
    out: dict = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in COMPARE_KEYS:
            raise ValueError(f"{item!r} is not key=value with a key among {', '.join(COMPARE_KEYS)}")
        try:
            if key in ("recompute", "schedule"):
                if value not in {"recompute": RECOMPUTE, "schedule": SCHEDULES}[key]:
                    raise ValueError
                out[key] = value
            elif key == "sp":
                out[key] = {"on": True, "off": False}[value]
            elif key == "layers":
                out[key] = [int(n) for term in value.split("+")
                            for n, _, times in [term.partition("*")] for _ in range(int(times or 1))]
            else:
                out[key] = int(value)
        except (ValueError, KeyError):
            hint = {"sp": "on or off", "recompute": "one of " + ", ".join(RECOMPUTE),
                    "schedule": "one of " + ", ".join(SCHEDULES),
                    "layers": "layer counts like 3+4*14+2"}.get(key, "an integer")
            raise ValueError(f"{item!r}: give {hint}") from None
    return out


def compare(config: TransformerConfig, cluster: Cluster, args, seq: int, spec: str) -> PlanResult:
    """The layouts of `cluster` that --compare's LAYOUT leaves open, planned as the main search is
    (the fastest that fits first; `closest` when none fits), cp 1 unless given. A dp given with one
    of tp and pp missing fixes that one (tp x cp x pp x dp = the GPUs)."""
    fixed = parse_layout(spec)
    cp = fixed.get("cp", 1)
    layers = fixed.get("layers")
    if layers is not None and "pp" not in fixed:
        fixed["pp"] = len(layers) // fixed.get("vpp", 1)
    if "dp" in fixed:
        missing = [k for k in ("tp", "pp") if k not in fixed]
        if len(missing) == 2:
            raise ValueError("with dp give tp or pp too")
        if missing:
            other = fixed["pp" if missing[0] == "tp" else "tp"]
            fixed[missing[0]] = cluster.gpus // (other * cp * fixed["dp"])
        if fixed["tp"] * cp * fixed["pp"] * fixed["dp"] != cluster.gpus:
            raise ValueError(f"tp {fixed['tp']} x cp {cp} x pp {fixed['pp']} x dp {fixed['dp']} is not the "
                             f"{cluster.gpus} GPUs of --gpus")
    return plan(config, cluster, args.global_batch_size, seq, dtype=args.dtype or "bf16",
                ddp_bucket_size=args.ddp_bucket_size, attention_backend=args.attention_backend,
                max_tp=max(fixed.get("tp", 0), args.max_tp or cluster.gpus_per_node), tp=fixed.get("tp"),
                pp=fixed.get("pp"), vpp=fixed.get("vpp"), micro_batch_size=fixed.get("mb"),
                recompute=(fixed["recompute"],) if "recompute" in fixed else RECOMPUTE,
                sequence_parallel=(fixed["sp"],) if "sp" in fixed else (False, True),
                zero_stage=fixed.get("zero"), grad_reduce_dtype=args.grad_reduce_dtype, cp=cp,
                local_sgd=local_sgd_of(args), ep=fixed.get("ep"), etp=fixed.get("etp"), pipeline_layers=layers,
                schedule=(fixed["schedule"],) if "schedule" in fixed else _schedules_of(args),
                fp8_layers=config.num_layers if args.fp8 else 0, overlap=overlap_of(args))


def overlap_of(args) -> dict:
    """Run's overlap options from the planner's flags."""
    return {"tp_comm_overlap": args.tp_comm_overlap, "tp_comm_overlap_splits": args.tp_comm_overlap_splits,
            "overlap_moe_ep_comm": args.overlap_moe_expert_parallel_comm,
            "overlap_param_gather": args.overlap_param_gather, "moe_dispatch_chunks": args.moe_dispatch_chunks,
            "pipeline_extra_warmup": args.pipeline_extra_warmup, "delay_wgrad_compute": args.delay_wgrad_compute}


def summary(pred) -> str:
    """One layout's memory per GPU, step time and bubble, in a line."""
    t, m = pred.time, pred.memory
    built = "the build's peak; " if pred.build_peak > m.total else ""
    return (f"{pred.layout.short()}: {pred.peak_bytes / GIB:.1f} GiB per GPU ({built}training {m.total / GIB:.1f} on "
            f"stage {pred.peak_stage}: states {m.states / GIB:.1f}, activations {m.activations / GIB:.1f}, output "
            f"layer{' and MTP' if m.mtp else ''} {m.output_layer / GIB:.1f}), step "
            f"{t.total:.2f} s, bubble {t.bubble:.2f} s ({pred.bubble_fraction:.1%} of the schedule), "
            f"MFU {100 * pred.mfu:.1f}%{'' if pred.fits else ' -- ' + (pred.reason or 'does not fit')}")


def _print_compared(compared: list, best, flags: list[str]) -> None:
    if not compared:
        return
    print()
    if best is not None:
        print(f"plan's best: {summary(best)}")
    for spec, result in compared:
        pred = result.best or result.closest
        if pred is None:
            first = next(iter(result.rejected.values()), None)
            print(f"compared {spec}: no valid layout ({first.example if first else 'no candidates'})")
            continue
        print(f"compared {spec}{'' if result.best else ' (nothing fits; the closest)'}: {summary(pred)}")
        print(f"  {pred.command(flags)}")


def _compared_json(compared: list, flags: list[str]) -> dict:
    if not compared:
        return {}
    return {"compared": [{"layout": spec, "fits": result.best is not None,
                          "prediction": (result.best or result.closest).to_dict(flags)
                          if (result.best or result.closest) else None} for spec, result in compared]}


def _on_off(choice: str | None) -> tuple:
    """--sequence-parallel / --distributed-optimizer: both tried unless one is given."""
    return (False, True) if choice is None else (choice == "on",)


def _header(name: str, config: TransformerConfig, cluster: Cluster, global_batch_size: int, seq: int,
            dtype: str) -> str:
    nodes = math.ceil(cluster.gpus / cluster.gpus_per_node)
    experts = (f", {active_parameters(config, seq) / 1e9:.2f}B active ({config.num_moe_experts} experts, top-"
               f"{config.moe_router_topk}, in {sum(config.moe_layer_freq)} layers)" if config.is_moe else "")
    if config.mtp_num_layers:  # and the main model alone, as DeepSeek-V3's 671B / 37B count it
        depth = config.mtp_num_layers
        active = f", {active_parameters(config, seq, mtp=False) / 1e9:.2f}B active" if config.is_moe else ""
        experts += (f"; without the {depth} MTP module{'s' if depth > 1 else ''} "
                    f"{total_parameters(config, seq, mtp=False) / 1e9:.2f}B{active}")
    return (f"{name}: {total_parameters(config, seq) / 1e9:.2f}B parameters{experts} ({config.num_layers} layers, hidden "
            f"{config.hidden_size}, {config.num_attention_heads} heads, vocab {config.vocab_size}); "
            f"{cluster.gpus} GPUs ({nodes} node{'s' if nodes > 1 else ''} of "
            f"{min(cluster.gpus_per_node, cluster.gpus)}, {cluster.gpu_memory_gib:g} GiB each); "
            f"global batch {global_batch_size} x {seq} tokens, {dtype}\n"
            f"peak {cluster.peak_tflops:g} TFLOP/s x efficiency {cluster.efficiency:g}; "
            f"links {cluster.intra_node_gbps:g} GB/s in a node, {cluster.inter_node_gbps:g} GB/s between nodes; "
            f"overhead {cluster.overhead_gib:g} GiB")


def _nothing_fits(result: PlanResult, name: str, cluster: Cluster) -> str:
    if result.closest is not None:
        x = result.closest
        return (f"megalite plan: no layout of {name} fits {cluster.gpus} GPUs of {cluster.gpu_memory_gib:g} GiB: "
                f"the smallest needs {x.peak_bytes / GIB:.1f} GiB per GPU ({x.layout.short()}: parameters, "
                f"gradients and optimizer states alone {x.memory.states / GIB:.1f} GiB); "
                f"use more GPUs, GPUs with more memory, or a smaller model or batch")
    first = next(iter(result.rejected.values()), None)
    return (f"megalite plan: no valid layout of {name} on {cluster.gpus} GPUs with these restrictions "
            f"(e.g. {first.example if first else 'no candidates'})")
