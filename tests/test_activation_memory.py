"""The activation-memory formula and its measurement; the attention backends agree. Sequence
parallelism's and recomputation's equality tests live in test_sequence_parallel.py and
test_recompute.py."""
import importlib.util
from pathlib import Path

import pytest
import torch

from megalite.models import activation_bytes_per_layer
from megalite.testing import run_ranks
from test_sequence_parallel import BASE, assert_same_runs
from training_ranks import train_params

ROOT = Path(__file__).resolve().parents[1]


def test_attention_backends_agree():
    argv = BASE[:-4] + ["--hidden-dropout", "0", "--attention-dropout", "0"]
    sdpa = run_ranks(train_params, 1, args=(argv,))
    explicit = run_ranks(train_params, 1, args=(argv + ["--attention-backend", "torch"],))
    assert_same_runs(explicit, sdpa, 1e-5, params=False)


def test_formula_terms():
    s, b, h, a = 2048, 4, 4096, 32
    sbh = s * b * h
    assert activation_bytes_per_layer(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert activation_bytes_per_layer(s, b, h, a, t=8) == sbh * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert activation_bytes_per_layer(s, b, h, a, t=8, sequence_parallel=True) == sbh * (34 + 5 * a * s / h) / 8
    assert activation_bytes_per_layer(s, b, h, a, t=8, sequence_parallel=True, recompute="selective") == 34 * sbh / 8
    assert activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * sbh
    with pytest.raises(ValueError):
        activation_bytes_per_layer(s, b, h, a, recompute="most")


def _script():
    spec = importlib.util.spec_from_file_location("activation_memory", ROOT / "scripts" / "activation_memory.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_measured_activation_bytes_follow_the_formula_on_cpu():
    script = _script()
    cpu = torch.device("cpu")
    s, b, h, a = 256, 2, 256, 4
    measured = {m: script.measure(s, b, h, a, m, cpu) for m in ("none", "selective", "full")}
    formula = {m: activation_bytes_per_layer(s, b, h, a, recompute=m) for m in measured}
    for m in measured:
        assert 0.9 <= measured[m] / formula[m] <= 1.25, (m, measured[m], formula[m])
    saved = measured["none"] - measured["selective"]
    assert saved >= 0.7 * (formula["none"] - formula["selective"])


LLAMA_LAYERS = {
    "gqa-swiglu": dict(num_query_groups=2, gated_linear_unit=True, activation="silu", ffn_hidden_size=512),
    "gqa-swiglu-rope-qknorm-nobias": dict(num_query_groups=2, gated_linear_unit=True, activation="silu",
                                          ffn_hidden_size=384, position_embedding_type="rope", qk_layernorm=True,
                                          add_bias_linear=False),
    "mqa-rope-half": dict(num_query_groups=1, position_embedding_type="rope", rotary_percent=0.5),
    "mha-rope-qknorm": dict(position_embedding_type="rope", qk_layernorm=True),
}


@pytest.mark.parametrize("arch", sorted(LLAMA_LAYERS))
def test_measured_llama_layer_activations_follow_the_general_formula_on_cpu(arch):
    """Grouped-query attention, SwiGLU, rotary positions and qk-layernorm under SDPA (which keeps
    keys and values at G heads): the planner's per-layer bytes (`layer_activation_bytes`) against
    what autograd keeps, as the difference from a GPT-2 layer of the same size (the terms the Llama
    family changes) and as a whole."""
    from megalite.models.memory import layer_activation_bytes

    script, cpu, s, b, h, a = _script(), torch.device("cpu"), 256, 2, 256, 8
    sdpa = dict(attention_backend="sdpa", attention_dropout=0.0)  # with dropout CPU SDPA takes the math path
    gpt_measured = script.measure(s, b, h, a, "none", cpu, **sdpa)
    _, gpt = script.build_layer(s, h, a, "none", cpu, torch.bfloat16, **sdpa)
    measured = script.measure(s, b, h, a, "none", cpu, **sdpa, **LLAMA_LAYERS[arch])
    _, config = script.build_layer(s, h, a, "none", cpu, torch.bfloat16, **sdpa, **LLAMA_LAYERS[arch])
    formula, sbh = layer_activation_bytes(config, s, b), s * b * h
    assert 0.9 <= measured / formula <= 1.25, (measured / sbh, formula / sbh)
    change_measured = (measured - gpt_measured) / sbh
    change_formula = (formula - layer_activation_bytes(gpt, s, b)) / sbh
    assert change_measured == pytest.approx(change_formula, abs=0.2), (change_measured, change_formula)
