"""FP8 from the command line: Megatron-LM's flags resolved into a recipe, one-line refusals, which
layers and GEMMs take FP8, and the FP8 scripts' smoke runs."""
import sys
from pathlib import Path

import pytest

from megalite.config import build_parser, model_config
from megalite.errors import UsageError
from megalite.precision.recipes import Recipe
from megalite.testing import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def _cfg(*argv):
    return build_parser("x", "gpt-tiny").parse_args(list(argv))


def test_megatrons_fp8_flags_resolve_to_a_recipe_with_its_defaults():
    assert _cfg().precision.fp8() is None
    assert _cfg("--fp8-format", "e4m3").precision.fp8() == Recipe("delayed", "e4m3", 1, "most_recent", 0, True)
    cfg = _cfg("--fp8-format", "hybrid", "--fp8-recipe", "mxfp8", "--fp8-margin", "2", "--no-fp8-wgrad",
               "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max")
    assert cfg.precision.fp8() == Recipe("mxfp8", "hybrid", 16, "max", 2, False)
    # deprecated and ignored by Megatron-LM too: accepted with its note
    assert any("--fp8-interval" in f for f in _cfg("--fp8-format", "e4m3", "--fp8-interval", "1").ignored_flags)


@pytest.mark.parametrize("argv, says", [
    (["--fp8-recipe", "tensorwise"], "--fp8-recipe applies to FP8 training only: add --fp8-format e4m3"),
    (["--first-last-layers-bf16"], "--first-last-layers-bf16 applies to FP8 training only"),
    (["--no-fp8-wgrad"], "--no-fp8-wgrad applies to FP8 training only"),
    (["--fp8-amax-history-len", "0", "--fp8-format", "e4m3"], "--fp8-amax-history-len"),
])
def test_an_fp8_flag_that_cannot_apply_is_one_line_naming_it(argv, says):
    with pytest.raises(UsageError) as e:
        model_config(_cfg(*argv))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_first_and_last_layers_stay_in_the_model_dtype_and_the_rest_of_the_model_too():
    from megalite.models import GPTModel
    from megalite.models.fp8 import enable_fp8
    from megalite.precision.recipes import fp8_layer_numbers
    from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear

    assert list(fp8_layer_numbers(6)) == [0, 1, 2, 3, 4, 5]
    assert list(fp8_layer_numbers(6, True)) == [1, 2, 3, 4]
    assert list(fp8_layer_numbers(6, True, 2, 1)) == [2, 3, 4]
    with pytest.raises(ValueError, match="leave none of the 4 layers in FP8"):
        fp8_layer_numbers(4, True, 2, 2)
    cfg = _cfg("--model", "llama-tiny", "--fp8-format", "e4m3", "--first-last-layers-bf16")
    config = model_config(cfg)
    model = GPTModel(config, seed=0, device="cpu")
    assert enable_fp8(model, cfg.precision.fp8(), fp8_layer_numbers(config.num_layers, True)) == 2 * 5  # q kv proj fc1 fc2
    in_fp8 = {name for name, m in model.named_modules() if getattr(m, "fp8", None) is not None}
    assert {n.split(".")[1] for n in in_fp8} == {"1", "2"}
    assert all(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for n, m in model.named_modules() if n in in_fp8)
    # the output layer and embeddings are not parallel linears of a layer: they keep their dtype
    assert not any("embedding" in n or "output" in n for n in in_fp8)


def test_megatrons_llama3_fp8_script_prints_its_fp8_settings(capsys):
    import pretrain_gpt

    fp8 = ["--mock-data", "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
           "--fp8-param-gather", "--print-config"]
    assert pretrain_gpt.main(fp8 + ["--zero-stage", "3"]) == 0
    out = capsys.readouterr().out
    assert 'fp8_format = "hybrid"' in out and "fp8_amax_history_len = 1024" in out and "fp8_param_gather = true" in out
    assert pretrain_gpt.main(fp8 + ["--use-distributed-optimizer"]) == 0  # ZeRO-1: a note, the same numbers
    captured = capsys.readouterr()
    assert "fp8_param_gather = false" in captured.out and "--fp8-param-gather (FP8 weights travel" in captured.err
    with pytest.raises(UsageError, match="--fp8-param-gather quantizes each shard with delayed scaling's scale"):
        model_config(_cfg("--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--fp8-param-gather", "--zero-stage", "3"))


def _scripts(rank, world, tmp):
    sys.path.insert(0, str(ROOT / "scripts"))
    import fp8_curves
    import fp8_step

    # (the synthetic stream: preparing the embedded corpus starts processes, which a test's rank may not)
    curves = fp8_curves.main(["--models", "llama-tiny", "--runs", "bf16", "tensorwise", "--iters", "2",
                              "--svg", str(tmp / "c.svg"), "--train-args=--mock-data"])
    steps = fp8_step.main(["--tiny", "--recipes", "bf16", "mxfp8"])
    return curves, steps, (tmp / "c.svg").read_text()


def test_the_fp8_scripts_run_and_report(tmp_path):
    curves, steps, picture = run_ranks(_scripts, 1, args=(tmp_path,))[0]
    assert set(curves["llama-tiny"]) == {"bf16", "tensorwise"} and len(curves["llama-tiny"]["bf16"]) == 2
    assert curves["llama-tiny"]["bf16"] != curves["llama-tiny"]["tensorwise"]
    assert picture.count("<polyline") == 4  # two loss curves, two gaps to bf16
    assert [r["recipe"] for r in steps] == ["bf16", "mxfp8"] and steps[0]["ratio_to_bf16"] == 1.0


def test_the_planner_runs_fp8_layers_gemms_at_the_fp8_rate():
    from megalite.metrics import layer_forward_flops
    from megalite.models import preset
    from megalite.tools.plan import Cluster
    from megalite.tools.plan.search import check_layout

    config, s, b = preset("gpt-1.3b"), 2048, 8
    common = dict(dp=8, micro_batch_size=b, global_batch_size=64, seq_length=s, gpu_memory_bytes=80 * 2 ** 30,
                  zero_stage=3, use_distributed_optimizer=True)
    base = check_layout(config, cluster=Cluster(gpus=8), **common)[1]
    fp8 = check_layout(config, cluster=Cluster(gpus=8), fp8_layers=24, **common)[1]
    half = check_layout(config, cluster=Cluster(gpus=8), fp8_layers=12, **common)[1]
    same = check_layout(config, cluster=Cluster(gpus=8, fp8_speedup=1.0), fp8_layers=24, **common)[1]
    dense, _ = layer_forward_flops(config, s, b)
    # the layers' dense forward, twice backward, on every micro-batch (1 per rank) of 8 ranks: at half the time
    saved = 8 * 24 * dense * 3 * (1 - 1 / 2)
    assert fp8.hardware_flops == base.hardware_flops  # the FLOPs are what they are; their time shrinks
    assert fp8.time.compute == pytest.approx(base.time.compute * (1 - saved / base.hardware_flops), rel=1e-12)
    assert base.time.compute > half.time.compute > fp8.time.compute and same.time.compute == base.time.compute
    assert fp8.time.dp_comm == base.time.dp_comm and fp8.memory.total == base.memory.total


def test_the_planners_command_line_plans_fp8_and_prints_its_flag(capsys):
    from megalite.tools.plan.cli import main

    argv = ["--model", "gpt-1.3b", "--gpus", "8", "--global-batch-size", "64", "--seq-length", "2048", "--tp", "1",
            "--pp", "1", "--micro-batch-size", "8", "--recompute", "none", "--zero-stage", "3", "--top", "1"]
    assert main(argv) == 0
    bf16 = capsys.readouterr().out
    assert main(argv + ["--fp8"]) == 0
    fp8 = capsys.readouterr().out
    assert "--fp8-format hybrid" in fp8 and "--fp8-format" not in bf16 and "FP8 GEMMs at 2x" in fp8

    def step(out):
        row = next(line for line in out.splitlines() if line.strip().startswith("1 "))
        return float(row.split("|")[2].split()[0])
    assert step(fp8) < 0.7 * step(bf16)


def test_mlas_projections_and_every_expert_take_fp8_and_the_router_does_not():
    from megalite.models import GPTModel
    from megalite.models.fp8 import enable_fp8, fp8_states

    cfg = _cfg("--model", "deepseek-tiny", "--fp8-format", "e4m3", "--q-lora-rank", "32")
    config = model_config(cfg)
    model = GPTModel(config, seed=0, device="cpu")
    enable_fp8(model, cfg.precision.fp8(), range(config.num_layers))
    named = {name.split(".", 2)[2] for name, m in model.named_modules()
             if getattr(m, "fp8", None) is not None or getattr(m, "fc1_fp8", None) is not None}
    assert {"attention.q_down", "attention.q_up", "attention.kv_down", "attention.kv_up", "attention.proj",
            "mlp.experts", "mlp.shared_experts.fc1", "mlp.shared_experts.fc2", "mlp.fc1"} <= named
    assert not any("router" in n or "mtp" in n for n in named)
    experts = config.num_moe_experts * sum(config.moe_layer_freq)
    dense = sum(1 for m in model.modules() if getattr(m, "fp8", None) is not None)
    assert len(fp8_states([model])) == dense + 2 * experts  # each expert's fc1 and fc2
    assert sum(len(m.fc1_fp8) for m in model.modules() if getattr(m, "fc1_fp8", None)) == experts


def test_a_weight_read_whole_over_tp_gathers_in_the_model_dtype_under_fp8_param_gather():
    """Grouped-query attention's key/value weight where TP exceeds the groups is gathered over TP and
    read in the model dtype: ZeRO-3 must bring those values, not FP8 ones."""
    import torch

    from megalite.optim.zero import ShardedParamBuffer
    from megalite.parallel.layers import ColumnParallelLinear
    from megalite.training.build import _gather_fp8_weights

    q, kv = ColumnParallelLinear(16, 16, bias=False), ColumnParallelLinear(16, 8, bias=False)
    for m in (q, kv):
        m.use_fp8(Recipe("delayed"))
    kv.weight.read_gathered_over_tp = True
    seen = {}

    class Buffer(ShardedParamBuffer):
        def __init__(self):
            pass

        def use_fp8_param_gather(self, states):
            seen.update(states)

    _gather_fp8_weights([torch.nn.ModuleList([q, kv])], [Buffer()])
    assert set(seen) == {id(q.weight)}


def test_first_and_last_layers_that_leave_none_in_fp8_are_refused_in_one_line_before_the_run():
    from megalite.config import validate

    cfg = _cfg("--fp8-format", "e4m3", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "2",
               "--num-layers-at-end-in-bf16", "2")
    with pytest.raises(UsageError, match="leave none of the 4 layers in FP8") as e:
        validate(cfg, 1, model_config(cfg), machine=False)
    assert "\n" not in str(e.value)
    assert list(_cfg("--fp8-format", "e4m3").precision.fp8_layers(4)) == [0, 1, 2, 3]
    assert list(_cfg().precision.fp8_layers(4)) == []
