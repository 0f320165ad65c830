"""What the GPU path costs, measured where no GPU is needed: host synchronizations per training
step and bytes sent per step against the analytical minimum, on CPU ranks (gloo).

    python scripts/bench_cpu_path.py --json cpu_path.json

- Host syncs: the calls that make the host wait for a GPU (`.item()`, `.tolist()`, `bool(t)`,
  `torch.cuda.synchronize()`, ...), counted in the steady-state iterations between log lines
  (megalite.testing.count_host_syncs; the same calls run on CPU as on a GPU).
- Bytes: what each rank sends in one step's gradient reduction and parameter all-gather (ring
  collectives), against the minimum its layout allows (megalite.testing.gradient_traffic).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megalite import arguments  # noqa: E402
from megalite.testing import run_ranks  # noqa: E402

SHAPE = ["--mock-data", "--seq-length", "16", "--micro-batch-size", "1", "--eval-interval", "0"]
SYNC_CASES = {  # name: (ranks, flags)
    "tp2-pp2-dp2 fp32, distributed optimizer": (8, ["--tp", "2", "--pp", "2", "--use-distributed-optimizer"]),
    "pp2 bf16": (2, ["--pp", "2", "--bf16"]),
    "pp2 fp16, dynamic loss scale": (2, ["--pp", "2", "--fp16"]),
}
TRAFFIC_CASES = {
    "pp2-dp2, distributed optimizer": (4, ["--pp", "2", "--use-distributed-optimizer"]),
    "tp2-dp2, distributed optimizer": (4, ["--tp", "2", "--use-distributed-optimizer"]),
    "dp2, plain optimizer": (2, []),
}


def _parse(argv):
    return arguments.build_parser("bench", default_model="gpt-tiny").parse_args(SHAPE + argv)


def syncs_per_step(rank, world, argv, iters):
    from megalite import runtime
    from megalite.testing import count_host_syncs
    from megalite.training import Task, gpt_forward_step, pretrain

    import pretrain_gpt

    with count_host_syncs(label=lambda: runtime._PHASE[0]) as seen:
        pretrain(_parse(argv + ["--train-iters", str(iters + 2), "--log-interval", str(iters + 2),
                                "--global-batch-size", "4"]),
                 Task(pretrain_gpt.build_model, pretrain_gpt.build_data, gpt_forward_step))
    steady = tuple(f"iteration {i}:" for i in range(2, iters + 2))  # not the first, not the logged last
    return len(seen.during(lambda phase: phase.startswith(steady))) / iters


def traffic(rank, world, argv):
    from megalite.testing import gradient_traffic

    sent, minimum, _ = gradient_traffic(_parse(argv + ["--global-batch-size", "8", "--ddp-bucket-size", "20000"]),
                                        world)
    return float(sent), float(minimum)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=3, help="steady-state iterations counted")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    out = {"host_syncs_per_step": {}, "bytes_per_step": {}}
    for name, (world, flags) in SYNC_CASES.items():
        per_rank = run_ranks(syncs_per_step, world, args=(flags, args.iters), timeout=600)
        out["host_syncs_per_step"][name] = max(per_rank)
        print(f"host syncs per steady-state step, {name}: {max(per_rank):g} (max over {world} ranks)")
    for name, (world, flags) in TRAFFIC_CASES.items():
        per_rank = run_ranks(traffic, world, args=(flags,), timeout=600)
        sent, minimum = max(per_rank)
        out["bytes_per_step"][name] = {"sent": sent, "minimum": minimum, "ratio": sent / minimum}
        print(f"bytes sent per step, {name}: {sent:.0f} (minimum {minimum:.0f}, ratio {sent / minimum:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
