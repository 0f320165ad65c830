"""The layout planner's data-parallel sharding (megalite.tools.plan): each ZeRO stage's state, transient
peak and traffic equal what a real step holds and sends, stage 3's units are megalite's, searches
propose the stage that makes a model fit; local SGD's outer all-reduce is the DP traffic it plans."""
import shlex

import pytest

from megalite import arguments
from megalite.models import preset
from megalite.pipeline.schedules import build_program
from megalite.testing import run_ranks
from megalite.tools import plan as P
from test_plan import TINY
from test_plan_cli import run_cli
from training_ranks import parse


def held_at_each_zero_stage(rank, world, argv, variants):
    """Train one step per variant (a --zero-stage and precision) as pretrain does and report what
    this rank's buffers store (`stored_bytes()`: parameters, gradients, the step's transient peak),
    the optimizer's state, and the bytes sent over data parallelism in the step (ring volumes)."""
    from fractions import Fraction

    from training_ranks import gpt_run

    from megalite import parallel
    from megalite.testing import counting_collectives, ring_bytes

    out = []
    for extra in variants:
        sent = dict.fromkeys(("all_reduce", "reduce_scatter", "all_gather"), Fraction(0))

        def record(kind, nbytes, n, sent=sent):
            sent[kind] += ring_bytes(kind, nbytes, n)

        with counting_collectives(record, dp_buffers_only=True):
            run = gpt_run(argv + extra)
        for buf in run.buffers:  # pretrain's return gathers stage 3's parameters whole: not the step's
            if any(why == "pin" for _, why in getattr(buf, "gather_log", [])):
                sent["all_gather"] -= ring_bytes("all_gather", buf.numel * buf.param_dtype.itemsize, buf.dp_size)
        stored = [buf.stored_bytes() for buf in run.buffers]
        out.append({"pp_rank": parallel.get_pipeline_model_parallel_rank(),
                    "dp_rank": parallel.get_data_parallel_rank(),
                    "params": sum(x["params"] for x in stored), "grads": sum(x["grads"] for x in stored),
                    "peak_transient": max(x.get("peak_transient", 0) for x in stored),
                    "optimizer": run.optimizer.state_bytes(), "sent": sent})
    return out


ZERO_STEP = TINY + ["--eval-iters", "0", "--log-interval", "1"]  # 4 layers, m = 2 micro-batches at dp 2
BF16_SHARDS = ["--bf16", "--grad-reduce-dtype", "bf16"]
ZERO_VARIANTS = [["--zero-stage", str(stage), *precision] for precision in ([], BF16_SHARDS) for stage in (0, 1, 2, 3)]


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["tp1-pp1-dp2", "tp2-pp1-dp2", "tp1-pp2-dp2"])
def test_predicted_zero_stage_state_transient_peak_and_traffic_equal_a_real_step(tp, pp):
    """At every ZeRO stage, fp32 and bf16 (with bf16 gradient reduction: bf16 shards at stages
    2-3): stored parameter and gradient bytes and optimizer state equal the prediction exactly; the
    transient peak of a training step (whole-bucket gradients, stage 3's gathered units) is within
    10% (it comes out equal); the bytes sent over data parallelism follow the stage's formula."""
    dp = 2
    argv = ZERO_STEP + ["--tp", str(tp), "--pp", str(pp)]
    results = run_ranks(held_at_each_zero_stage, tp * pp * dp, args=(argv, ZERO_VARIANTS), timeout=300)
    for v, flags in enumerate(ZERO_VARIANTS):
        args = parse(argv + flags)
        config = arguments.model_config(args)
        dtype = "bf16" if args.precision.bf16 else "fp32"
        m = args.training.global_batch_size // (args.training.micro_batch_size * dp)
        for got in (r[v] for r in results):
            want = P.rank_state_bytes(config, tp=tp, pp=pp, dp=dp, pp_rank=got["pp_rank"], dp_rank=got["dp_rank"],
                                      dtype=dtype, zero_stage=args.data_parallel.zero_stage, grad_dtype=args.data_parallel.grad_reduce_dtype,
                                      seq_length=args.model.seq_length, ddp_bucket_size=args.data_parallel.ddp_bucket_size)
            label = f"tp{tp} pp{pp} dp{dp} {flags} rank (pp {got['pp_rank']}, dp {got['dp_rank']})"
            assert (got["params"], got["grads"], got["optimizer"]) == (want.param_buffer, want.grads,
                                                                      want.optimizer), label
            if args.data_parallel.zero_stage >= 2:
                assert got["peak_transient"] > 0 and want.transient == pytest.approx(got["peak_transient"], rel=0.10)
            else:
                assert want.transient == 0, label
            kept = 0
            if args.data_parallel.zero_stage == 3:  # the units each turn finds whole (one chunk a rank)
                kinds = "".join(op.kind for op in build_program(pp, got["pp_rank"], m) if op.kind in "FB")
                kept = P.turn_kept(kinds, [b.end - b.start for b in want.buckets[0]], want.layer_buckets[0],
                                   got["pp_rank"] == 0)[0]
            traffic = P.dp_traffic(args.data_parallel.zero_stage, want.padded_numel, dp, m, P.DTYPE_BYTES[dtype],
                                   P.DTYPE_BYTES[args.data_parallel.grad_reduce_dtype], turn_kept=kept)
            assert {k: float(x) for k, x in got["sent"].items()} == traffic, label


def test_units_kept_after_forward_are_gathered_as_the_interleaved_schedule_predicts():
    """Interleaved 1F1B forwards every micro-batch of a chunk before its first backward: units kept
    from forward to backward (or for the step) are gathered once a step, and the prediction's
    traffic and state say so on every rank."""
    dp, argv = 2, ZERO_STEP + ["--pp", "2", "--vpp", "2"]
    variants = [["--zero-stage", "3", "--zero-reshard-after-forward", "false"],
                ["--zero-stage", "3", "--zero-keep-params-for-step"]]
    results = run_ranks(held_at_each_zero_stage, 2 * dp, args=(argv, variants), timeout=300)
    for v, flags in enumerate(variants):
        args = parse(argv + flags)
        run = P.Run(args.training.global_batch_size, args.model.seq_length, "fp32", args.data_parallel.ddp_bucket_size,
                    zero_reshard_after_forward=args.data_parallel.zero_reshard_after_forward,
                    zero_keep_params_for_step=args.data_parallel.zero_keep_params_for_step)
        pred = P.predict(arguments.model_config(args), P.Layout(1, 2, dp, 2, args.training.micro_batch_size, zero_stage=3),
                         P.Cluster(gpus=2 * dp), run=run)
        for got in (r[v] for r in results):
            predicted = pred.dp_parts[got["pp_rank"]].traffic
            assert {k: float(x) for k, x in got["sent"].items()} == predicted, (flags, got["pp_rank"])
            state = pred.stages[got["pp_rank"]].state
            assert predicted["all_gather"] == state.padded_numel / 2 * 4  # one gather a step: (d-1)/d * N * 4 B
            assert (got["params"], got["grads"], got["optimizer"]) == (state.param_buffer, state.grads,
                                                                      state.optimizer)


def test_rank_state_bytes_keeps_the_distributed_optimizer_keyword_as_stage_1():
    config = preset("gpt-tiny")
    old = P.rank_state_bytes(config, dp=4, distributed_optimizer=True, seq_length=64)
    new = P.rank_state_bytes(config, dp=4, zero_stage=1, seq_length=64)
    assert (old.zero_stage, old.param_buffer, old.grads, old.optimizer) == (1, new.param_buffer, new.grads,
                                                                           new.optimizer)
    assert P.Layout(1, 1, 4, None, 1, "none", False, True).zero_stage == 1
    assert P.Layout(1, 1, 4, zero_stage=3).distributed_optimizer
    with pytest.raises(ValueError, match="stage 1"):
        P.rank_state_bytes(config, dp=4, distributed_optimizer=True, zero_stage=0)


def test_stage_3_units_are_megalites_layer_units_of_the_built_chunk():
    """The planner's stand-in chunk gives `layer_units` the units a GPTModel stage built on the
    meta device gives it (pipeline rank 0 and the last, with the tied copy deferred)."""
    import torch

    from megalite.models import GPTModel
    from megalite.optim.zero import layer_units
    from megalite.tools.plan.memory import chunk_units

    config = preset("gpt-tiny")
    for pp, r in ((1, 0), (2, 0), (2, 1)):
        model = GPTModel(config, r == 0, r == pp - 1, layer_numbers=list(range(config.num_layers // pp)), seed=0,
                         device=torch.device("meta"))
        params = list(model.parameters())
        deferred = {id(p) for p in params if pp > 1 and getattr(p, "tied_embedding", False)}
        built = layer_units(model, params, lambda p, deferred=deferred: id(p) in deferred)
        seq = config.max_position_embeddings
        counted = P.rank_parameters(config, 1, pp, None, r, seq)[0]
        layers = P.inputs.rank_parameter_layers(config, 1, pp, None, r, seq)[0]
        assert chunk_units(counted, layers) == built, (pp, r)


def test_traffic_per_step_follows_each_stages_formula():
    N, dp, m = 1000, 4, 3
    ring = (dp - 1) / dp
    per_stage = {s: P.dp_traffic(s, N, dp, m, 2, 2) for s in (0, 1, 2, 3)}
    total = {s: sum(x.values()) for s, x in per_stage.items()}
    assert per_stage[0] == {"all_reduce": 2 * ring * N * 2, "reduce_scatter": 0, "all_gather": 0}
    assert total[1] == 2 * ring * N * 2 == total[0]
    assert per_stage[2]["reduce_scatter"] == m * ring * N * 2 and per_stage[2]["all_gather"] == ring * N * 2
    assert per_stage[3] == {"all_reduce": 0, "reduce_scatter": m * ring * N * 2, "all_gather": 2 * m * ring * N * 2}
    one = {s: sum(P.dp_traffic(s, N, dp, 1, 2, 2).values()) for s in (0, 1, 2, 3)}
    assert one[2] == one[1] and one[3] == 1.5 * one[0]  # the issue's: stage 2 as stage 1, stage 3 1.5x plain
    assert sum(P.dp_traffic(3, N, dp, m, 2, 2, reshard_after_forward=False).values()) == 2 * m * ring * N * 2
    assert sum(P.dp_traffic(3, N, dp, m, 2, 2, keep_params_for_step=True).values()) == (m + 1) * ring * N * 2


def test_a_search_proposes_zero_3_where_it_is_what_makes_the_model_fit(capsys):
    config, cluster = preset("gpt-1.3b"), P.Cluster(gpus=8, gpu_memory_gib=8, overhead_gib=0.5)
    kwargs = {"tp": 1, "pp": 1, "micro_batch_size": 1, "recompute": "full"}
    result = P.plan(config, cluster, 8, 2048, **kwargs)
    assert result.best is not None and result.best.layout.zero_stage == 3
    assert {x.layout.zero_stage for x in result} == {3}  # stages 0-2 of this layout do not fit
    assert "does not fit" in result.rejected and result.rejected["does not fit"].count == 3
    assert P.stage_that_makes_it_fit(result.best) == 3
    assert "ZeRO stage 3 is what makes this layout fit" in P.explain(result.best)
    assert "--zero-stage 3" in result.best.command()
    code, out, _ = run_cli(["--model", "gpt-1.3b", "--gpus", "8", "--gpu-memory-gib", "8", "--overhead-gib", "0.5",
                            "--global-batch-size", "8", "--seq-length", "2048", "--tp", "1", "--pp", "1",
                            "--micro-batch-size", "1", "--recompute", "full"], capsys)
    assert code == 0 and "--zero-stage 3" in out and "ZeRO stage 3 is what makes this layout fit" in out
    # With room for every stage, across nodes and with 4 micro-batches (stage 3 gathers each layer
    # twice per micro-batch), a lower stage is faster, and it fits without a note.
    roomy = P.plan(config, P.Cluster(gpus=16, gpu_memory_gib=80), 64, 2048, **kwargs)
    assert roomy.best.layout.zero_stage == 1 and P.stage_that_makes_it_fit(roomy.best) is None
    assert max(roomy, key=lambda x: x.step_time).layout.zero_stage == 3
    assert P.plan(config, cluster, 8, 2048, zero_stage=(0, 1, 2), **kwargs).best is None


def test_lowest_stage_first_at_equal_speed_and_the_stage_in_the_command():
    config = preset("gpt2-124m")
    stages = P.plan(config, P.Cluster(gpus=2, gpu_memory_gib=80), 8, 1024, tp=1, pp=1, micro_batch_size=4,
                    recompute="none", sequence_parallel=False)
    assert sorted(x.layout.zero_stage for x in stages) == [0, 1, 2, 3]
    by_stage = {x.layout.zero_stage: x for x in stages}
    # Less stored at each stage (though at 124M parameters stage 2's three whole 40M-element buckets
    # in flight outweigh the gradients it saves), and the list is by time, lower stage first on a tie.
    stored = [by_stage[s].memory.states for s in range(4)]
    assert stored == sorted(stored, reverse=True) and len(set(stored)) == 4
    assert by_stage[2].memory.zero_transient > by_stage[1].memory.gradients - by_stage[2].memory.gradients
    for a, b in zip(stages.predictions, stages.predictions[1:]):
        assert (a.step_time, a.layout.zero_stage) <= (b.step_time, b.layout.zero_stage)
    assert "--use-distributed-optimizer" in by_stage[1].command() and "--zero-stage" not in by_stage[1].command()
    assert "--zero-stage 2" in by_stage[2].command() and "--use-distributed-optimizer" not in by_stage[2].command()
    old_keyword = P.plan(config, P.Cluster(gpus=2), 8, 1024, distributed_optimizer=True, tp=1, pp=1)
    assert {x.layout.zero_stage for x in old_keyword} == {1}
    words = shlex.split(by_stage[3].command())
    args = arguments.build_parser("x", default_model="gpt-tiny").parse_args(words[words.index("pretrain_gpt.py") + 1:])
    assert args.data_parallel.zero_stage == 3 and args.data_parallel.use_distributed_optimizer


# -- local SGD (--local-sgd-interval H) ------------------------------------------------------------

def outer_bytes_sent(rank, world, argv):
    from training_ranks import gpt_run

    return gpt_run(argv).local_sgd.sent_bytes


@pytest.mark.parametrize("extra", [[], ["--outer-grad-dtype", "bf16", "--local-sgd-fragments", "2"]],
                         ids=["fp32", "bf16-streaming"])
def test_local_sgd_dp_traffic_is_the_outer_all_reduce_that_training_sends_over_h(extra):
    from megalite.training.plan_check import check_run

    argv = TINY[:-4] + ["--train-iters", "4", "--local-sgd-interval", "2", *extra]
    sent = run_ranks(outer_bytes_sent, 2, args=(argv,))[0]  # whole tensors handed to the all-reduce, 2 rounds
    args = parse(argv)
    arguments.validate(args, 2, arguments.model_config(args))
    _, pred = check_run(args, 2, gpu_memory_bytes=80 * P.GIB)
    traffic = pred.dp_parts[pred.dp_stage].traffic
    assert set(traffic) == {"outer_all_reduce"}  # no per-step gradient reduction across replicas
    assert traffic["outer_all_reduce"] * 4 == pytest.approx(2 * (2 - 1) / 2 * sent, rel=1e-12)


def test_local_sgd_cuts_dp_bytes_per_step_by_h_and_hides_them_when_async():
    config = preset("gpt-1.3b")
    common = dict(tp=2, pp=1, dp=8, micro_batch_size=1, global_batch_size=512, seq_length=2048,
                  gpu_memory_bytes=80 * P.GIB, cluster=P.Cluster(gpus=16), grad_reduce_dtype="fp32")
    _, plain = P.check_layout(config, **common)
    _, local = P.check_layout(config, **common, local_sgd={"local_sgd_interval": 16})
    _, bf16 = P.check_layout(config, **common, local_sgd={"local_sgd_interval": 16, "outer_grad_dtype": "bf16"})
    _, stream = P.check_layout(config, **common, local_sgd={"local_sgd_interval": 16, "local_sgd_fragments": 4})
    _, hidden = P.check_layout(config, **common, local_sgd={"local_sgd_interval": 16, "local_sgd_async": True})
    per_step = sum(plain.dp_parts[0].traffic.values())
    numel = local.stages[0].state.numel
    outer = local.dp_parts[0].traffic["outer_all_reduce"]
    assert outer == pytest.approx(2 * 7 / 8 * numel * 4 / 16)
    assert outer <= per_step / 16  # the gradient layout's padding only adds to plain DP's bytes
    assert bf16.dp_parts[0].traffic["outer_all_reduce"] == pytest.approx(outer / 2)
    assert stream.dp_parts[0].traffic["outer_all_reduce"] == pytest.approx(outer)  # 1/F every H/F steps
    assert local.time.dp_comm > 0 and hidden.time.dp_comm == 0
    assert local.memory.optimizer == pytest.approx(plain.memory.optimizer + 8 * numel)  # outer params + momentum
    cmd = hidden.command()
    assert "--local-sgd-interval 16 --local-sgd-async" in cmd and "--use-distributed-optimizer" not in cmd


def test_local_sgd_plans_only_unsharded_optimizers():
    result = P.plan(preset("gpt-1.3b"), P.Cluster(gpus=16), 512, 2048, tp=2, pp=1,
                    local_sgd={"local_sgd_interval": 8})
    assert result.best is not None and {x.layout.zero_stage for x in result} == {0}
    assert "--local-sgd-interval 8" in result.best.command()
    with pytest.raises(ValueError, match="ZeRO stage 1 is refused"):
        P.check_layout(preset("gpt-1.3b"), tp=2, dp=8, global_batch_size=512, seq_length=2048,
                       gpu_memory_bytes=80 * P.GIB, use_distributed_optimizer=True,
                       local_sgd={"local_sgd_interval": 8})
