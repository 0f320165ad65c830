"""The planner's optimizer choices: under --optimizer muon and with Adam's moments in bf16 the
optimizer bytes it predicts equal what megalite allocates (tp 2, pp 2, bf16 weights, experts over ep 2,
ZeRO-1 shards), the Newton-Schulz FLOPs of each --muon-tp-mode by hand, ZeRO kept out of a Muon
search, and the commands it writes."""
import pytest

from megalite import arguments
from megalite.testing import run_ranks
from megalite.tools import plan as P
from megalite.tools.plan.muon import ns_flops, optimizer_of
from test_plan import TINY, held_bytes
from test_plan_cli import run_cli
from training_ranks import parse

MUON = ["--optimizer", "muon"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64", "--disable-bias-linear"]


@pytest.mark.parametrize("tp,pp,dp,ep,extra", [(2, 1, 1, 1, []), (1, 2, 1, 1, []), (1, 1, 2, 2, MOE)],
                         ids=["tp2", "pp2", "ep2"])
def test_predicted_optimizer_bytes_equal_what_muon_allocates(tp, pp, dp, ep, extra):
    argv = TINY + ["--tp", str(tp), "--pp", str(pp), "--ep", str(ep)] + extra
    variants = [MUON, MUON + ["--bf16"]]
    results = run_ranks(held_bytes, tp * pp * dp, args=(argv, variants), timeout=120)
    for v, flags in enumerate(variants):
        args = parse(argv + flags)
        config = arguments.model_config(args)
        dtype = "bf16" if args.precision.bf16 else "fp32"
        run = P.Run(args.training.global_batch_size, args.model.seq_length, dtype, args.data_parallel.ddp_bucket_size,
                    muon_tp_mode="blockwise")
        layout = P.Layout(tp, pp, dp, None, args.training.micro_batch_size, "none", False, False, ep=ep)
        pred = P.predict(config, layout, P.Cluster(gpus=tp * pp * dp), run=run)
        held = max(r[v]["optimizer"] for r in results)
        adam = P.predict(config, layout, P.Cluster(gpus=tp * pp * dp), run=P.Run(
            args.training.global_batch_size, args.model.seq_length, dtype, args.data_parallel.ddp_bucket_size))
        assert pred.memory.optimizer == held < adam.memory.optimizer, (flags, pred.memory.optimizer, held)
        assert pred.time.optimizer > adam.time.optimizer  # the Newton-Schulz GEMMs


LOW = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]


def test_predicted_optimizer_bytes_of_bf16_moments_equal_what_megalite_allocates():
    argv = TINY + ["--tp", "1", "--pp", "1"]
    variants = [LOW, LOW + ["--use-distributed-optimizer"], LOW[:3] + ["--bf16"], LOW + MUON]
    results = run_ranks(held_bytes, 2, args=(argv, variants), timeout=120)
    for v, flags in enumerate(variants):
        args = parse(argv + flags)
        config = arguments.model_config(args)
        dtype = "bf16" if args.precision.bf16 else "fp32"
        dist = args.data_parallel.use_distributed_optimizer
        fields = optimizer_of(args.optimizer)
        run = P.Run(args.training.global_batch_size, args.model.seq_length, dtype, args.data_parallel.ddp_bucket_size,
                    **fields)
        layout = P.Layout(1, 1, 2, None, args.training.micro_batch_size, "none", False, dist,
                          zero_stage=1 if dist else 0)
        pred = P.predict(config, layout, P.Cluster(gpus=2), run=run)
        assert pred.memory.optimizer == max(r[v]["optimizer"] for r in results), (flags, fields)
        for flag in ("--exp-avg-dtype", "--exp-avg-sq-dtype"):  # the command names the moments the run stores
            assert (f"{flag} bf16" in pred.command()) == (flag in flags), (flag, flags)


def test_the_experts_part_counts_the_choices_too():
    args = parse(TINY + MOE + ["--ep", "2"])
    config = arguments.model_config(args)
    layout = P.Layout(1, 1, 2, None, 2, "none", False, False, ep=2)

    def experts(**fields):
        run = P.Run(args.training.global_batch_size, args.model.seq_length, "fp32", 30000, **fields)
        pred = P.predict(config, layout, P.Cluster(gpus=2), run=run)
        return pred.memory.experts, pred.stages[pred.peak_stage].state.experts.owned_numel

    (adam, owned), (low, _) = experts(), experts(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    (muon, _) = experts(muon_tp_mode="blockwise")
    assert adam - low == 4 * owned and adam - muon == 4 * owned  # each expert weight a matrix: one moment


def test_newton_schulz_flops_of_each_mode_by_hand():
    steps = 5
    # a 64 x 256 matrix: seen wide, g = 64, k = 256
    assert ns_flops(64, 256, None, 1, "blockwise", steps) == 5 * (4 * 64 * 64 * 256 + 2 * 64 ** 3)
    assert ns_flops(64, 256, 0, 2, "duplicated", steps) == ns_flops(64, 256, None, 1, "blockwise", steps)
    assert ns_flops(64, 256, 0, 2, "blockwise", steps) == 5 * (4 * 32 * 32 * 256 + 2 * 32 ** 3)  # the 32 x 256 shard
    # distributed, rows sharded: the Gram matrix over the 256 columns, 32 rows of the shard contracted
    assert ns_flops(64, 256, 0, 2, "distributed", steps) == 5 * (4 * 256 * 256 * 32 + 2 * 256 ** 3)
    assert ns_flops(64, 256, 1, 2, "distributed", steps) == 5 * (4 * 64 * 64 * 128 + 2 * 64 ** 3)


def test_the_search_keeps_zero_out_and_the_command_names_muon(capsys):
    code, out, _ = run_cli(["--model", "gpt2-350m", "--gpus", "8", "--global-batch-size", "64", "--seq-length",
                            "1024", "--optimizer", "muon", "--muon-tp-mode", "distributed"], capsys)
    command = out.split("run the best with:")[1]
    assert code == 0 and "--optimizer muon --muon-tp-mode distributed" in command
    assert "--zero-stage" not in command and "--use-distributed-optimizer" not in command
    with pytest.raises(SystemExit):
        P.main(["--model", "gpt2-350m", "--gpus", "8", "--global-batch-size", "64", "--optimizer", "muon",
                "--zero-stage", "1"])
    assert "whole matrices" in capsys.readouterr().err
