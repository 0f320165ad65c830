"""Rank functions that run the real training loop inside `run_ranks` (no torchrun needed)."""
from __future__ import annotations

import torch

from megalite import arguments, parallel
from megalite.training import pretrain

import pretrain_gpt


def entry_main(rank, world, argv, entry="pretrain_gpt"):
    """A rank of `run_ranks` running an entry point's main(argv), as a torchrun worker runs it: its
    exit code, stdout and stderr."""
    import contextlib
    import importlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = importlib.import_module(entry).main(argv)
    return code, out.getvalue(), err.getvalue()


def parse(argv):
    """Tests train on the synthetic stream unless they name data. On it, a run that says nothing of
    validation validates on one global batch, not the default four: the same code at each layout, a
    quarter of the time (a test that asserts on validation names its --eval-iters)."""
    if not {"--data-path", "--sft-data-path", "--train-data-path", "--valid-data-path", "--test-data-path",
            "--data-args-path", "--per-split-data-args-path"} & set(argv):
        argv = ["--mock-data", *([] if {"--eval-iters", "--config"} & set(argv) else ["--eval-iters", "1"]), *argv]
    return arguments.build_parser("test", default_model="gpt-tiny").parse_args(argv)


def paired_runs(fn, world: int, pairs: dict, *args) -> dict:
    """One spawn of ranks for an equality matrix: `fn(rank, world, runs, *args)` trains every run of
    `pairs` (name -> (argv, argv)) and returns one result per run; by name, each rank's two results."""
    from megalite.testing import run_ranks

    runs = [argv for pair in pairs.values() for argv in pair]
    results = run_ranks(fn, world, args=(runs, *args), timeout=600)
    return {name: [(r[2 * i], r[2 * i + 1]) for r in results] for i, name in enumerate(pairs)}


def refusal(argv, world: int) -> str:
    """The UsageError validating `argv` at `world` ranks ends with, checked to be one line."""
    from megalite.config import model_config, validate
    from megalite.errors import UsageError

    config = parse(argv)
    try:
        validate(config, world, model_config(config), machine=False)
    except UsageError as e:
        message = str(e)
        assert "\n" not in message, message
        return message
    raise AssertionError(f"accepted: {argv}")


def run_refusal(argv) -> str:
    """The UsageError a training run of `argv` ends with (checks made once the run starts: the
    checkpoint, the data), checked to be one line."""
    from megalite.errors import UsageError

    try:
        gpt_run(argv)
    except UsageError as e:
        assert "\n" not in str(e), str(e)
        return str(e)
    raise AssertionError(f"accepted: {argv}")


def built_model(argv):
    """The TransformerConfig `argv` builds (a section check's error as the UsageError the run would raise)."""
    from megalite.config import model_config

    return model_config(parse(argv))


def gpt_run(argv):
    return pretrain(parse(argv), pretrain_gpt.task())


def whole_params(run) -> dict:
    """fp32 copies of every parameter of a finished run (gathered at ZeRO stage 3), by chunk and name."""
    with run.optimizer.whole_parameters():
        return {f"{i}.{n}": p.detach().float().clone() for i, c in enumerate(run.model_chunks)
                for n, p in c.named_parameters()}


def placed_params(run) -> dict:
    """fp32 copies of every parameter of a finished run by layout-free name and the TP and expert-
    parallel rank that holds the piece: the same keys whichever pipeline rank or chunk holds a
    layer, so runs whose schedules place chunks differently compare (merge the ranks' dicts)."""
    from megalite.checkpoint.layout import global_name

    key = (parallel.get_tensor_model_parallel_rank(), parallel.get_expert_model_parallel_rank())
    out = {}
    with run.optimizer.whole_parameters():
        for c in run.model_chunks:
            for n, p in c.named_parameters():
                out.setdefault((global_name(c, n), *key), []).append(p.detach().float().clone())
    return out


def train_losses(rank, world, argv):
    return [r["loss"] for r in gpt_run(argv).records]


def train_and_check_tied_embeddings(rank, world, argv):
    """Losses, plus whether the first and last stage still hold the same word embedding."""
    run = gpt_run(argv)
    emb = [p for name, p in whole_params(run).items() if name.endswith("word_embeddings.weight")]
    same = None
    group = parallel.get_embedding_group()
    if emb and group is not None and parallel.get_pipeline_model_parallel_world_size() > 1:
        w = emb[0].clone()
        other = w.clone()
        torch.distributed.all_reduce(other, group=group)  # first + last
        same = torch.equal(other, 2 * w)
    return [r["loss"] for r in run.records], same


def train_params(rank, world, argv):
    """Parameters after training (fp32 copies), with the records and optimizer-state bytes."""
    run = gpt_run(argv)
    params = whole_params(run)
    adam_steps = [int(s["step"]) for s in run.optimizer.inner.state.values() if "step" in s]
    return {"params": params, "records": run.records, "state_bytes": run.optimizer.state_bytes(),
            "adam_steps": max(adam_steps) if adam_steps else 0}


def steady_host_syncs(rank, world, argvs):
    """Per run, the host syncs of its iterations 2 and 3 (after the first step's one-time work)."""
    from megalite import runtime
    from megalite.testing import count_host_syncs

    counts = []
    for argv in argvs:
        with count_host_syncs(label=lambda: runtime._PHASE[0]) as seen:
            train_params(rank, world, argv)
        counts.append(len(seen.during(lambda phase: phase.startswith(("iteration 2:", "iteration 3:")))))
    return counts


def train_with_inf_at(rank, world, argv, bad_iteration, through=None):
    """Train, making every micro-batch loss of iterations bad_iteration..through (default just
    that one) infinite (a forced overflow)."""
    from megalite.training import Task

    base = pretrain_gpt.task()
    calls = {"n": 0}
    args = parse(argv)
    per_iteration = args.training.global_batch_size // args.training.micro_batch_size  # dp=1, pp=1 in this test

    def forward_step(model, batch):
        out = base.forward_step(model, batch)
        calls["n"] += 1
        if bad_iteration - 1 <= (calls["n"] - 1) // per_iteration <= (through or bad_iteration) - 1:
            out = out * float("inf")
        return out

    run = pretrain(args, Task(base.build_model, base.build_data, forward_step))
    steps = [int(s["step"]) for s in run.optimizer.inner.state.values() if "step" in s]
    return run.records, max(steps)


def several(rank, world, fn, argvs):
    """fn(rank, world, argv) for each argv in turn, in one set of ranks (one spawn, one process group)."""
    return [fn(rank, world, argv) for argv in argvs]


def apart(rank, world, fn, argvs):
    """fn(0, 1, argv) for every `world`-th argv from this rank's, in a one-rank process group of this
    rank's own: one-device runs of one spawn, side by side on the cores (see `one_device_each`)."""
    import os
    import tempfile

    import torch.distributed as dist

    dist.destroy_process_group()
    fd, store = tempfile.mkstemp(prefix="megalite-apart-")
    os.close(fd)
    os.unlink(store)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        return [fn(0, 1, argv) for argv in argvs[rank::world]]
    finally:
        dist.destroy_process_group()
        if os.path.exists(store):
            os.unlink(store)


def one_device_each(fn, argvs, ranks=2, **kw):
    """[fn(0, 1, argv) for argv in argvs], each a one-device run, `ranks` at a time in one spawn."""
    from megalite.testing import run_ranks

    out = [None] * len(argvs)
    for rank, results in enumerate(run_ranks(apart, ranks, args=(fn, list(argvs)), **kw)):
        out[rank::ranks] = results
    return out


def side_by_side(*calls):
    """Each zero-argument call (a `run_ranks` or `one_device_each`) in a thread of its own, all at
    once; their results in order. For spawns that leave cores idle, e.g. one long one-device run
    (a compile) beside a two-rank matrix: the spawns' processes share the cores."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]
