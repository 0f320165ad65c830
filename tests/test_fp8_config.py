"""FP8 from the command line: Megatron-LM's flags resolved into a recipe, one-line refusals, which
layers and GEMMs take FP8, and the FP8 scripts' smoke runs."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megalite.config import build_parser, model_config
from megalite.errors import UsageError
from megalite.precision.recipes import Recipe

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
    from megalite.models.fp8 import enable_fp8, fp8_layer_numbers
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


def test_megatrons_llama3_fp8_script_prints_its_fp8_settings(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), "--mock-data", "--fp8-format", "hybrid",
                          "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max", "--print-config"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert 'fp8_format = "hybrid"' in run.stdout and "fp8_amax_history_len = 1024" in run.stdout
    refused = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), "--mock-data", "--fp8-format", "hybrid",
                              "--fp8-param-gather", "--print-config"], capture_output=True, text=True, timeout=120,
                             cwd=ROOT)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "--fp8-param-gather" in refused.stderr


@pytest.mark.slow
def test_the_fp8_scripts_run_and_report(tmp_path):
    curves = subprocess.run([sys.executable, str(ROOT / "scripts" / "fp8_curves.py"), "--models", "llama-tiny",
                             "--runs", "bf16", "tensorwise", "--iters", "3", "--json", str(tmp_path / "c.json"),
                             "--svg", str(tmp_path / "c.svg")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert curves.returncode == 0, curves.stderr[-2000:]
    data = json.loads((tmp_path / "c.json").read_text())
    assert set(data["llama-tiny"]) == {"bf16", "tensorwise"} and len(data["llama-tiny"]["bf16"]) == 3
    assert data["llama-tiny"]["bf16"] != data["llama-tiny"]["tensorwise"]
    assert (tmp_path / "c.svg").read_text().count("<polyline") == 4  # two loss curves, two gaps
    step = subprocess.run([sys.executable, str(ROOT / "scripts" / "fp8_step.py"), "--tiny", "--recipes", "bf16",
                           "tensorwise", "mxfp8", "--json", str(tmp_path / "s.json")], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert step.returncode == 0, step.stderr[-2000:]
    rows = json.loads((tmp_path / "s.json").read_text())
    assert [r["recipe"] for r in rows] == ["bf16", "tensorwise", "mxfp8"] and rows[0]["ratio_to_bf16"] == 1.0
