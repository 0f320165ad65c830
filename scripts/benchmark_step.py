#!/usr/bin/env python
"""megalite's full training step against a plain counterpart of the same shape, on one CPU thread.

    python scripts/benchmark_step.py --family llama --size tiny --rounds 20 --json llama-tiny.json
    python scripts/benchmark_step.py --family bert --size 124m --compile
    python scripts/benchmark_step.py --family llama --size tiny --profile     # where the time goes
    python scripts/benchmark_step.py --family gpt --quick                       # a smoke run (the tests)

A step is forward, backward, gradient-norm clipping at 1.0 and the fused AdamW update, in fp32.
megalite runs the real training path (`megalite.training`: the command line parsed, the model chunks,
gradient buffers and optimizer built as `pretrain` builds them, one `TrainStep`); the plain side is
  gpt:   scripts/benchmark_gpt.py's PlainGPT (GPT-2 in plain PyTorch),
  llama: transformers' LlamaForCausalLM (SDPA attention) from a local LlamaConfig,
  bert:  transformers' BertForPreTraining (SDPA attention) from a local BertConfig, masked-LM and
         next-sentence losses,
  moe:   the llama shape with every MLP 8 experts (top-2, each half llama's width) against
         transformers' MixtralForCausalLM with its eager experts (a loop over experts),
each with torch.nn.utils.clip_grad_norm_ and torch.optim.AdamW(fused=True), weight decay on the
matrices alone as megalite groups it. Both sides hold the same number of parameters (asserted; the
plain side's vocabulary is megalite's padded one) and train on the same batch.

Method: both models in one process, interleaved ABBA rounds (A megalite, B plain; A B B A, then
B A A B), warm-up steps first; CPU time per step from time.process_time(). A round's ratio is
megalite's ms per step over plain's; the summary is the median ratio over rounds, its range, and
each side's median ms per step.

--compile compiles both: megalite as its --torch-compile flag does (at tp 1, the model chunk as one
region: embedding, layers, output layer and loss), or with `--megalite-compile layers` each
transformer layer on its own (what the flag does under tensor parallelism; embedding, output layer
and loss eager); the plain side's forward and loss as one torch.compile'd function. --profile runs torch.profiler over a few steps of each side and prints the
top operators by self CPU time side by side, then the operators where the two differ most.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the plain side, beside this file (also when loaded by path)
from benchmark_step_plain import LR, MOE_EXPERTS, MOE_TOPK, Side, build_plain, hf_llama  # noqa: E402
sys.path.insert(0, str(ROOT))

FAMILIES = ("gpt", "llama", "bert", "moe")
# moe: the llama shape with every MLP 8 experts, top-2, each half the dense width (the active MLP
# as wide as llama's), against transformers' MixtralForCausalLM with its eager experts (a loop).


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    groups: int | None  # key/value heads (llama), None: one per head
    ffn: int
    vocab: int  # megalite's --vocab-size (padded by megalite to a multiple of 128)
    positions: int  # learned position table (gpt, bert)
    batch: int
    seq: int
    steps_per_slot: int  # steps timed back to back in each A or B slot of a round


def shape_of(family: str, size: str, quick: bool) -> Shape:
    """The shapes the issue fixes: tiny ~20-60 ms and 124m ~0.5-2 s a step on one thread."""
    if quick:  # the tests' smoke shapes
        if family in ("llama", "moe"):  # a vocabulary megalite does not pad, as the larger llama shapes
            return Shape(2, 64, 4, 2, 160, 1024, 64, 2, 32, 1)
        return Shape(2, 64, 4, None, 256, 1000, 64, 2, 32, 1)
    if size == "tiny":
        if family == "llama":
            return Shape(4, 256, 8, 2, 640, 8192, 128, 2, 32, 2)
        if family == "moe":
            return Shape(4, 256, 8, 2, 320, 8192, 128, 2, 32, 2)
        return Shape(4, 256, 4, None, 1024, 8192, 128, 2, 32, 2)
    vocab = {"gpt": 50257, "llama": 32000, "bert": 30522, "moe": 32000}[family]
    positions = {"gpt": 1024, "llama": 1024, "bert": 512, "moe": 1024}[family]
    if family == "llama":
        return Shape(12, 768, 12, 4, 2048, vocab, positions, 2, 64, 1)
    if family == "moe":
        return Shape(12, 768, 12, 4, 1024, vocab, positions, 2, 64, 1)
    return Shape(12, 768, 12, None, 3072, vocab, positions, 2, 64, 1)


# --------------------------------------------------------------------------------------------
# The two sides


def megalite_args(family: str, s: Shape, compile_layers: bool) -> list[str]:
    model = {"gpt": "gpt-tiny", "llama": "llama-tiny", "bert": "bert-tiny", "moe": "llama-tiny"}[family]
    args = ["--model", model, "--num-layers", str(s.layers), "--hidden-size", str(s.hidden),
            "--num-attention-heads", str(s.heads), "--ffn-hidden-size", str(s.ffn), "--vocab-size", str(s.vocab),
            "--max-position-embeddings", str(s.positions), "--seq-length", str(s.seq),
            "--micro-batch-size", str(s.batch), "--global-batch-size", str(s.batch), "--mock-data",
            "--train-iters", "1000000", "--eval-interval", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--no-progress-bar", "--clip-grad", "1.0", "--lr", str(LR)]
    if s.groups is not None:
        args += ["--group-query-attention", "--num-query-groups", str(s.groups)]
    if family == "moe":
        args += ["--num-experts", str(MOE_EXPERTS), "--moe-router-topk", str(MOE_TOPK),
                 "--moe-ffn-hidden-size", str(s.ffn)]
    return args + (["--torch-compile"] if compile_layers else [])


def _task(family: str):
    import pretrain_bert
    import pretrain_gpt
    return pretrain_bert.task() if family == "bert" else pretrain_gpt.task()


def build_megalite(family: str, s: Shape, compile_mode: str | None, state_dict=None):
    """(Side, batch dict, model config, padded vocabulary) built the way megalite.training.pretrain
    builds a run: parsed flags, setup, model chunks, buffers and optimizer, one TrainStep.
    compile_mode: None (eager), "flag" (--torch-compile: the chunk whole at tp 1) or "layers" (each
    transformer layer compiled on its own).
    `state_dict` (tp = 1 names) is loaded into the model before the optimizer takes its masters."""
    from megalite import parallel, training
    from megalite.config import build_parser
    from megalite.models import compile_layers

    task = _task(family)
    cfg = build_parser("benchmark_step", "gpt-tiny").parse_args(megalite_args(family, s, compile_mode == "flag"))
    cfg = task.prepare(cfg)
    if parallel.model_parallel_is_initialized():  # a second build in this process (the tests)
        parallel.destroy_model_parallel()
    config, _, device = training.setup(cfg, 1)
    chunks = training.build_model_chunks(task, config, cfg, device)
    if state_dict is not None:
        chunks[0].load_state_dict(state_dict)
    if compile_mode == "layers":  # what --torch-compile does under tensor parallelism
        for chunk in chunks:
            compile_layers(chunk)
    buffers, optimizer = training.build_optimizer(cfg, chunks)
    data, _ = task.build_data(config, cfg)
    train_step = training.TrainStep.for_run(cfg, config.hidden_size, chunks, task.forward_step, buffers, optimizer)
    for chunk in chunks:
        chunk.train()
    batches = training.micro_batches(data, 0, cfg, 1, 0, device)
    num_tokens = training.global_normalizer(batches, cfg.training.global_batch_size, None)

    def step():
        result = train_step(batches, num_tokens, lr=LR)
        return result.stats.loss_sum / num_tokens

    params = sum(p.numel() for c in chunks for p in c.parameters())
    return Side("megalite", step, params), batches[0], config, chunks[0].padded_vocab_size


# --------------------------------------------------------------------------------------------
# Timing


def time_slot(side: Side, steps: int) -> float:
    """CPU seconds of `steps` back-to-back steps of one side."""
    gc.collect()
    t0 = time.process_time()
    for _ in range(steps):
        side.step()
    return time.process_time() - t0


def abba_rounds(a: Side, b: Side, rounds: int, steps: int, report=print) -> list[dict]:
    """Rounds A B B A and B A A B alternately; each side's ms per step and the ratio A / B per round."""
    out = []
    for r in range(rounds):
        order = (a, b, b, a) if r % 2 == 0 else (b, a, a, b)
        spent = {a.name: 0.0, b.name: 0.0}
        for side in order:
            spent[side.name] += time_slot(side, steps)
        ms_a, ms_b = (spent[x.name] * 1e3 / (2 * steps) for x in (a, b))
        row = {"order": "".join("A" if x is a else "B" for x in order), f"{a.name}_ms": ms_a, f"{b.name}_ms": ms_b,
               "ratio": ms_a / ms_b}
        out.append(row)
        report(f"round {r + 1:>3} ({' '.join(row['order'])}): {a.name} {ms_a:.3f} ms, {b.name} {ms_b:.3f} ms, "
               f"ratio {row['ratio']:.4f}")
    return out


# --------------------------------------------------------------------------------------------
# Profile


def profile_steps(a: Side, b: Side, steps: int, report=print) -> tuple[dict, dict]:
    """{operator: (self CPU ms per step, calls per step)} of each side: every step profiled on its own,
    the sides alternating, and each operator's median over the steps kept. The profiler's clock is
    wall time, so a step during which the process waited for a core (a shared machine) reads long:
    the steps kept are each side's half (at least one) with the least wall time over CPU time, and
    each step's times are scaled by its CPU time over its wall time."""
    from torch.profiler import ProfilerActivity, profile
    per_step = {a.name: [], b.name: []}
    for i in range(steps):
        for side in (a, b) if i % 2 == 0 else (b, a):
            wall, cpu = time.perf_counter(), time.process_time()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                side.step()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            scale = min(1.0, cpu / max(wall, 1e-9))
            ops = {e.key: (e.self_cpu_time_total / 1e3 * scale, e.count) for e in prof.key_averages()}
            per_step[side.name].append((wall / max(cpu, 1e-9), ops))

    def medians(name):
        kept = sorted(per_step[name], key=lambda x: x[0])[:max(1, (len(per_step[name]) + 1) // 2)]
        report(f"{name}: profiled steps' wall / CPU time {', '.join(f'{w:.2f}' for w, _ in per_step[name])}; "
               f"kept {len(kept)}")
        steps_ops = [o for _, o in kept]
        ops = set().union(*steps_ops)
        return {op: (statistics.median(s.get(op, (0.0, 0))[0] for s in steps_ops),
                     statistics.median(s.get(op, (0.0, 0))[1] for s in steps_ops)) for op in ops}
    return medians(a.name), medians(b.name)


def print_profiles(a: dict, b: dict, names=("megalite", "plain"), top: int = 25, report=print) -> None:
    def ranked(p):
        return sorted(p.items(), key=lambda kv: -kv[1][0])[:top]

    width = 44
    report(f"top {top} operators by self CPU time, ms per step (calls per step)")
    report(f"{names[0]:<{width}} {'ms':>8} {'calls':>6}   | {names[1]:<{width}} {'ms':>8} {'calls':>6}")
    left, right = ranked(a), ranked(b)
    for i in range(max(len(left), len(right))):
        cells = []
        for col in (left, right):
            if i < len(col):
                op, (ms, n) = col[i]
                cells.append(f"{op[:width]:<{width}} {ms:>8.3f} {n:>6.0f}")
            else:
                cells.append(" " * (width + 16))
        report("   | ".join(cells))
    report(f"total self CPU: {names[0]} {sum(v[0] for v in a.values()):.2f} ms/step, "
           f"{names[1]} {sum(v[0] for v in b.values()):.2f} ms/step")
    diff = {op: (a.get(op, (0.0, 0.0)), b.get(op, (0.0, 0.0))) for op in set(a) | set(b)}
    report(f"operators where {names[0]} spends the most over {names[1]} (ms per step; calls per step)")
    for op, (x, y) in sorted(diff.items(), key=lambda kv: -(kv[1][0][0] - kv[1][1][0]))[:top]:
        if x[0] - y[0] <= 0:
            break
        report(f"  {op[:60]:<60} {x[0]:>8.3f} ({x[1]:.0f}) vs {y[0]:>8.3f} ({y[1]:.0f})  +{x[0] - y[0]:.3f}")
    report(f"operators where {names[1]} spends the most over {names[0]}")
    for op, (x, y) in sorted(diff.items(), key=lambda kv: -(kv[1][1][0] - kv[1][0][0]))[:10]:
        if y[0] - x[0] <= 0:
            break
        report(f"  {op[:60]:<60} {x[0]:>8.3f} ({x[1]:.0f}) vs {y[0]:>8.3f} ({y[1]:.0f})  -{y[0] - x[0]:.3f}")


# --------------------------------------------------------------------------------------------
# Where and when


def git_state() -> dict:
    def git(*args):
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None
    changed = git("status", "--porcelain", "--", "megalite", "pretrain_gpt.py", "pretrain_bert.py")
    return {"head": git("rev-parse", "--short", "HEAD"),
            "changed": [line[3:] for line in changed.splitlines()] if changed else []}


def device_string() -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU ({name}), {os.cpu_count()} cores, one thread"


def markdown_row(r: dict) -> str:
    compiled = "eager" if not r["compile"] else f"compile ({r['megalite_compile']})"
    return (f"| {r['family']} | {r['size']} | {compiled} | {r['megalite_ms']:.1f} | {r['plain_ms']:.1f} | "
            f"{r['ratio_median']:.3f} | {r['ratio_min']:.3f}-{r['ratio_max']:.3f} | {r['rounds']} | "
            f"{r['torch']} | {r['date'][:10]} | {r['git']['head']} |")


MARKDOWN_HEADER = ("| family | size | mode | megalite ms/step | plain ms/step | ratio (median) | range | rounds | "
                   "torch | date | git |\n|---|---|---|---|---|---|---|---|---|---|---|")


# --------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=FAMILIES, required=True)
    p.add_argument("--size", choices=("tiny", "124m"), default="tiny")
    p.add_argument("--compile", action="store_true", help="torch.compile both sides")
    p.add_argument("--megalite-compile", choices=("flag", "layers"), default="flag",
                   help="with --compile: as --torch-compile does (the chunk whole at tp 1), or each layer alone")
    p.add_argument("--rounds", type=int, default=None, help="ABBA rounds (default: tiny 20, 124m 10, quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps of each side")
    p.add_argument("--steps-per-slot", type=int, default=None, help="steps in each A or B slot of a round")
    p.add_argument("--profile", action="store_true", help="also profile a few steps of each side, op by op")
    p.add_argument("--profile-steps", type=int, default=5, help="steps profiled per side (medians per operator)")
    p.add_argument("--top", type=int, default=25, help="operators listed by --profile")
    p.add_argument("--same-weights", action="store_true",
                   help="llama: megalite loads the Hugging Face model's weights (megalite.tools.convert_hf), so "
                        "the first-step losses must agree")
    p.add_argument("--quick", action="store_true", help="2 layers, hidden 64, sequence 32: checks the script")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.same_weights and args.family != "llama":
        p.error("--same-weights is for --family llama")
    torch.set_num_threads(1)
    git = git_state()  # the code as this run imports it (others may commit while it runs)
    s = shape_of(args.family, args.size, args.quick)
    if args.steps_per_slot:
        s = Shape(**{**asdict(s), "steps_per_slot": args.steps_per_slot})
    rounds = args.rounds or (2 if args.quick else 20 if args.size == "tiny" else 10)
    warmup = args.warmup if args.warmup is not None else (
        1 if args.quick else 5 if args.size == "tiny" else 2) + (3 if args.compile else 0)
    mode = None if not args.compile else args.megalite_compile

    hf_model, state_dict = None, None
    if args.same_weights:
        from megalite.parallel.layers import pad_vocab_size
        from megalite.tools.convert_hf import from_hf
        if pad_vocab_size(s.vocab, 1) != s.vocab:
            p.error(f"--same-weights needs a vocabulary megalite does not pad (not {s.vocab}): megalite masks the "
                    f"padding logits, Hugging Face's model would not")
        torch.manual_seed(0)
        hf_model = hf_llama(s, s.vocab)
        _, state_dict = from_hf(hf_model)
    a, batch, config, padded = build_megalite(args.family, s, mode, state_dict)
    b = build_plain(args.family, s, padded, batch, args.compile, hf_model)
    if a.num_params != b.num_params:
        raise AssertionError(f"parameter counts differ: megalite {a.num_params}, plain {b.num_params}")
    print(f"{args.family} {args.size}{' (quick)' if args.quick else ''}: {s.layers} layers, hidden {s.hidden}, "
          f"{s.heads} heads" + (f" in {s.groups} groups" if s.groups else "") + f", ffn {s.ffn}, vocab {s.vocab} "
          f"(padded {padded}), batch {s.batch} x seq {s.seq}; {a.num_params:,} parameters each; "
          f"{'compiled (megalite: ' + mode + ')' if mode else 'eager'}; torch {torch.__version__}; {device_string()}",
          flush=True)

    first = {}
    for i in range(warmup):
        for side in (a, b) if i % 2 == 0 else (b, a):
            loss = side.step()
            first.setdefault(side.name, float(loss))
    print(f"first-step loss: megalite {first['megalite']:.6f}, plain {first['plain']:.6f} "
          f"(difference {abs(first['megalite'] - first['plain']):.2e})", flush=True)
    rows = abba_rounds(a, b, rounds, s.steps_per_slot, report=lambda line: print(line, flush=True))
    ratios = [r["ratio"] for r in rows]
    import transformers
    result = {
        "family": args.family, "size": args.size, "quick": args.quick, "compile": args.compile,
        "megalite_compile": mode, "shape": asdict(s), "padded_vocab": padded,
        "params": {"megalite": a.num_params, "plain": b.num_params},
        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "rounds": len(rows), "steps_per_slot": s.steps_per_slot, "warmup": warmup,
        "megalite_ms": statistics.median(r["megalite_ms"] for r in rows),
        "plain_ms": statistics.median(r["plain_ms"] for r in rows),
        "per_round": rows, "first_loss": first,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "device": device_string(), "git": git,
    }
    result["markdown"] = markdown_row(result)
    print(f"ratio megalite / plain: median {result['ratio_median']:.4f} (range {result['ratio_min']:.4f}-"
          f"{result['ratio_max']:.4f}, {len(rows)} rounds); megalite {result['megalite_ms']:.3f} ms/step, plain "
          f"{result['plain_ms']:.3f} ms/step")
    print(MARKDOWN_HEADER)
    print(result["markdown"], flush=True)
    if args.profile:
        prof_a, prof_b = profile_steps(a, b, args.profile_steps)
        print_profiles(prof_a, prof_b, top=args.top)
        result["profile"] = {"steps": args.profile_steps,
                             "megalite": {k: list(v) for k, v in prof_a.items()},
                             "plain": {k: list(v) for k, v in prof_b.items()}}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
