"""The layout planner (megalite.tools.plan): its parameter, gradient and optimizer bytes equal what
megalite allocates; published layouts come out feasible and near-best (the command line:
test_plan_cli.py; ZeRO stages and local SGD: test_plan_zero.py)."""
import pytest

from megalite import arguments
from megalite.models import preset
from megalite.parallel.layers import pad_vocab_size
from megalite.pipeline.schedules import build_program
from megalite.testing import run_ranks
from megalite.tools import plan as P
from test_plan_cli import run_cli
from test_schedule_programs import schedule_cases
from training_ranks import parse

TINY = ["--seq-length", "32", "--global-batch-size", "8", "--micro-batch-size", "2", "--train-iters", "1",
        "--ddp-bucket-size", "30000"]


def held_bytes(rank, world, argv, variants):
    """Build the model and optimizer as training does, once per variant (extra flags), take one
    optimizer step (Adam allocates its states lazily) and report what this rank holds."""
    import torch

    import pretrain_gpt
    from megalite import parallel, training

    training.setup(parse(argv), world)  # process groups once: the variants share the layout
    device = torch.device("cpu")
    out = []
    for extra in variants:
        args = parse(argv + extra)
        config = arguments.model_config(args)
        chunks = training.build_model_chunks(pretrain_gpt.task(), config, args, device)
        buffers, optimizer = training.build_optimizer(args, chunks)
        optimizer.step(1e-3, 1.0)
        params = [p for c in chunks for p in c.parameters()]
        out.append({
            "pp_rank": parallel.get_pipeline_model_parallel_rank(), "dp_rank": parallel.get_data_parallel_rank(),
            "dp_cp_rank": parallel.get_data_parallel_rank(with_context_parallel=True),
            "params": sum(p.numel() * p.element_size() for p in params),
            "param_buffer": sum(b.param_data.numel() * b.param_data.element_size() for b in buffers),
            "grads": sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
            "grad_padding": sum((b.numel - sum(b.numel_of.values())) * 4 for b in buffers),
            "optimizer": optimizer.state_bytes(),
            "fp32_masters_in_place": all(optimizer._in_place(pc) for pc in optimizer.pieces),
        })
    return out


PLAIN, DIST = [], ["--use-distributed-optimizer"]
CASES = [  # (tp, pp, dp, extra flags, variants: each built and stepped on the same process groups)
    (1, 1, 1, [], [PLAIN, DIST]),
    (2, 1, 1, [], [PLAIN, DIST]),
    (1, 2, 1, [], [PLAIN, DIST]),
    (2, 2, 1, ["--vpp", "2"], [PLAIN, DIST]),  # interleaved: two model chunks per rank
    (1, 2, 1, ["--pipeline-schedule", "zb-v"], [PLAIN, DIST]),  # two chunks in a V: rank 0 first and last
    (1, 2, 2, [], [PLAIN, DIST, ["--bf16"], ["--bf16", *DIST]]),  # bf16: fp32 master copies
    (2, 2, 2, [], [PLAIN, DIST]),
    # dp = 3: buckets padded to a multiple of 3, shards cut through parameters, ranks own different amounts
    (1, 1, 3, ["--global-batch-size", "12"], [PLAIN, DIST, ["--bf16", *DIST]]),
]


@pytest.mark.parametrize("tp,pp,dp,extra,variants", CASES,
                         ids=[f"tp{c[0]}-pp{c[1]}-dp{c[2]}" + ("-zb-v" if "zb-v" in c[3] else "") for c in CASES])
def test_predicted_state_bytes_equal_what_megalite_allocates(tp, pp, dp, extra, variants):
    argv = TINY + ["--tp", str(tp), "--pp", str(pp)] + extra
    results = run_ranks(held_bytes, tp * pp * dp, args=(argv, variants), timeout=120)
    for v, flags in enumerate(variants):
        args = parse(argv + flags)
        config = arguments.model_config(args)
        dtype = "bf16" if args.precision.bf16 else "fp32"
        dist_opt = args.data_parallel.use_distributed_optimizer
        per_rank = [r[v] for r in results]
        for got in per_rank:
            want = P.rank_state_bytes(config, tp=tp, pp=pp, dp=dp, vpp=args.parallel.vpp, pp_rank=got["pp_rank"],
                                      dp_rank=got["dp_rank"], dtype=dtype, distributed_optimizer=dist_opt,
                                      seq_length=args.model.seq_length, ddp_bucket_size=args.data_parallel.ddp_bucket_size,
                                      v_shape=args.parallel.pipeline_schedule == "zb-v")
            label = f"tp{tp} pp{pp} dp{dp} {flags} rank (pp {got['pp_rank']}, dp {got['dp_rank']})"
            assert got["params"] == want.params, label
            assert got["param_buffer"] == want.param_buffer, label
            assert got["grads"] == want.grads, label
            assert got["grad_padding"] == want.grad_padding, label
            assert got["optimizer"] == want.optimizer, label
            assert got["fp32_masters_in_place"] == (dtype == "fp32"), label
        if dp == 3:
            assert any(r["grad_padding"] for r in per_rank), "the dp=3 case should exercise bucket padding"
            if dist_opt:
                assert len({r["optimizer"] for r in per_rank}) > 1, "shards should differ in size"
        # The planner's per-GPU figures are those of the fullest rank.
        pred = P.predict(config, P.Layout(tp, pp, dp, args.parallel.vpp, args.training.micro_batch_size, "none", False, dist_opt,
                                          schedule=args.parallel.pipeline_schedule),
                         P.Cluster(gpus=tp * pp * dp), args.training.global_batch_size, args.model.seq_length, dtype=dtype,
                         ddp_bucket_size=args.data_parallel.ddp_bucket_size)
        peak = max(per_rank, key=lambda r: r["param_buffer"] + r["grads"] + r["optimizer"])
        assert pred.memory.parameters == max(r["param_buffer"] for r in per_rank)
        assert pred.memory.gradients == max(r["grads"] for r in per_rank)
        assert pred.memory.optimizer == max(r["optimizer"] for r in per_rank)
        assert (pred.memory.parameters + pred.memory.gradients + pred.memory.optimizer
                == peak["param_buffer"] + peak["grads"] + peak["optimizer"])


@pytest.mark.parametrize("tp,cp,dp", [(1, 2, 1), (1, 2, 2)], ids=["cp2", "cp2-dp2"])
def test_planner_state_bytes_of_a_cp_layout_equal_what_megalite_allocates(tp, cp, dp):
    """CP ranks hold the same parameters: the distributed optimizer shards over dp x cp."""
    argv = TINY + ["--tp", str(tp), "--cp", str(cp), "--attention-dropout", "0"]
    variants = [PLAIN, DIST]
    results = run_ranks(held_bytes, tp * cp * dp, args=(argv, variants), timeout=120)
    for v, flags in enumerate(variants):
        args = parse(argv + flags)
        config = arguments.model_config(args)
        layout = P.Layout(tp, 1, dp, None, args.training.micro_batch_size, "none", False, bool(flags), cp=cp)
        pred = P.predict(config, layout, P.Cluster(gpus=tp * cp * dp), args.training.global_batch_size, args.model.seq_length,
                         dtype="fp32", ddp_bucket_size=args.data_parallel.ddp_bucket_size)
        per_rank = [r[v] for r in results]
        for got in per_rank:
            want = P.rank_state_bytes(config, tp=tp, dp=layout.dp_cp, dp_rank=got["dp_cp_rank"], dtype="fp32",
                                      distributed_optimizer=bool(flags), seq_length=args.model.seq_length,
                                      ddp_bucket_size=args.data_parallel.ddp_bucket_size)
            assert (got["param_buffer"], got["grads"], got["optimizer"]) == \
                   (want.param_buffer, want.grads, want.optimizer), (flags, got)
        assert pred.memory.optimizer == max(r["optimizer"] for r in per_rank)
        assert pred.memory.parameters + pred.memory.gradients == max(r["param_buffer"] + r["grads"] for r in per_rank)
    whole = results[0][0]["optimizer"]
    assert max(r[1]["optimizer"] for r in results) < whole / (cp * dp) * 1.1  # sharded over dp x cp


def test_activations_per_rank_fall_as_one_over_cp():
    config, run = preset("gpt-1.3b"), P.Run(8, 16384)
    by_cp = {}
    for cp in (1, 2, 4, 8):
        layout = P.Layout(tp=2, micro_batch_size=1, recompute="selective", sequence_parallel=True, cp=cp)
        stored, _ = P.memory.stored_activations(config, layout, run, 1, 1.0)
        by_cp[cp] = stored
    from megalite.models.memory import context_parallel_attention_bytes as lse_bytes

    h, a = config.hidden_size, config.num_attention_heads
    for cp in (2, 4, 8):  # the layer's bytes at s/cp plus the ring's fp32 log-sum-exp
        assert by_cp[cp] == pytest.approx(by_cp[1] / cp + lse_bytes(16384, 1, h, a, 2, cp))
        assert by_cp[cp] < by_cp[1] / cp * 1.01


def test_ring_traffic_per_layer_in_the_step_time():
    from megalite.parallel.context_parallel import ring_bytes_per_layer

    config = preset("gpt-1.3b")
    for recompute, forwards in (("selective", 1), ("full", 2)):
        layout = P.Layout(tp=2, micro_batch_size=2, recompute=recompute, cp=4)
        costs = P.predict(config, layout, P.Cluster(gpus=8), 8, 32768).costs
        groups, d, local = config.num_attention_heads // 2, config.head_dim, 32768 // 4
        block = 2 * 2 * groups * local * d  # K and V of this TP rank's heads, s/cp tokens
        # 3 steps: K/V in bf16 in every forward and again in the backward, with dK/dV in fp32
        assert costs.ring_bytes == 3 * block * (2 * (forwards + 1) + 4)
        ring = ring_bytes_per_layer(2, groups, local, d, 4, 2, 4)
        assert costs.ring_bytes == ring["total"] + (forwards - 1) * ring["forward"]
        assert costs.bw_cp == P.Cluster(gpus=8).intra_node_gbps * 1e9  # tp x cp = 8 GPUs: one node


def test_exposed_ring_time_is_what_the_compute_does_not_hide():
    config = preset("gpt-1.3b")
    pred = P.predict(config, P.Layout(tp=1, micro_batch_size=1, recompute="selective", cp=8),
                     P.Cluster(gpus=16, gpus_per_node=4, inter_node_gbps=1), 8, 8192)
    stage, costs = pred.stages[0], pred.costs
    assert stage.ring_mb > stage.compute_mb  # a slow link across nodes
    # 7 ring steps a layer each way, each transfer behind one attention block: forward the K/V block,
    # backward the K/V block and then the dK/dV block, each behind one block's backward
    fwd, bwd = costs.ring_step_bytes
    block = costs.core / 64 / costs.rate
    lat = 5e-5
    per_layer = 7 * (max(0, lat + fwd / 1e9 - block) + max(0, lat + fwd / 1e9 - block)
                     + max(0, lat + (bwd - fwd) / 1e9 - block))
    assert pred.time.cp_comm == pytest.approx(pred.micro_batches * stage.n_layers * per_layer)
    assert stage.ring_mb == pytest.approx(stage.n_layers * (7 * 3 * lat + (fwd + bwd) * 7 / 1e9))
    parts = pred.time
    assert parts.total == pytest.approx(parts.compute + parts.imbalance + parts.tp_comm + parts.pp_comm
                                        + parts.bubble + parts.dp_comm + parts.optimizer + parts.cp_comm)
    fast = P.predict(config, P.Layout(tp=1, micro_batch_size=1, recompute="selective", cp=4),
                     P.Cluster(gpus=4), 4, 32768)
    assert fast.time.cp_comm == 0.0  # NVLink and long blocks: every ring step hides behind its block


def test_a_long_sequence_search_proposes_cp_where_it_is_what_makes_the_model_fit(capsys):
    config, cluster = preset("gpt-1.3b"), P.Cluster(gpus=8, gpu_memory_gib=40)
    kwargs = {"tp": 2, "pp": 1, "micro_batch_size": 1}
    assert P.plan(config, cluster, 8, 131072, cp=1, **kwargs).best is None
    result = P.plan(config, cluster, 8, 131072, **kwargs)
    assert result.best is not None and result.best.layout.cp > 1
    assert f"--cp {result.best.layout.cp}" in result.best.command()
    assert "cp " in result.best.layout.short()
    code, out, _ = run_cli(["--model", "gpt-1.3b", "--gpus", "8", "--gpu-memory-gib", "40", "--global-batch-size",
                            "8", "--seq-length", "131072", "--tp", "2", "--pp", "1", "--micro-batch-size", "1"], capsys)
    assert code == 0 and "--cp " in out
    # cp = 3 cannot cut 131072 tokens into 6 chunks; sequence parallelism needs s/cp divisible by tp
    odd = P.plan(config, P.Cluster(gpus=6, gpu_memory_gib=80), 6, 131072, tp=1, cp=3)
    assert odd.best is None and "seq % 2cp" in odd.rejected
    with pytest.raises(ValueError, match="each rank's 10 tokens divisible by tp 4"):
        P.predict(config, P.Layout(tp=4, sequence_parallel=True, cp=2), P.Cluster(gpus=8), 8, 20)


def test_in_flight_micro_batches_match_the_schedule_programs():
    for p, r, m, v in schedule_cases():
        live = peak = 0
        for op in build_program(p, r, m, v if v > 1 else None):
            live += {"F": 1, "B": -1}.get(op.kind, 0)
            peak = max(peak, live)
        assert P.in_flight_chunks(p, r, m, v if v > 1 else None) == peak, (p, v, m, r)


def hand_counted_layer(h, ffn, tp):
    """A pre-LN GPT layer's parameters on one TP rank, as the planner once listed them by hand: input
    norm (w, b), QKV (column-parallel w, b), projection (row-parallel w, replicated b), post-attention
    norm (w, b), fc1 (column-parallel w, b), fc2 (row-parallel w, replicated b)."""
    return [h, h, 3 * h * h // tp, 3 * h // tp, h * h // tp, h, h, h, ffn * h // tp, ffn // tp, h * ffn // tp, h]


SHAPES = [("gpt-tiny", {}), ("gpt2-124m", {}), ("gpt-1.3b", {}), ("gpt-tiny", {"ffn_hidden_size": 96})]


@pytest.mark.parametrize("name,changes", SHAPES, ids=[f"{n}{'-ffn' if c else ''}" for n, c in SHAPES])
def test_parameters_counted_on_a_meta_model_equal_the_hand_written_list(name, changes):
    config = preset(name, **changes)
    h, ffn, seq = config.hidden_size, config.ffn_hidden_size, 2 * config.max_position_embeddings
    for tp in (1, 2, 4):
        assert P.layer_numels(config, tp) == hand_counted_layer(h, ffn, tp), (name, tp)
        vocab = pad_vocab_size(config.vocab_size, tp, config.make_vocab_size_divisible_by) // tp * h
        layers = hand_counted_layer(h, ffn, tp) * (config.num_layers // 2)
        first, last = P.rank_parameters(config, tp, 2, None, 0, seq), P.rank_parameters(config, tp, 2, None, 1, seq)
        assert first == [[(vocab, True), (seq * h, False)] + [(n, False) for n in layers]], (name, tp)
        assert last == [[(vocab, True)] + [(n, False) for n in layers] + [(h, False), (h, False)]], (name, tp)
        alone = P.rank_parameters(config, tp, 1, None, 0, seq)[0]
        assert alone == [(vocab, False), (seq * h, False)] + [(n, False) for n in hand_counted_layer(h, ffn, tp)
                                                                * config.num_layers] + [(h, False), (h, False)]


@pytest.mark.parametrize("normalization", ["layernorm", "rmsnorm"])
def test_the_planner_counts_the_parameters_megalite_builds(normalization):
    import torch

    from megalite.models import GPTModel

    config = preset("gpt-tiny", normalization=normalization)
    built = sum(p.numel() for p in GPTModel(config, seed=1, device=torch.device("cpu")).parameters())
    counted = P.rank_state_bytes(config, seq_length=config.max_position_embeddings).numel
    assert counted == built  # RMSNorm has no bias: the hand-written list counted one anyway


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (4, 1)])
def test_the_planner_counts_a_llama_ranks_parameters_as_megalite_builds_them(tp, pp):
    """GQA (key/value rows, replicated groups at tp 4), SwiGLU, no biases, untied output layer:
    what one rank holds, per TP shard and pipeline stage, from the meta build."""
    import torch

    from megalite.models import GPTModel
    from megalite.parallel.layers import pad_vocab_size

    config = preset("llama-tiny")
    model = GPTModel(config, seed=1, device=torch.device("cpu"))
    padded = pad_vocab_size(config.vocab_size, tp, config.make_vocab_size_divisible_by)
    per_layer = config.num_layers // pp
    for r in range(pp):
        expected = 0
        for name, p in model.named_parameters():
            layer = int(name.split(".")[1]) if name.startswith("layers.") else None
            if layer is not None and not r * per_layer <= layer < (r + 1) * per_layer:
                continue
            if name == "word_embeddings.weight" and r != 0 or name in ("output_layer.weight", "final_layernorm.weight") \
                    and r != pp - 1:
                continue
            n = p.numel() if name not in ("word_embeddings.weight", "output_layer.weight") else \
                padded * config.hidden_size
            expected += n // tp if getattr(p, "tensor_model_parallel", False) else n
        counted = P.rank_state_bytes(config, tp=tp, pp=pp, pp_rank=r,
                                     seq_length=config.max_position_embeddings).numel
        assert counted == expected, (tp, pp, r)


def test_the_planner_plans_a_llama_preset():
    result = P.plan(preset("llama-3-8b"), P.Cluster(gpus=64, gpu_memory_gib=80), 512, 8192)
    assert result.best is not None and result.best.fits
    dense = preset("llama-3-8b", num_query_groups=None)
    # Grouped-query attention keeps fewer key/value activations than multi-head attention would.
    lay = P.Layout(8, 1, 8, None, 1, "none", True, False)
    assert P.predict(preset("llama-3-8b"), lay, P.Cluster(gpus=64), 512, 8192).memory.activations < \
        P.predict(dense, lay, P.Cluster(gpus=64), 512, 8192).memory.activations


def test_prediction_memory_and_time_are_the_sums_of_their_parts():
    pred = P.predict(preset("gpt2-124m"), P.Layout(2, 2, 2, None, 2, "selective", True, True), P.Cluster(gpus=8),
                     16, 1024)
    m, t = pred.memory, pred.time
    assert m.total == (m.parameters + m.gradients + m.optimizer + m.zero_transient + m.activations + m.output_layer
                       + m.overhead)
    assert m.states == m.parameters + m.gradients + m.optimizer and pred.peak_bytes >= m.total
    assert t.total == t.compute + t.imbalance + t.tp_comm + t.pp_comm + t.bubble + t.dp_comm + t.optimizer
    assert pred.stages[pred.peak_stage].total == m.total and pred.stages[pred.slow_stage].t_mb > 0


# GPT-3 175B as Narayanan et al. 2021 trained it (arXiv:2104.04473, Table 1): tp 8, pp 16, micro-batch 1,
# global batch 1536, sequence 2048, A100-80GB (312 TFLOP/s bf16, NVLink 300 GB/s per direction, 8 x
# 200 Gb/s HDR InfiniBand per node = 25 GB/s per GPU). Attention without fused kernels (2021).
A100 = dict(gpu_memory_gib=80, gpus_per_node=8, intra_node_gbps=300, inter_node_gbps=25, peak_tflops=312,
            hbm_gbps=2039)


@pytest.fixture(scope="module")
def gpt3_plan():
    cluster = P.Cluster(gpus=1024, **A100)
    return cluster, P.plan(preset("gpt-175b"), cluster, 1536, 2048, attention_backend="torch")


def test_published_gpt3_layout_is_feasible_and_near_best(gpt3_plan):
    cluster, result = gpt3_plan
    best = result.best.step_time
    published = [x for x in result if (x.layout.tp, x.layout.pp, x.layout.micro_batch_size) == (8, 16, 1)]
    assert published, "tp 8 pp 16 micro-batch 1 should fit"
    assert published[0].step_time <= 1.10 * best, (published[0].layout, published[0].step_time, best)
    # As published: full recomputation, no interleaving, plain optimizer; predicted to fit in 80 GB.
    fits, pred = P.check_layout(preset("gpt-175b"), tp=8, pp=16, dp=8, micro_batch_size=1, global_batch_size=1536,
                                seq_length=2048, recompute="full", attention_backend="torch",
                                gpu_memory_bytes=80 * P.GIB, cluster=cluster)
    assert fits and pred.peak_bytes < 0.5 * 80 * P.GIB, pred.memory
    # Without recomputation (and without sequence parallelism) 16 micro-batches of 6 layers do not fit.
    fits, pred = P.check_layout(preset("gpt-175b"), tp=8, pp=16, dp=8, vpp=2, micro_batch_size=1,
                                global_batch_size=1536, seq_length=2048, recompute="none", attention_backend="torch",
                                gpu_memory_bytes=80 * P.GIB, cluster=cluster)
    assert not fits and "activations" in pred.reason
    # Every feasible layout keeps tp within a node, and nothing without model parallelism fits.
    assert all(x.layout.tp <= 8 and x.layout.tp * x.layout.pp >= 16 for x in result)
    assert "tp > gpus per node" in result.rejected and "heads % tp" not in result.rejected


def test_small_model_on_small_memory_needs_small_micro_batches_or_recompute():
    config = preset("gpt2-350m")
    roomy = P.plan(config, P.Cluster(gpus=1, gpu_memory_gib=80), 8, 1024)
    assert len(roomy) == roomy.evaluated == 4 * 3  # micro-batch 1, 2, 4, 8 x recompute, all fit
    tight = P.plan(config, P.Cluster(gpus=1, gpu_memory_gib=10), 8, 1024)
    shapes = {(x.layout.micro_batch_size, x.layout.recompute) for x in tight}
    assert shapes and all(b <= 2 for b, _ in shapes) and (8, "none") not in shapes
    assert (2, "full") in shapes and (2, "none") not in shapes  # recomputation buys the larger micro-batch
    assert tight.rejected["does not fit"].count == tight.evaluated - len(tight)
    # Recomputation costs time: the fastest layout recomputes nothing.
    assert roomy.best.layout.recompute == "none"
    full = next(x for x in roomy if x.layout.recompute == "full" and x.layout.micro_batch_size == 1)
    assert full.time.compute > roomy.best.time.compute * 1.25


def test_the_printed_command_builds_the_planned_llama_model_and_tp_follows_its_groups():
    from megalite import arguments
    from megalite.tools.plan.report import _preset_of, model_flags

    config = preset("gpt-tiny", hidden_size=192, num_attention_heads=12, num_query_groups=4, gated_linear_unit=True,
                    activation="silu", position_embedding_type="rope", normalization="rmsnorm",
                    add_bias_linear=False, qk_layernorm=True, untie_embeddings_and_output_weights=True,
                    layernorm_epsilon=1e-6, rotary_base=500000.0, num_layers=3)
    flags = model_flags(config, _preset_of(config))
    built = arguments.model_config(arguments.build_parser("x", "gpt-tiny").parse_args(flags))
    assert built == config.replace(max_position_embeddings=built.max_position_embeddings), flags
    # 12 heads in 4 groups: tp 3 divides the heads but neither divides nor is divided by the groups.
    result = P.plan(config, P.Cluster(gpus=3, gpu_memory_gib=80), 6, 64)
    assert all(p.layout.tp != 3 for p in result.predictions)
    assert any("num_query_groups" in r.example for r in result.rejected.values()), result.rejected
