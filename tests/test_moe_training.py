"""A tiny MoE GPT (8 experts, top-2, a dense first layer, a shared expert, aux and z-losses) trains
3 iterations to the one-device losses (fp32, <= 1e-5 relative) at every expert layout: EP 2 and 4,
TP 2 (SP) x EP 2, TP 2 with ETP 1 x EP 4, PP 2 x EP 2 (interleaved too), CP 2 x EP 2, the distributed
optimizer, ZeRO-2 and ZeRO-3 (with PP 2, with recompute), full and selective recompute, the
all-gather dispatcher; and gradient accumulation 1 vs 4 at one global batch. Local SGD with experts
inside each replica equals data parallelism at H 1. The MoE flags' bad values end in one line
before anything starts."""
import pytest
import torch

from helpers import rel_err
from megalite.testing import run_ranks
from training_ranks import gpt_run, one_device_each, several, train_losses

MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-layer-freq", "([0]*1+[1]*3)",
       "--moe-ffn-hidden-size", "64", "--moe-shared-expert-intermediate-size", "64",
       "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
       "--disable-bias-linear"]  # experts with biases run at ETP 1 only (test_moe_biases.py): this matrix has ETP 2
BASE = ["--train-iters", "10", "--log-interval", "1", "--seq-length", "32", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--eval-interval", "0", *MOE]

# DeepSeek-style routing: sigmoid scores, the expert bias moved once per step from the global counts.
BIAS = BASE + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
               "--moe-router-bias-update-rate", "0.01", "--moe-router-load-balancing-type", "seq_aux_loss"]

LAYOUTS = {
    "ep2": ["--ep", "2"],
    "ep4": ["--ep", "4"],
    "tp2-sp-ep2": ["--tp", "2", "--sequence-parallel", "--ep", "2"],
    "tp2-etp1-ep4": ["--tp", "2", "--sequence-parallel", "--etp", "1", "--ep", "4"],
    "pp2-ep2": ["--pp", "2", "--ep", "2"],
    "pp2-interleaved-ep2": ["--pp", "2", "--vpp", "2", "--ep", "2"],
    "cp2-ep2": ["--cp", "2", "--ep", "2"],
    "ep2-distributed-optimizer": ["--ep", "2", "--use-distributed-optimizer"],
    "ep4-zero2": ["--ep", "4", "--zero-stage", "2"],
    "ep2-recompute": ["--ep", "2", "--recompute", "full"],
    "ep2-selective-recompute": ["--ep", "2", "--recompute", "selective"],
    "ep2-zero3": ["--ep", "2", "--zero-stage", "3"],
    "pp2-ep2-zero3": ["--pp", "2", "--ep", "2", "--zero-stage", "3"],
    "ep2-zero3-recompute": ["--ep", "2", "--zero-stage", "3", "--recompute", "full"],
    "ep4-allgather": ["--ep", "4", "--moe-token-dispatcher-type", "allgather"],
}
BIAS_LAYOUTS = {
    "bias-ep2": ["--ep", "2"],
    "bias-pp2-ep2": ["--pp", "2", "--ep", "2"],
    "bias-tp2-sp-ep2-recompute": ["--tp", "2", "--sequence-parallel", "--ep", "2", "--recompute", "full"],
}


def losses_and_biases(rank, world, argv):
    """The losses, and every router's expert bias on this rank by layer number."""
    from megalite.models.moe.router import TopKRouter

    run = gpt_run(argv)
    biases = {}
    for chunk in run.model_chunks:
        for i, layer in enumerate(chunk.layers):
            for m in layer.modules():
                if isinstance(m, TopKRouter) and m.expert_bias is not None:
                    biases[chunk.layer_numbers[i]] = m.expert_bias.clone()
    return [r["loss"] for r in run.records], biases


def _biases(runs):
    """Layer number -> bias over the ranks of a run (a stage's ranks agree; each layer once)."""
    out = {}
    for _, biases in runs:
        for layer, b in biases.items():
            assert layer not in out or torch.equal(out[layer], b), f"ranks disagree on layer {layer}'s bias"
            out[layer] = b
    return out


# The layout matrix: 3 steps (the losses after 2 updates) show a layout's numbers as well as 10 (CI time).
THREE = ["--train-iters", "3"]


@pytest.fixture(scope="module")
def references():
    """The one-device runs, two at a time in one spawn: (losses, expert biases) of the matrix's
    BASE and BIAS, and of RESUME's 6 iterations (the resume tests' unbroken run)."""
    return dict(zip(("base", "resume", "bias"),
                    one_device_each(losses_and_biases, [BASE + THREE, RESUME, BIAS + THREE])))


@pytest.fixture(scope="module")
def one_device(references):
    return references["base"][0]


@pytest.mark.slow
def test_every_expert_layout_trains_to_the_one_device_losses(one_device, references):
    argvs = [BASE + THREE + f for f in LAYOUTS.values()] + [BIAS + THREE + f for f in BIAS_LAYOUTS.values()]
    per_rank = run_ranks(several, 4, args=(losses_and_biases, argvs), timeout=900)
    bias_losses, bias_reference = references["bias"]
    assert sorted(bias_reference) == [1, 2, 3]  # the MoE layers
    assert all(b.abs().sum() > 0 for b in bias_reference.values()), "the expert bias never moved"
    for i, name in enumerate([*LAYOUTS, *BIAS_LAYOUTS]):
        runs = [rank_runs[i] for rank_runs in per_rank]
        losses = runs[0][0] if name != "bias-pp2-ep2" else runs[-1][0]  # the last stage logs the loss
        want = bias_losses if name.startswith("bias") else one_device
        assert len(losses) == 3 and len(want) == 3
        assert rel_err(torch.tensor(losses), torch.tensor(want)) <= 1e-5, (name, losses, want)
        if name.startswith("bias"):  # moved by the same steps, from the same global counts
            got = _biases(runs)
            assert sorted(got) == [1, 2, 3] and all(torch.equal(got[k], bias_reference[k]) for k in got), name


def test_ep2_trains_to_the_one_device_losses(one_device):
    losses = run_ranks(train_losses, 2, args=(BASE + THREE + ["--ep", "2"],))[0]
    assert rel_err(torch.tensor(losses), torch.tensor(one_device)) <= 1e-5, (losses, one_device)


def _zero3_save_then_resume(rank, world, save_dir):
    """Train at EP 2 x ZeRO-3 (experts sharded over expert data parallelism: 2 ranks) to iteration 3
    and save; resume at EP 1 without ZeRO. Both runs' losses."""
    from training_ranks import gpt_run as run

    first = run(RESUME + ["--ep", "2", "--zero-stage", "3", "--save", save_dir, "--save-interval", "3",
                          "--exit-interval", "3"]).records
    second = run(RESUME + ["--load", save_dir]).records
    return [r["loss"] for r in first], [r["loss"] for r in second]


def test_ep2_zero3_trains_to_the_one_device_losses_and_its_checkpoint_resumes_without_zero(tmp_path, references):
    """ZeRO-3 shards the experts over their own data-parallel group; a save copies each expert while
    its unit is gathered, and the checkpoint is the same layout-free one."""
    unbroken = references["resume"][0]
    trained, resumed = run_ranks(_zero3_save_then_resume, 4, args=(str(tmp_path / "ckpt"),))[0]
    assert len(trained) == 3 and rel_err(torch.tensor(trained), torch.tensor(unbroken[:3])) <= 1e-5, trained
    assert len(resumed) == 3 and rel_err(torch.tensor(resumed), torch.tensor(unbroken[3:])) <= 1e-5


# Local SGD: plain SGD inside, a plain outer step every iteration: data parallelism's numbers
# (tests/test_local_sgd.py), with the experts' gradients summed inside each replica only.
LOCAL_SGD = ["--optimizer", "sgd", "--lr", "0.05", "--min-lr", "0.05", "--lr-warmup-iters", "0", "--lr-decay-style",
             "constant", "--clip-grad", "0", "--train-iters", "3"]
PLAIN_OUTER = ["--local-sgd-interval", "1", "--outer-lr", "1", "--outer-momentum", "0"]


def test_local_sgd_h1_with_experts_equals_data_parallelism_with_experts_inside_each_replica():
    """tp 2 x dp 2: the experts split over the replica's two ranks (ETP 1 x EP 2), and kept whole on
    both (ETP 1 x EP 1: their gradients summed over the replica's expert data-parallel group)."""
    layouts = [["--tp", "2", "--sequence-parallel", "--etp", "1", "--ep", "2"],
               ["--tp", "2", "--sequence-parallel", "--etp", "1"]]
    argvs = [BASE + LOCAL_SGD + layout + outer for layout in layouts for outer in ([], PLAIN_OUTER)]
    runs = run_ranks(several, 4, args=(train_losses, argvs))[0]
    for k, layout in enumerate(layouts):
        dp, local = runs[2 * k], runs[2 * k + 1]
        assert len(local) == 3 and rel_err(torch.tensor(local), torch.tensor(dp)) <= 1e-5, (layout, local, dp)


def _local_sgd_resume(rank, world, save_dir, argv):
    """Unbroken; then to iteration 3 (mid-round of H 2) saving, and resumed from it: the losses."""
    from training_ranks import gpt_run as run

    whole = [r["loss"] for r in run(argv).records]
    first = [r["loss"] for r in run(argv + ["--save", save_dir, "--save-interval", "3", "--exit-interval", "3"]).records]
    return whole, first + [r["loss"] for r in run(argv + ["--load", save_dir]).records]


@pytest.mark.slow
def test_local_sgd_with_experts_resumes_mid_round_bitwise(tmp_path):
    """Saved at 3, mid-round of H 2: the resumed run takes the outer step at 4, and iteration 5's loss shows it."""
    argv = BASE + ["--tp", "2", "--sequence-parallel", "--etp", "1", "--ep", "2", "--local-sgd-interval", "2",
                   "--train-iters", "5"]
    whole, resumed = run_ranks(_local_sgd_resume, 4, args=(str(tmp_path / "ckpt"), argv))[0]
    assert len(whole) == 5 and resumed == whole, (resumed, whole)


def _nan_router(rank, world, argv):
    """Train with layer 2's router weights NaN (set before each of its forwards)."""
    from megalite.models.moe.layer import MoELayer
    from training_ranks import gpt_run as run

    def poison(module, args):
        if isinstance(module, MoELayer) and module.layer_number == 2:
            module.router.weight.data.fill_(float("nan"))

    hook = torch.nn.modules.module.register_module_forward_pre_hook(poison)
    try:
        run(argv)
    finally:
        hook.remove()


# fp32 steps skip on the device: the host reads the skips at log lines and the last iteration (5).
@pytest.mark.parametrize("flags, iteration", [(["--log-interval", "1"], 1),
                                              (["--log-interval", "50", "--max-skipped-iters", "3"], 5)],
                         ids=["at-a-log-line", "when-skipped-steps-stop-training"])
def test_nan_router_logits_stop_training_with_one_line_naming_the_layer(flags, iteration):
    """Found on the device, read at the log line (or when skipped steps stop training): no host sync.
    Layer 3 is named too: its input is layer 2's NaN output."""
    import re

    from megalite.testing import RankFailure

    with pytest.raises(RankFailure) as e:
        run_ranks(_nan_router, 2, args=(BASE + ["--ep", "2", "--train-iters", "5", *flags],))
    line = re.search(r"stopping at iteration (\d+): NaN/inf router logits in layer 2 \((\d+) tokens\), layer 3 "
                     r"\((\d+) tokens\): [^\n]*The last checkpoint is intact\.", str(e.value))
    assert line, str(e.value)
    assert int(line[1]) == iteration and int(line[2]) == int(line[3]) == 8 * 32 * iteration  # every token


MOE_FIGURES = ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance", "moe_dropped_fraction")


def records(rank, world, argv):
    return gpt_run(argv).records


def test_the_logged_moe_figures_are_the_same_at_ep2_and_on_one_device():
    argv = BASE + ["--train-iters", "4", "--log-interval", "2", "--moe-expert-capacity-factor", "1.0"]
    one = run_ranks(records, 1, args=(argv,))[0]
    ep2 = run_ranks(records, 2, args=(argv + ["--ep", "2"],))[0]
    assert [r["iteration"] for r in one] == [2, 4]
    for a, b in zip(one, ep2):
        for key in MOE_FIGURES:
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (key, a[key], b[key])
        assert len(a["moe_load_imbalance_per_layer"]) == 3  # the MoE layers
    # 3 MoE layers, coefficients 0.01 and 0.001: the aux term is near 0.01 per layer when balanced
    assert 0.02 < one[0]["moe_aux_loss"] < 0.06 and 0 < one[0]["moe_z_loss"] < 0.1
    assert 0 < one[0]["moe_dropped_fraction"] < 0.5 and one[0]["moe_load_imbalance"] >= 1.0


def test_gradient_accumulation_1_and_4_train_alike_at_one_global_batch():
    seq = BASE + ["--moe-router-load-balancing-type", "seq_aux_loss"]
    whole, accumulated = run_ranks(several, 1, args=(train_losses, [
        seq + ["--micro-batch-size", "8"], seq + ["--micro-batch-size", "2"]]))[0]
    assert rel_err(torch.tensor(accumulated), torch.tensor(whole)) <= 1e-5, (accumulated, whole)


@pytest.mark.parametrize("world, argv, message", [
    (2, ["--ep", "2"], r"--ep: for mixture-of-experts models only: add --num-experts N"),
    (1, ["--moe-router-topk", "4"], r"--moe-router-topk: for mixture-of-experts models only"),
    (4, MOE + ["--ep", "3"], r"expert-tensor x expert parallel sizes \(1 x 3 = 3\) do not divide"),
    (6, MOE + ["--ep", "3", "--global-batch-size", "12"], r"--num-experts 8 is not divisible by --ep 3"),
    (4, MOE + ["--tp", "2", "--sequence-parallel", "--ep", "4"],
     r"\(2 x 4 = 8\) do not divide the ranks of a pipeline stage \(TP x CP x DP = 2 x 1 x 2 = 4\)"),
    (2, MOE + ["--tp", "2"], r"mixture-of-experts layers at --tp 2 need --sequence-parallel"),
    (1, MOE + ["--moe-router-topk", "9"], r"--moe-router-topk \(9\) must be between 1 and the number of experts"),
    (1, MOE + ["--moe-layer-freq", "[0,1]"], r"--moe-layer-freq lists 2 entries .* for 4 layers"),
    (4, MOE + ["--ep", "2", "--local-sgd-interval", "4"],
     r"--local-sgd-interval keeps expert parallelism inside a replica: --etp 1 x --ep 2 must divide --tp x --cp \(1\)"),
    (2, MOE + ["--local-sgd-interval", "4", "--moe-router-load-balancing-type", "global_aux_loss"],
     r"global_aux_loss counts tokens over every replica each step"),
    (2, MOE + ["--local-sgd-interval", "4", "--moe-router-score-function", "sigmoid",
               "--moe-router-enable-expert-bias"], r"--moe-router-enable-expert-bias moves the bias from the whole"),
])
def test_bad_moe_layouts_end_in_one_line_before_anything_starts(world, argv, message):
    from megalite import config as C
    from megalite.errors import UsageError

    cfg = C.build_parser("test", "gpt-tiny").parse_args(["--mock-data", *argv])
    with pytest.raises(UsageError, match=message):
        C.validate(cfg, world, C.model_config(cfg))


# 6 iterations, saved at 3: 3 optimizer steps (and expert-bias updates) on each side of the resume.
RESUME = BASE + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                 "--moe-router-bias-update-rate", "0.01", "--moe-router-load-balancing-type", "seq_aux_loss",
                 "--train-iters", "6"]


def _save_then_resume(rank, world, save_dir, save_flags, resume_runs):
    """One spawn: train 6 iterations at `save_flags` saving at 3 (kept: --exit-interval), then for each
    (flags) of `resume_runs` resume from it; the losses of iterations 4-6 of each."""
    from training_ranks import gpt_run as run

    run(RESUME + save_flags + ["--save", save_dir, "--save-interval", "3", "--exit-interval", "3"])
    out = []
    for flags in resume_runs:
        out.append([r["loss"] for r in run(RESUME + flags + ["--load", save_dir]).records])
    return out


@pytest.mark.slow
def test_a_checkpoint_saved_at_ep4_resumes_exactly_at_ep1_ep2_and_with_etp_and_tp_changed(tmp_path, references):
    """Layout-free expert checkpoints: the optimizer state and the expert bias come back too."""
    unbroken = references["resume"][0]
    resumes = {"ep1": [], "ep2": ["--ep", "2"], "tp2-sp-etp2-ep2": ["--tp", "2", "--sequence-parallel", "--ep", "2"],
               "tp2-sp-etp1-ep4-distributed-optimizer": ["--tp", "2", "--sequence-parallel", "--etp", "1", "--ep", "4",
                                                         "--use-distributed-optimizer"]}
    runs = run_ranks(_save_then_resume, 4, args=(str(tmp_path / "ckpt"), ["--ep", "4"], list(resumes.values())),
                     timeout=900)[0]
    for name, losses in zip(resumes, runs):
        assert len(losses) == 3, (name, losses)
        assert rel_err(torch.tensor(losses), torch.tensor(unbroken[3:])) <= 1e-5, (name, losses, unbroken[3:])


def _resume_with(rank, world, save_dir, resume_argv):
    from training_ranks import gpt_run as run

    run(BASE + ["--train-iters", "2", "--save", save_dir])
    return [r["loss"] for r in run(resume_argv + ["--load", save_dir]).records]


def test_a_moe_checkpoint_resumes_from_load_alone_and_refuses_another_router(tmp_path):
    """--load with no model flags takes the checkpoint's experts and router; a flag that changes
    what the router computes is refused in one line naming it."""
    losses = run_ranks(_resume_with, 1, args=(str(tmp_path / "a"), ["--train-iters", "3", "--log-interval", "1",
                                                                    "--seq-length", "32", "--global-batch-size", "8",
                                                                    "--micro-batch-size", "2", "--eval-interval", "0"]))[0]
    assert len(losses) == 1 and 0 < losses[0] < 20
    with pytest.raises(Exception, match=r"moe_router_topk 2 \(checkpoint\) vs 3 \(now\)"):
        run_ranks(_resume_with, 1, args=(str(tmp_path / "b"), BASE + ["--train-iters", "3",
                                                                       "--moe-router-topk", "3"]))


def test_a_moe_preset_changes_only_with_the_moe_flags_given_and_plans_at_its_ep():
    """--model moe-tiny is a MoE model without --num-experts; a MoE flag changes that field alone
    (the preset's dense first layer and shared expert stay); --plan's check predicts at the run's EP."""
    from megalite import config as C
    from megalite.training.plan_check import check_run

    cfg = C.build_parser("test", "gpt-tiny").parse_args(["--mock-data", "--model", "moe-tiny", "--ep", "2",
                                                         "--moe-router-topk", "3", "--seq-length", "32"])
    model = C.model_config(cfg)
    assert (model.num_moe_experts, model.moe_router_topk, model.moe_layer_freq) == (8, 3, [0, 1, 1, 1])
    assert model.moe_shared_expert_intermediate_size == 32 and model.moe_ffn_hidden_size == 32
    C.validate(cfg, 2, model)
    _, prediction = check_run(cfg, 2, gpu_memory_bytes=80 * 2 ** 30)
    assert (prediction.layout.ep, prediction.layout.edp) == (2, 1)


def test_a_moe_preset_takes_a_new_depth_with_its_layer_pattern_and_resumes_with_its_flags(tmp_path):
    """--num-layers 8 needs a --moe-layer-freq for 8 layers (the preset's lists 4), given before the
    preset is built; a run of the preset with --moe-router-topk 3 resumes from --load alone at top-3."""
    from megalite import config as C

    cfg = C.build_parser("test", "gpt-tiny").parse_args(["--mock-data", "--model", "moe-tiny", "--num-layers", "8",
                                                         "--moe-layer-freq", "([0]*2+[1]*6)"])
    assert C.model_config(cfg).moe_layer_freq == [0, 0, 1, 1, 1, 1, 1, 1]
    base = ["--model", "moe-tiny", "--seq-length", "32", "--global-batch-size", "4", "--micro-batch-size", "2",
            "--log-interval", "1", "--eval-interval", "0"]
    run_ranks(train_losses, 1, args=(base + ["--moe-router-topk", "3", "--train-iters", "2", "--save",
                                             str(tmp_path)],))
    resumed = C.build_parser("test", "gpt-tiny").parse_args(["--mock-data", "--load", str(tmp_path)])
    from megalite.training.checkpoint_shape import adopt_checkpoint_shape

    model = C.model_config(adopt_checkpoint_shape(resumed))
    assert (model.num_moe_experts, model.moe_router_topk, model.moe_layer_freq) == (8, 3, [0, 1, 1, 1])
