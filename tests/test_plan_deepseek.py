"""The planner and the FLOPs count with DeepSeek-V3's parts: multi-head latent attention's exact
parameters and activations, the multi-token prediction modules on the last stage (parameters,
FLOPs, activations), the published totals of the deepseek-v3 preset, and a plan of it on 2048 GPUs
printed next to the DeepSeek-V3 report's own layout (--compare)."""
import shlex

import pytest

from megalite import arguments
from megalite.metrics import model_flops_per_iteration, mtp_forward_flops
from megalite.models import preset
from megalite.models.memory import layer_activation_bytes, mla_activation_bytes_per_layer
from megalite.testing import run_ranks
from megalite.tools import plan as P
from megalite.tools.plan.cli import parse_layout
from megalite.tools.plan.memory import mtp_bytes, output_layer_bytes, stored_activations
from megalite.tools.plan.report import model_flags
from test_plan_moe import DIST, ZERO3, held_with_experts
from training_ranks import parse

TINY = preset("deepseek-tiny")  # 3 layers (the first dense), hidden 64, 4 heads, MLA, 16 experts top-4, 1 MTP module
REPORT_LAYOUT = "tp=1,pp=16,ep=64,zero=1,layers=4*15+1"  # DeepSeek-V3 (arXiv 2412.19437) section 3.2; the last
# stage with one layer besides the MTP module and two passes through the output layer


# -- FLOPs ---------------------------------------------------------------------------------------------------------

def test_model_flops_count_each_mtp_depth_as_a_layer_eh_proj_and_one_more_head():
    B, s = 8, 32
    gpt = preset("gpt-tiny")  # h 128, ffn 512, 4 layers, vocab 1024, multi-head attention
    h, f, V = 128, 512, 1024
    layer = 2 * s * B * (4 * h * h + 2 * h * f) + 4 * B * s * s * h
    assert model_flops_per_iteration(gpt, B, s) == 3 * (4 * layer + 2 * s * B * h * V)
    for depth in (1, 2):
        mtp = depth * (layer + 2 * s * B * (2 * h * h + h * V))
        assert model_flops_per_iteration(gpt.replace(mtp_num_layers=depth), B, s) == \
            3 * (4 * layer + 2 * s * B * h * V + mtp)
    # deepseek-tiny: MLA (q 64 -> 4 x (16 + 8), kv_down 64 -> 32 + 8, kv_up 32 -> 4 x (16 + 16), proj 4 x 16 -> 64)
    # and a MoE MTP layer (router 16, top-4 gated experts of 32, a gated shared expert of 32)
    h = 64
    attention = h * 96 + h * 40 + 32 * 128 + 64 * h
    moe = h * 16 + 4 * h * 32 * 3 + h * 32 * 3
    core = 2 * B * s * s * 4 * (16 + 8 + 16)
    mtp = 2 * s * B * (attention + moe + 2 * h * h + h * 1024) + core
    assert model_flops_per_iteration(TINY, B, s) - model_flops_per_iteration(TINY.replace(mtp_num_layers=0), B, s) \
        == 3 * mtp


# -- parameters ----------------------------------------------------------------------------------------------------

def test_mla_layers_are_counted_with_their_real_projections():
    """deepseek-v3's dense layer: q_down, q_norm, q_up, kv_down, kv_norm, kv_up, proj, two norms and the
    gated MLP, nothing of 4h^2 (h / heads = 56 is no head width of MLA's)."""
    c = preset("deepseek-v3")
    h, a, r, kv = 7168, 128, 1536, 512
    attention = h * r + r + r * a * (128 + 64) + h * (kv + 64) + kv + kv * a * (128 + 128) + a * 128 * h
    assert sum(P.layer_numels(c, 1)) == attention + 2 * h + 3 * h * 18432
    assert sum(P.layer_numels(c, 8)) == (h * r + r + h * (kv + 64) + kv + 2 * h
                                         + (r * a * 192 + kv * a * 256 + a * 128 * h + 3 * h * 18432) // 8)


@pytest.mark.parametrize("q_lora_rank", [None, 16], ids=["plain-q", "q-lora"])
def test_the_planner_counts_the_parameters_megalite_builds_for_deepseek_tiny(q_lora_rank):
    """The whole model (experts whole, the MTP module included) and each stage at pp 2 (the last with
    the MTP module and its copy of the untied word embedding) as GPTModel builds them at tp 1."""
    import torch

    from megalite.models import GPTModel

    config = TINY.replace(q_lora_rank=q_lora_rank)
    cpu = torch.device("cpu")

    def count(model):
        return sum(p.numel() for p in model.parameters())

    whole = GPTModel(config, seed=1, device=cpu)
    assert P.total_parameters(config, 128) == count(whole)
    assert P.total_parameters(config, 128, mtp=False) == count(GPTModel(config.replace(mtp_num_layers=0), seed=1,
                                                                         device=cpu))
    experts = [p.numel() for p in whole.parameters() if getattr(p, "expert_parallel", False)]
    idle = sum(experts) // 16 * 12 // 3  # per MoE layer (2 main, 1 MTP): 12 of 16 experts idle
    assert P.active_parameters(config, 128) == count(whole) - 3 * idle
    assert P.active_parameters(config, 128, mtp=False) == P.total_parameters(config, 128, mtp=False) - 2 * idle
    for split in ([2, 1], [1, 2]):
        stages = [GPTModel(config, True, False, layer_numbers=range(split[0]), seed=1, device=cpu),
                  GPTModel(config, False, True, layer_numbers=range(split[0], 3), seed=1, device=cpu)]
        assert hasattr(stages[1], "word_embeddings") and hasattr(stages[1], "mtp")
        for r, stage in enumerate(stages):
            counted = P.rank_parameters(config, 1, 2, None, r, 128, split)[0]
            assert sum(n for n, _ in counted) == count(stage), (split, r)


PUBLISHED = [  # DeepSeek-V3 technical report (arXiv 2412.19437): 671B total, 37B activated; 685B on Hugging Face
    ("total without MTP", lambda c: P.total_parameters(c, 4096, mtp=False), 671e9),
    ("active without MTP", lambda c: P.active_parameters(c, 4096, mtp=False), 37e9),
    ("total with MTP", lambda c: P.total_parameters(c, 4096), 685e9),
]


@pytest.mark.parametrize("what,count,published", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_deepseek_v3_has_the_published_parameter_counts(what, count, published):
    counted = count(preset("deepseek-v3"))
    assert abs(counted - published) / published < 0.02, (what, counted)


def test_predicted_states_with_mtp_equal_what_megalite_allocates_at_pp_2():
    """The last stage's MTP module and word-embedding copy (its gradient deferred with the first
    stage's) in the buffers megalite builds: distributed optimizer and ZeRO-3 (the MTP module among
    the stage's non-layer units)."""
    flags = model_flags(TINY, "deepseek-tiny")
    argv = flags + ["--seq-length", "32", "--global-batch-size", "4", "--micro-batch-size", "2", "--train-iters", "1",
                    "--ddp-bucket-size", "20000", "--pp", "2", "--pipeline-layers", "2,1"]
    variants = [DIST, ZERO3]
    results = run_ranks(held_with_experts, 2, args=(argv, variants), timeout=300)
    for v, extra in enumerate(variants):
        args = parse(argv + extra)
        for got in (r[v] for r in results):
            want = P.rank_state_bytes(TINY, pp=2, pp_rank=got["pp_rank"], dtype="fp32",
                                      zero_stage=args.data_parallel.zero_stage, seq_length=32, ddp_bucket_size=20000,
                                      pipeline_layers=[2, 1])
            assert (got["param_buffer"], got["grads"], got["optimizer"]) == \
                   (want.param_buffer, want.grads, want.optimizer), (extra, got)


# -- activations and step time -------------------------------------------------------------------------------------

def test_the_planner_keeps_mla_activations_by_the_mla_formula():
    config = preset("deepseek-v3")
    s, b = 4096, 1
    for t, sp in ((1, False), (8, True)):
        got = layer_activation_bytes(config, s, b, t, "selective", sp)
        assert got == mla_activation_bytes_per_layer(s, b, 7168, 128, t, sp, "selective", q_lora_rank=1536,
                                                     kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
                                                     v_head_dim=128, ffn=18432, gated=True)
    # per token at tp 8 with SP: gathered input 2h, latents 4*512 + 4*1536 + 16, the MLP's gathered input 2h whole;
    # norms and dropout masks 6h, heads 2*128*(2*192 + 256 + 128), gated MLP 8*18432 over 8; cos/sin 8*64
    per_token = 2 * 7168 + 4 * 512 + 4 * 1536 + 16 + 2 * 7168 + (6 * 7168 + 2 * 128 * 768 + 8 * 18432) / 8 + 8 * 64
    assert layer_activation_bytes(config, s, b, 8, "selective", True) == s * b * per_token
    run, layout = P.Run(16, s), P.Layout(8, 1, 2, None, b, "none", True, ep=16, etp=1)
    mla = stored_activations(config, layout, run, 1, 1.0)[0]
    assert mla == s * b * per_token  # sdpa keeps no s^2 core: the selective count
    assert mla > layer_activation_bytes(config.replace(multi_latent_attention=False), s, b, 8, "selective", True)


def test_the_last_stage_keeps_and_runs_the_mtp_modules():
    """deepseek-tiny at pp 2: the last stage adds, per micro-batch, a MoE layer's activations, the
    inputs of the module's norms, eh_proj and output layer, and the fp32 softmax of one more
    cross-entropy; its FLOPs add a layer, eh_proj and a head; the first stage is as without MTP."""
    s, b, h, V = 32, 2, 64, 1024
    run = P.Run(8, s, "bf16", pipeline_layers=(2, 1))
    layout = P.Layout(1, 2, 2, None, b, "none", False, ep=2)
    with_mtp = P.predict(TINY, layout, P.Cluster(gpus=4), run=run)
    without = P.predict(TINY.replace(mtp_num_layers=0), layout, P.Cluster(gpus=4), run=run)
    moe_layer = stored_activations(TINY, layout, run, 1, 1.0, 1.0)[0]
    expected = moe_layer + 3 * s * b * h * 2 + s * b * 3 * h * 2 + s * b * V * 4
    assert mtp_bytes(TINY, layout, run, V) == expected
    last, first = with_mtp.stages[1], with_mtp.stages[0]
    assert last.mtp == expected and last.output == output_layer_bytes(TINY, layout, run, V) + expected
    assert without.stages[1].mtp == 0 and without.stages[1].output == output_layer_bytes(TINY, layout, run, V)
    assert first.activations == without.stages[0].activations and first.flops_mb == without.stages[0].flops_mb
    costs = with_mtp.costs
    assert costs.mtp_fwd == sum(mtp_forward_flops(TINY, s, b, V))
    assert last.flops_mb - without.stages[1].flops_mb == pytest.approx(costs.mtp_fwd + costs.mtp_bwd)
    assert costs.mtp_bwd == 2 * costs.mtp_fwd
    assert with_mtp.hardware_flops - without.hardware_flops == pytest.approx(
        with_mtp.micro_batches * 2 * 3 * costs.mtp_fwd)
    assert with_mtp.model_flops == model_flops_per_iteration(TINY, 8, s)
    assert with_mtp.memory.mtp == expected and "mtp" in with_mtp.to_dict()["memory_gib"]
    assert "mtp" not in P.predict(preset("gpt-tiny"), P.Layout(1, 1, 2), P.Cluster(gpus=2), 8, 32).to_dict()["memory_gib"]


# -- the command line ----------------------------------------------------------------------------------------------

def test_compare_layouts_parse_and_refuse_with_the_key():
    assert parse_layout(REPORT_LAYOUT) == {"tp": 1, "pp": 16, "ep": 64, "zero": 1, "layers": [4] * 15 + [1]}
    assert parse_layout("layers=3+4*14+2,sp=off")["layers"] == [3] + [4] * 14 + [2]
    assert parse_layout("tp=8,sp=on,recompute=full,mb=2") == {"tp": 8, "sp": True, "recompute": "full", "mb": 2}
    for bad, match in (("tp=x", "'tp=x': give an integer"), ("depth=3", "key among tp, pp"),
                       ("recompute=most", "one of none, selective, full"), ("layers=3+a", "layer counts")):
        with pytest.raises(ValueError, match=match):
            parse_layout(bad)


def test_cli_plans_deepseek_tiny_with_q_lora_and_its_command_builds_that_model(capsys):
    code = P.main(["--model", "deepseek-tiny", "--q-lora-rank", "16", "--gpus", "2", "--global-batch-size", "8",
                   "--seq-length", "32", "--explain", "--top", "1"])
    out = capsys.readouterr().out
    assert code == 0
    config = TINY.replace(q_lora_rank=16)
    assert f"{P.total_parameters(config, 128) / 1e9:.2f}B parameters" in out and "without the 1 MTP module" in out
    assert "MLA's terms" in out and "1 MTP module" in out
    cmd = next(ln.strip() for ln in out.splitlines() if ln.strip().startswith("torchrun"))
    words = shlex.split(cmd)
    built = arguments.model_config(parse(words[words.index("pretrain_gpt.py") + 1:]))
    assert built.replace(sequence_parallel=False) == config.replace(max_position_embeddings=built.max_position_embeddings)


def test_cli_plans_deepseek_v3_on_2048_gpus_next_to_the_reports_layout(capsys):
    """The planner's layout fits 80 GB; DeepSeek-V3's own (PP 16, EP 64, ZeRO-1, TP 1; DP 128) is
    predicted and printed beside it, and fits (the planner picks its recomputation: docs/planner.md)."""
    code = P.main(["--model", "deepseek-v3", "--gpus", "2048", "--gpu-memory-gib", "80", "--global-batch-size", "15360",
                   "--seq-length", "4096", "--tp", "8", "--micro-batch-size", "1", "--compare", REPORT_LAYOUT])
    out = capsys.readouterr().out
    assert code == 0
    best = next(ln for ln in out.splitlines() if ln.startswith("plan's best: "))
    compared = next(ln for ln in out.splitlines() if ln.startswith(f"compared {REPORT_LAYOUT}: "))
    assert "does not fit" not in compared and "nothing fits" not in compared
    assert "tp 1 pp 16 dp 128 ep 64 etp 1 mb 1" in compared and "dist-opt" in compared
    for line in (best, compared):
        gib = float(line.split(" GiB per GPU")[0].rsplit(" ", 1)[1])
        assert gib <= 80 and " step " in line and " bubble " in line, line
    cmd = out.split(compared)[1].strip().splitlines()[0]
    words = shlex.split(cmd)
    args = parse(words[words.index("pretrain_gpt.py") + 1:])
    assert args.parallel.pipeline_layers == [4] * 15 + [1] and args.parallel.expert_model_parallel_size == 64
