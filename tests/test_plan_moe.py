"""The planner with mixture-of-experts models: the MoE presets have the published parameter counts,
expert states equal what megalite allocates at EP / ETP layouts, the dispatcher's bytes equal what
megalite sends, each new memory and time term equals its hand-written formula on moe-tiny, and the
search chooses expert parallelism for Mixtral 8x7B."""
import math
import shlex

import pytest

from megalite import arguments
from megalite.metrics import layer_forward_flops
from megalite.models import preset
from megalite.testing import run_ranks
from megalite.tools import plan as P
from megalite.tools.plan.experts import activation_terms, dispatch_bytes, routed_rows
from megalite.tools.plan.memory import stored_activations
from megalite.tools.plan.report import model_flags
from megalite.tools.plan.step_time import layout_costs
from training_ranks import parse

TINY = preset("moe-tiny")  # 4 layers (the first dense), hidden 64, 8 experts top-2 of width 32, a shared expert
RUN = ["--seq-length", "32", "--global-batch-size", "8", "--micro-batch-size", "2", "--train-iters", "1",
       "--ddp-bucket-size", "20000"]


# -- presets -----------------------------------------------------------------------------------------------------

# (preset, published total, published active); Qwen3's heads are 128 wide (kv_channels), not hidden / heads
PUBLISHED = [("mixtral-8x7b", 46.7e9, 12.9e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9), ("olmoe-1b-7b", 6.9e9, 1.3e9)]


@pytest.mark.parametrize("name,total,active", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_moe_presets_have_the_published_total_and_active_parameters(name, total, active):
    config = preset(name)
    counted, running = P.total_parameters(config, 4096), P.active_parameters(config, 4096)
    assert abs(counted - total) / total < 0.02, (name, counted)
    assert abs(running - active) / active < 0.02, (name, running)


def test_the_planner_counts_the_parameters_megalite_builds_for_moe_tiny():
    import torch

    from megalite.models import GPTModel

    model = GPTModel(TINY, seed=1, device=torch.device("cpu"))
    built = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for p in model.parameters() if getattr(p, "expert_parallel", False))
    assert P.total_parameters(TINY, 128) == built
    assert experts == 3 * 8 * 3 * 64 * 32  # 3 MoE layers x 8 experts x (gate, up, down) 64 x 32
    assert P.active_parameters(TINY, 128) == built - experts * 6 // 8  # top-2 of 8: 6 idle
    for ep, etp, tp in ((2, 1, 1), (4, 2, 2), (8, 1, 2)):
        held = P.rank_parameters(TINY, tp, 1, None, 0, 128, ep=ep, etp=etp, experts=True)[0]
        assert sum(n for n, _ in held) == experts // (ep * etp), (ep, etp)


# -- expert states: what megalite allocates ----------------------------------------------------------------------

def held_with_experts(rank, world, argv, variants):
    """Build the model and optimizer as training does for each variant, step once, and report what
    this rank holds, in all and in its expert buffers."""
    import torch

    import pretrain_gpt
    from megalite import parallel, training

    training.setup(parse(argv), world)
    out = []
    for extra in variants:
        args = parse(argv + extra)
        chunks = training.build_model_chunks(pretrain_gpt.task(), arguments.model_config(args), args,
                                             torch.device("cpu"))
        buffers, optimizer = training.build_optimizer(args, chunks)
        optimizer.step(1e-3, 1.0)
        stored = [(b.experts, b.stored_bytes()) for b in buffers]  # whole or sharded, as each stage keeps them
        out.append({
            "pp_rank": parallel.get_pipeline_model_parallel_rank(),
            "dp_rank": parallel.get_data_parallel_rank(with_context_parallel=True),
            "edp_rank": parallel.get_expert_data_parallel_rank(),
            "param_buffer": sum(x["params"] for _, x in stored), "grads": sum(x["grads"] for _, x in stored),
            "optimizer": optimizer.state_bytes(),
            "expert_param_buffer": sum(x["params"] for experts, x in stored if experts),
            "expert_grads": sum(x["grads"] for experts, x in stored if experts),
        })
    return out


DIST, ZERO2, ZERO3 = ["--use-distributed-optimizer"], ["--zero-stage", "2"], ["--zero-stage", "3"]
STATE_CASES = [  # (layout flags, tp, pp, dp, ep, etp, vpp, variants)
    (["--ep", "2"], 1, 1, 4, 2, 1, None, [[], DIST, ZERO2, ZERO3, ["--bf16", *DIST]]),  # EDP 2: experts over 2
    (["--tp", "2", "--sequence-parallel", "--ep", "2", "--etp", "1"], 2, 1, 2, 2, 1, None, [[], DIST]),
    (["--pp", "2", "--vpp", "2", "--ep", "2"], 1, 2, 2, 2, 1, 2, [DIST]),  # rank 0's first chunk: the dense layer alone
]


@pytest.mark.parametrize("flags,tp,pp,dp,ep,etp,vpp,variants", STATE_CASES, ids=["ep2-dp4", "tp2-sp-etp1-ep2",
                                                                                  "pp2-vpp2-ep2"])
def test_predicted_expert_states_equal_what_megalite_allocates(flags, tp, pp, dp, ep, etp, vpp, variants):
    argv = model_flags(TINY, "moe-tiny") + RUN + flags
    results = run_ranks(held_with_experts, tp * pp * dp, args=(argv, variants), timeout=300)
    for v, extra in enumerate(variants):
        args = parse(argv + extra)
        dtype = "bf16" if args.precision.bf16 else "fp32"
        for got in (r[v] for r in results):
            want = P.rank_state_bytes(TINY, tp=tp, pp=pp, dp=dp, vpp=vpp, pp_rank=got["pp_rank"], dp_rank=got["dp_rank"],
                                      dtype=dtype, zero_stage=args.data_parallel.zero_stage, seq_length=32,
                                      ddp_bucket_size=20000, ep=ep, etp=etp, edp_rank=got["edp_rank"])
            label = f"{flags} {extra} rank {got}"
            assert (got["param_buffer"], got["grads"], got["optimizer"]) == \
                   (want.param_buffer, want.grads, want.optimizer), label
            assert (got["expert_param_buffer"], got["expert_grads"]) == \
                   (want.experts.param_buffer, want.experts.grads), label


def test_expert_gradient_traffic_equals_a_real_step_at_each_zero_stage():
    """Stages 0-2 at EP 2 on 4 ranks (dense gradients over dp 4, expert gradients over edp 2): the
    bytes each rank's buffers send in one training step; stage 2's transient peak an upper bound."""
    from test_plan_zero import held_at_each_zero_stage

    argv = model_flags(TINY, "moe-tiny") + RUN + ["--global-batch-size", "16", "--eval-iters", "0",
                                                  "--log-interval", "1", "--ep", "2"]
    variants = [["--zero-stage", str(stage)] for stage in (0, 1, 2, 3)]
    results = run_ranks(held_at_each_zero_stage, 4, args=(argv, variants), timeout=300)
    for v, stage in enumerate((0, 1, 2, 3)):
        pred = P.predict(TINY, P.Layout(1, 1, 4, None, 2, "none", False, zero_stage=stage, ep=2), P.Cluster(gpus=4),
                         16, 32, dtype="fp32", ddp_bucket_size=20000)
        for r in results:
            assert {k: float(x) for k, x in r[v]["sent"].items()} == pred.dp_parts[0].traffic, (stage, r[v])
            assert r[v]["peak_transient"] <= pred.memory.zero_transient, stage


# -- the dispatcher's bytes --------------------------------------------------------------------------------------

def dispatched_bytes(rank, world, layouts, tokens):
    """Bytes of kind "ep" this rank sends through the all-to-all dispatcher, forward and backward,
    when every token sends one of its two rows to each EP rank (balanced routing)."""
    import torch

    from megalite import parallel
    from megalite.models.moe.dispatcher import make_dispatcher
    from megalite.models.moe.experts import GroupedMLP
    from megalite.parallel import traffic

    config = TINY.replace(moe_layer_freq=1)
    out = {}
    for ep, etp in layouts:
        parallel.initialize_model_parallel(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        try:
            experts = GroupedMLP(config)
            local = config.num_moe_experts // ep
            x = torch.randn(tokens, config.hidden_size, requires_grad=True)
            indices = torch.stack([torch.tensor([i % local, local + i % local]) for i in range(tokens)])
            weights = torch.full((tokens, 2), 0.5)
            traffic.take()
            make_dispatcher("alltoall", config.num_moe_experts)(x, weights, indices, experts).sum().backward()
            out[ep, etp] = traffic.take().get("ep", 0)
        finally:
            parallel.destroy_model_parallel()
    return out


def test_dispatch_bytes_equal_what_the_all_to_all_dispatcher_sends():
    tokens = 12
    sent = run_ranks(dispatched_bytes, 4, args=(((2, 1), (2, 2)), tokens), timeout=120)
    run = P.Run(8, tokens, "fp32")  # one sequence of `tokens` per micro-batch: T = tokens per rank
    for ep, etp in ((2, 1), (2, 2)):
        layout = P.Layout(1, 1, 4, ep=ep, etp=etp)
        want = dispatch_bytes(TINY, layout, run)
        assert all(s[ep, etp] == want["ep"] + want["etp"] for s in sent), (ep, etp, sent, want)
    # by hand: R = 2 x 12 rows of 64 fp32; 4 all-to-alls of (ep-1)/ep of them; 4 ETP exchanges of (etp-1) R
    assert dispatch_bytes(TINY, P.Layout(1, 1, 4, ep=2, etp=2), run) == {"ep": 4 * 24 * 64 * 4 / 2,
                                                                       "etp": 4 * 24 * 64 * 4}


# -- each new term against its formula on moe-tiny ---------------------------------------------------------------

def test_expert_states_are_sharded_over_ep_etp_and_their_optimizer_over_edp():
    # tp 2 x dp 4 = 8 ranks of a stage: ep 2 x etp 2 leaves edp 2
    st = P.rank_state_bytes(TINY, tp=2, dp=4, dtype="bf16", distributed_optimizer=True, seq_length=32, ep=2, etp=2)
    experts = 3 * (8 // 2) * 3 * 64 * 32 // 2  # MoE layers x local experts x 3 h f / etp
    assert st.edp == 2 and st.experts.numel == experts == st.experts.padded_numel  # 64-multiples: no padding
    assert st.experts.param_buffer == 2 * experts and st.experts.grads == 4 * experts  # bf16, fp32 gradients
    assert st.experts.optimizer == 12 * experts // 2  # fp32 master + Adam moments of the edp rank's half
    dense = P.rank_parameters(TINY, 2, 1, None, 0, 32, ep=2, etp=2, experts=False)[0]
    assert st.numel == experts + sum(n for n, _ in dense)
    assert st.optimizer == st.experts.optimizer + 12 * st.owned_numel - 12 * st.experts.owned_numel
    pred = P.predict(TINY, P.Layout(2, 1, 4, None, 1, "none", True, True, ep=2, etp=2), P.Cluster(gpus=8), 8, 32)
    assert pred.memory.experts == st.experts.param_buffer + st.experts.grads + st.experts.optimizer


def test_moe_layer_activations_follow_their_terms():
    s, b = 32, 2
    run, layout = P.Run(8, s), P.Layout(1, 1, 2, None, b, "none", False, ep=2)
    T, R, h = s * b, 2 * s * b, 64  # tokens a rank routes, rows (top-2), hidden; bf16
    assert activation_terms(TINY, layout, run) == {
        "router": T * 8 * 8 + T * 2 * 12, "dispatched_in": R * h * 2, "expert_ffn": R * 32 * 4 * 2,
        "combined_out": R * h * 2, "shared": T * 32 * 4 * 2, "dense_mlp": T * 128 * 4 * 2}
    extra = T * 8 * 8 + T * 2 * 12 + R * h * 2 + R * 32 * 8 + R * h * 2 + T * 32 * 8 - T * 128 * 8
    dense, _ = stored_activations(TINY, layout, run, 4, 1.0)
    moe, _ = stored_activations(TINY, layout, run, 4, 1.0, moe_layers=3)
    assert moe - dense == 3 * extra
    full = P.Layout(1, 1, 2, None, b, "full", False, ep=2)  # full recomputation keeps only the layer inputs
    assert stored_activations(TINY, full, run, 4, 1.0, 3)[0] == stored_activations(TINY, full, run, 4, 1.0)[0]
    # ETP: the experts' input gathered over etp ranks, their ffn tensors etp / etp as wide; TP 2 routes half the tokens
    tp2 = P.Layout(2, 1, 1, None, b, "none", True, ep=1, etp=2)
    terms = activation_terms(TINY, tp2, run)
    assert terms["dispatched_in"] == 2 * (R // 2) * h * 2 and terms["expert_ffn"] == 2 * (R // 2) * 16 * 4 * 2
    # a capacity factor caps the rows (padded: exactly E x capacity)
    for factor, pad, rows in ((1.5, True, 8 * math.ceil(1.5 * R / 8)), (1.5, False, R), (0.5, False, 8 * 8)):
        config = TINY.replace(moe_expert_capacity_factor=factor, moe_pad_expert_input_to_capacity=pad)
        assert routed_rows(config, layout, run) == rows, (factor, pad)


def test_all_to_all_time_is_exposed_and_crosses_nodes_only_when_the_ep_group_does():
    run = P.Run(16, 32)
    layout = P.Layout(2, 1, 8, None, 1, "none", True, False, ep=8, etp=1)  # EP 8: ranks 0-7 of each 16
    sent = 4 * (2 * 16) * 64 * 2 * 7 / 8  # 4 all-to-alls of 7/8 of R = 2 x 16 rows (tp 2 routes 16 tokens)
    assert dispatch_bytes(TINY, layout, run) == {"ep": sent, "etp": 0.0}
    inside = layout_costs(TINY, layout, P.Cluster(gpus=16, gpus_per_node=8), run, 1)
    across = layout_costs(TINY, layout, P.Cluster(gpus=16, gpus_per_node=4), run, 1)
    # 5 exchanges a MoE layer and micro-batch: 4 all-to-alls and the counts' all-gather, 0.05 ms each
    assert inside.ep_exchanges == 5
    assert inside.ep_time == pytest.approx(5 * 5e-5 + sent / 450e9)
    assert across.ep_time == pytest.approx(5 * 5e-5 + sent / 50e9)
    pred = P.predict(TINY, layout, P.Cluster(gpus=16, gpus_per_node=4), run=run)
    m = pred.micro_batches
    assert pred.time.ep_comm == pytest.approx(m * 3 * across.ep_time)  # 3 MoE layers, nothing hidden
    t = pred.time
    assert t.total == pytest.approx(t.compute + t.imbalance + t.tp_comm + t.pp_comm + t.bubble + t.dp_comm
                                    + t.optimizer + t.cp_comm + t.ep_comm)
    full = layout_costs(TINY, P.Layout(2, 1, 8, None, 1, "full", True, False, ep=8, etp=1),
                        P.Cluster(gpus=16), run, 1)
    assert full.ep_bytes == sent * 6 / 4  # the recomputed forward dispatches again


def test_moe_layer_flops_count_the_active_experts():
    s, b, h = 32, 2, 64
    costs = layout_costs(TINY, P.Layout(1, 1, 2, None, b, "none", False, ep=2), P.Cluster(gpus=2), P.Run(8, s), 2)
    attention = h * 64 + h * 64 + 64 * h  # q, k and v (2 groups of 16), output
    moe = h * 8 + 2 * h * 32 * 3 + h * 32 * 3  # router, top-2 gated experts, gated shared expert
    core = 4 * b * s * s * 64
    assert costs.moe_fwd == 2 * s * b * (attention + moe) + core
    assert costs.fwd == 2 * s * b * (attention + h * 128 * 3) + core
    assert costs.hardware_flops == 2 * 2 * (3 * (costs.fwd + costs.moe_fwd * 3) + 3 * costs.logits_fwd)
    assert costs.moe_fwd + 0.0 == sum(layer_forward_flops(TINY, s, b, moe=True))


def test_expert_gradients_reduce_over_the_expert_data_parallel_group():
    # tp 1 x dp 4, ep 2: dense gradients over 4 ranks, expert gradients over edp = 2
    pred = P.predict(TINY, P.Layout(1, 1, 4, None, 1, "none", False, True, ep=2), P.Cluster(gpus=4), 8, 32)
    st = pred.stages[0].state
    dense, experts = st.padded_numel - st.experts.padded_numel, st.experts.padded_numel
    traffic = pred.dp_parts[0].traffic
    assert traffic["reduce_scatter"] == pytest.approx(3 / 4 * dense * 4 + 1 / 2 * experts * 4)
    assert traffic["all_gather"] == pytest.approx(3 / 4 * dense * 2 + 1 / 2 * experts * 2)
    buckets = sum(len(c) for c in st.buckets) + sum(len(c) for c in st.expert_buckets)  # each gather: 0.05 ms
    assert pred.dp_parts[0].all_gather == pytest.approx((3 / 4 * dense * 2 + 1 / 2 * experts * 2) / 450e9
                                                        + buckets * 5e-5)


# -- search, refusals, command line ------------------------------------------------------------------------------

def test_search_chooses_expert_parallelism_for_mixtral_on_64_gpus():
    """Mixtral 8x7B, 64 80-GB GPUs, 256 x 4096 tokens: EP 8 inside a node shards the experts (the
    bulk of the weights) 8 ways, so the step needs no deep pipeline; the all-to-all stays on NVLink."""
    config = preset("mixtral-8x7b")
    result = P.plan(config, P.Cluster(gpus=64), 256, 4096, recompute="none", micro_batch_size=1)
    best = result.best
    assert best.layout.ep == 8 and best.layout.etp == 1, best.layout.short()
    assert best.costs.bw_ep == 450e9 and best.time.ep_comm > 0
    without = P.plan(config, P.Cluster(gpus=64), 256, 4096, recompute="none", micro_batch_size=1, ep=1).best
    assert best.step_time < without.step_time and best.layout.pp < without.layout.pp
    assert best.memory.experts < without.memory.experts  # with 4x the pipeline stages, ep 1 still holds more


def test_megalites_expert_rules_are_the_planners():
    result = P.plan(TINY, P.Cluster(gpus=4), 8, 32)
    layouts = [x.layout for x in result]
    assert any(x.ep > 1 for x in layouts) and any(x.ep > 1 and x.zero_stage == 3 for x in layouts)
    assert all(x.sequence_parallel for x in layouts if x.tp > 1)
    assert "moe: tp needs sp" in result.rejected
    for layout, reason in ((P.Layout(1, 1, 6, ep=3), r"experts \(8\) is not divisible by ep 3"),
                           (P.Layout(2, 1, 3, ep=2, etp=1), "at tp 2 need sequence parallelism")):
        with pytest.raises(ValueError, match=reason):
            P.predict(TINY, layout, P.Cluster(gpus=6), 6, 32)
    local_sgd = P.Run(6, 32, local_sgd_interval=4)
    with pytest.raises(ValueError, match=r"local SGD keeps expert parallelism inside a replica: etp 1 x ep 2"):
        P.predict(TINY, P.Layout(1, 1, 6, ep=2), P.Cluster(gpus=6), run=local_sgd)
    with pytest.raises(ValueError, match=r"etp 2 x ep 4 must divide tp x cp x dp = 4"):
        P.Layout(2, 1, 2, ep=4, etp=2)
    with pytest.raises(ValueError, match="mixture-of-experts models only"):
        P.plan(preset("gpt-tiny"), P.Cluster(gpus=2), 8, 32, ep=2)


def test_a_dense_models_layout_json_and_table_are_unchanged():
    pred = P.predict(preset("gpt-tiny"), P.Layout(1, 1, 2), P.Cluster(gpus=2), 8, 32)
    data = pred.to_dict()
    assert "ep" not in data["layout"] and "ep_comm" not in data["time_s"] and "experts" not in data["memory_gib"]
    assert " ep " not in P.format_table([pred]).splitlines()[0] and "--ep" not in pred.command()


def test_cli_plans_a_moe_preset_and_its_command_builds_that_model(capsys):
    code = P.main(["--model", "moe-tiny", "--gpus", "4", "--global-batch-size", "8", "--seq-length", "32",
                   "--ep", "2", "--explain", "--top", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "active (8 experts, top-2, in 3 layers)" in out and "exprt" in out and "a2a" in out
    assert "ep comm" in out and "MoE layers: in place of the MLP" in out and "experts      of the above" in out
    table = [ln.split() for ln in out.splitlines() if ln[:3].strip().isdigit() and "|" in ln]
    assert len(table) == 2 and all(row[4] == "2" for row in table)  # the ep column
    cmd = next(ln.strip() for ln in out.splitlines() if ln.strip().startswith("torchrun"))
    words = shlex.split(cmd)
    args = parse(words[words.index("pretrain_gpt.py") + 1:])
    built = arguments.model_config(args)
    assert args.parallel.expert_model_parallel_size == 2
    assert built.replace(sequence_parallel=False) == TINY.replace(max_position_embeddings=built.max_position_embeddings)


def test_local_sgd_plans_keep_the_experts_inside_a_replica():
    """Under local SGD etp x ep must divide tp x cp (megalite's rule): the search skips the other
    pairs with a reason, and an expert's copies inside a replica add their every-step all-reduce."""
    result = P.plan(TINY, P.Cluster(gpus=4), 8, 32, local_sgd={"local_sgd_interval": 4})
    assert len(result) > 0 and "local sgd: experts cross replicas" in result.rejected
    assert all((x.layout.tp * x.layout.cp) % (x.layout.ep * x.layout.etp) == 0 for x in result)
    inside = [x for x in result if x.layout.tp == 2 and x.layout.ep * x.layout.etp == 1]
    assert inside and all(x.dp_parts[0].traffic.get("all_reduce", 0) > 0 for x in inside)
