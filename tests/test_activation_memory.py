"""The activation-memory formula and its measurement; the attention backends agree. Sequence
parallelism's and recomputation's equality tests live in test_sequence_parallel.py and
test_recompute.py."""
import importlib.util
from pathlib import Path

import dataclasses

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
    # heads twice hidden / heads wide (Qwen3's shape) and half as wide: every per-head tensor scales
    "gqa-wide-heads-rope-qknorm": dict(num_query_groups=2, gated_linear_unit=True, activation="silu",
                                       ffn_hidden_size=512, position_embedding_type="rope", qk_layernorm=True,
                                       kv_channels=64),
    "mha-narrow-heads-rope": dict(position_embedding_type="rope", kv_channels=16),
    "gqa-rope-qk-l2-norm": dict(num_query_groups=2, position_embedding_type="rope", qk_l2_norm=True),  # Llama 4's
    "mha-rope-qk-l2-norm": dict(position_embedding_type="rope", qk_l2_norm=True),
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



def _context_parallel_layer_bytes(rank, world, s, b, h, a, comm_type, a2a_size=1):
    """Bytes one CP rank's GPT layer keeps for backward on its s/cp tokens (saved-tensor hooks)."""
    from megalite import parallel
    from megalite.parallel.context_parallel_hierarchy import initialize_hierarchy

    parallel.initialize_model_parallel(1, context_parallel_size=world)
    extra = {}
    if comm_type == "a2a+p2p":
        initialize_hierarchy(a2a_size)
        extra = {"cp_a2a_size": a2a_size}
    return _script().measure(s // world, b, h, a, "none", torch.device("cpu"), attention_backend="sdpa",
                             attention_dropout=0.0, cp_comm_type=comm_type, max_position_embeddings=s, **extra)


def test_context_parallel_layer_activations_fall_as_one_over_cp_and_follow_the_formula():
    """A rank of cp = 1, 2, 4 keeps a layer's activations of s/cp tokens plus what the ring (fp32
    log-sum-exp) or the all-to-all (also SDPA's own output) attention keeps; cp = 1 is SDPA."""
    from megalite.models.memory import layer_activation_bytes

    s, b, h, a = 256, 2, 128, 4
    config = _script().build_layer(s, h, a, "none", torch.device("cpu"), torch.bfloat16, attention_backend="sdpa",
                                   attention_dropout=0.0)[1]
    measured, formula = {}, {}
    for comm_type in ("p2p", "a2a"):
        for cp in (1, 2, 4):
            ranks = run_ranks(_context_parallel_layer_bytes, cp, args=(s, b, h, a, comm_type))
            assert len(set(ranks)) == 1, ranks  # load-balanced: every rank keeps the same
            measured[comm_type, cp] = ranks[0]
            formula[comm_type, cp] = layer_activation_bytes(config, s, b, cp=cp, cp_comm_type=comm_type)
            assert 0.9 <= measured[comm_type, cp] / formula[comm_type, cp] <= 1.25, (comm_type, cp)
    for comm_type in ("p2p", "a2a"):
        assert measured[comm_type, 4] / measured[comm_type, 2] == pytest.approx(0.5, rel=0.02)
        assert measured[comm_type, 2] / measured[comm_type, 1] == pytest.approx(0.5, rel=0.1)
    for cp in (2, 4):  # a2a's copy of the attention output and its index vectors, to the byte
        extra = measured["a2a", cp] - measured["p2p", cp]
        assert extra == pytest.approx(formula["a2a", cp] - formula["p2p", cp], rel=0.01), cp


def test_hierarchical_context_parallel_keeps_what_the_formula_says_to_the_byte():
    """a2a+p2p at cp 4: the ring's bytes, and at an all-to-all of 2 or 4 ranks also the ring's output
    beside the all-to-all's copy and the gathered tokens' index vectors, over p2p's."""
    from megalite.models.memory import layer_activation_bytes

    s, b, h, a = 256, 2, 128, 4
    config = _script().build_layer(s, h, a, "none", torch.device("cpu"), torch.bfloat16, attention_backend="sdpa",
                                   attention_dropout=0.0)[1]
    p2p = run_ranks(_context_parallel_layer_bytes, 4, args=(s, b, h, a, "p2p"))[0]
    for a2a_size in (1, 2, 4):
        ranks = run_ranks(_context_parallel_layer_bytes, 4, args=(s, b, h, a, "a2a+p2p", a2a_size))
        assert len(set(ranks)) == 1, ranks
        hierarchical = dataclasses.replace(config, cp_comm_type="a2a+p2p", cp_a2a_size=a2a_size)
        extra = layer_activation_bytes(hierarchical, s, b, cp=4) - layer_activation_bytes(config, s, b, cp=4,
                                                                                          cp_comm_type="p2p")
        assert ranks[0] - p2p == pytest.approx(extra, abs=8), (a2a_size, ranks[0] - p2p, extra)


def test_context_parallel_formula_terms():
    from megalite.models.memory import context_parallel_attention_bytes

    s, b, h, a, t = 8192, 1, 4096, 32, 2
    assert context_parallel_attention_bytes(s, b, h, a, t, cp=1) == 0
    assert context_parallel_attention_bytes(s, b, h, a, t, cp=4) == (s / 4) * b * h * (4 * a / h) / t
    assert context_parallel_attention_bytes(s, b, h, a, t, cp=4, comm_type="a2a") == (s / 4) * b * h * (2 + 4 * a / h) / t + 16 * s


class _KernelShapedRMSNorm(torch.autograd.Function):
    """What megalite's fused RMSNorm keeps for backward (megalite.ops.functions._norm_save: its
    contiguous input, the weight, fp32 mean and rstd per row), computed by the PyTorch formula: on a
    CPU `ops.rms_norm` falls back to that formula, which keeps fp32 copies instead (several times
    more); the planner counts the kernel's."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        from megalite.ops import reference

        x = x.contiguous()
        rows = x.shape[:-1]
        ctx.eps = eps
        ctx.save_for_backward(x, weight, torch.zeros(rows), torch.zeros(rows))
        return reference.rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        from megalite.ops import reference

        x, weight, _, _ = ctx.saved_tensors
        with torch.enable_grad():
            x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
            dx, dw = torch.autograd.grad(reference.rms_norm(x, weight, ctx.eps), (x, weight), dy)
        return dx, dw, None


MLA = dict(multi_latent_attention=True, position_embedding_type="rope", kv_lora_rank=64, qk_head_dim=32,
           qk_pos_emb_head_dim=16, v_head_dim=32, add_bias_linear=False, attention_backend="sdpa",
           attention_dropout=0.0)


def _mla_layer_bytes(rank, world, s, b, h, a, recompute, arch):
    """Bytes one TP rank's layer keeps for backward (saved-tensor hooks), latent norms as the kernel keeps them."""
    from unittest import mock

    from megalite import ops, parallel
    from megalite.models.memory import layer_activation_bytes

    if world > 1:
        parallel.initialize_model_parallel(world)
    script, cpu = _script(), torch.device("cpu")
    local = s // world if arch.get("sequence_parallel") else s
    with mock.patch.object(ops, "rms_norm", _KernelShapedRMSNorm.apply):
        measured = script.measure(local, b, h, a, recompute, cpu, **arch, max_position_embeddings=s)
    config = script.build_layer(s, h, a, recompute, cpu, torch.bfloat16, **arch)[1]
    return measured, layer_activation_bytes(config, s, b, t=world)


@pytest.mark.parametrize("q_lora_rank", [None, 48], ids=["plain-q", "q-lora"])
def test_measured_mla_layer_activations_follow_the_mla_formula_on_cpu(q_lora_rank):
    """Multi-head latent attention under selective recomputation (CPU SDPA takes its math path, which
    stores the s^2 core, when the values are narrower than the keys; recomputation leaves it out as
    fused attention does): what autograd keeps against `layer_activation_bytes`, as a whole and as
    the difference from a GPT-2 layer of the same size (the terms MLA changes)."""
    s, b, h, a = 256, 2, 256, 8
    arch = dict(MLA, q_lora_rank=q_lora_rank)
    measured, formula = _mla_layer_bytes(0, 1, s, b, h, a, "selective", arch)
    script, cpu, sbh = _script(), torch.device("cpu"), s * b * h
    gpt_measured = script.measure(s, b, h, a, "selective", cpu)
    gpt = script.build_layer(s, h, a, "selective", cpu, torch.bfloat16)[1]
    from megalite.models.memory import layer_activation_bytes

    assert 0.9 <= measured / formula <= 1.25, (measured / sbh, formula / sbh)
    change_measured = (measured - gpt_measured) / sbh
    change_formula = (formula - layer_activation_bytes(gpt, s, b)) / sbh
    assert change_measured == pytest.approx(change_formula, abs=0.2), (change_measured, change_formula)


def test_measured_mla_layer_activations_at_tp_2_with_sequence_parallelism():
    """At TP 2 with sequence parallelism each rank keeps half the heads' tensors and half the norms'
    and MLP's, but the gathered attention and MLP inputs and the latents whole. Without dropout (the
    formula's two 1-byte masks left out: a CPU keeps them in the activation dtype, and megalite's
    sequence-parallel dropout a whole-sequence mask) the formula holds to 0.1 of s*b*h bytes."""
    s, b, h, a = 256, 2, 256, 8
    arch = dict(MLA, q_lora_rank=48, sequence_parallel=True, hidden_dropout=0.0)
    ranks = run_ranks(_mla_layer_bytes, 2, args=(s, b, h, a, "selective", arch))
    (measured, formula), sbh = ranks[0], s * b * h
    assert ranks[1][0] == measured
    assert (measured - (formula - 2 * sbh / 2)) / sbh == pytest.approx(0, abs=0.1), (measured / sbh, formula / sbh)
    one, one_formula = _mla_layer_bytes(0, 1, s, b, h, a, "selective", dict(arch, sequence_parallel=False))
    assert (one - (one_formula - 2 * sbh)) / sbh == pytest.approx(0, abs=0.1), (one / sbh, one_formula / sbh)


def _mla_context_parallel_bytes(rank, world, s, b, h, a, comm_type):
    from unittest import mock

    from megalite import ops, parallel
    from megalite.models.memory import layer_activation_bytes

    parallel.initialize_model_parallel(1, context_parallel_size=world)
    script, cpu = _script(), torch.device("cpu")
    arch = dict(MLA, q_lora_rank=48, hidden_dropout=0.0, cp_comm_type=comm_type)
    with mock.patch.object(ops, "rms_norm", _KernelShapedRMSNorm.apply):
        measured = script.measure(s // world, b, h, a, "none", cpu, **arch, max_position_embeddings=s)
    config = script.build_layer(s, h, a, "none", cpu, torch.bfloat16, **arch)[1]
    return measured, layer_activation_bytes(config, s, b, cp=world)


@pytest.mark.parametrize("comm_type", ["p2p", "a2a"])
def test_measured_mla_layer_activations_at_cp_2_pad_the_values(comm_type):
    """With context parallelism MLA pads the values to the key width: the padded copy replaces
    kv_up's output and the core's padded output is kept besides the copy proj reads. Without dropout
    (the formula's two 1-byte masks left out) the formula holds to 0.1 of (s/cp)*b*h bytes."""
    s, b, h, a = 256, 2, 256, 8
    ranks = run_ranks(_mla_context_parallel_bytes, 2, args=(s, b, h, a, comm_type))
    (measured, formula), local = ranks[0], s // 2 * b * h
    assert ranks[1][0] == measured
    assert (measured - (formula - 2 * local)) / local == pytest.approx(0, abs=0.1), (measured / local, formula / local)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_measured_fp32_residual_stream_bytes_follow_the_formula_on_cpu(recompute):
    """--fp32-residual-connection: the norms keep an fp32 stream (and full recomputation an fp32 input);
    the planner's bytes count the difference from the bf16 stream's. Without residual dropout: PyTorch's CPU
    dropout keeps its mask in the stream's dtype (so 4 bytes in fp32), where the formula counts CUDA's
    1-byte masks, which the fp32 stream leaves as they are."""
    from megalite.models.memory import layer_activation_bytes

    script, cpu, s, b, h, a = _script(), torch.device("cpu"), 256, 2, 256, 4
    arch = dict(attention_backend="sdpa", attention_dropout=0.0, hidden_dropout=0.0)
    plain = script.measure(s, b, h, a, recompute, cpu, **arch)
    wide = script.measure(s, b, h, a, recompute, cpu, **arch, fp32_residual_connection=True)
    _, config = script.build_layer(s, h, a, recompute, cpu, torch.bfloat16, **arch, fp32_residual_connection=True)
    _, base = script.build_layer(s, h, a, recompute, cpu, torch.bfloat16, **arch)
    sbh = s * b * h
    change_formula = (layer_activation_bytes(config, s, b) - layer_activation_bytes(base, s, b)) / sbh
    assert (wide - plain) / sbh == pytest.approx(change_formula, abs=0.2), ((wide - plain) / sbh, change_formula)
    assert change_formula == (2.0 if recompute == "full" else 4.0)
