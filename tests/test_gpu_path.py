"""The GPU path, pinned on CPU: which device is current before CUDA is touched, pinned host batches,
TF32 and the matching MFU peak, unsynchronized timings never reported as measured, and bf16
dropout that does not shrink its branch."""
from __future__ import annotations

import pytest
import torch

from megalite import metrics, training
import megalite.training.build  # noqa: F401  (patched below)
from megalite.testing import run_ranks
from training_ranks import parse


class _Stop(Exception):
    pass


def test_the_rank_device_is_current_before_the_kernels_are_built(monkeypatch):
    calls = []
    monkeypatch.setenv("RANK", "6")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", str(d))))

    class Ready:
        reason = "test"

        def __bool__(self):
            return True

    def kernels_available():
        calls.append(("build kernels", None))
        return Ready()

    def init_distributed(timeout):
        calls.append(("init_distributed", None))
        raise _Stop

    from megalite import ops
    monkeypatch.setattr(ops, "kernels_available", kernels_available)
    monkeypatch.setattr(training.build, "init_distributed", init_distributed)
    args = parse(["--norm-backend", "fused", "--attention-backend", "fused"])
    with pytest.raises(_Stop):
        training.setup(args, 8)
    assert calls[0] == ("set_device", "cuda:2"), calls
    assert calls.index(("build kernels", None)) > 0 and calls[-1] == ("init_distributed", None)


def test_batches_reach_a_gpu_through_pinned_memory(monkeypatch):
    calls = []

    def pin_memory(self):
        calls.append("pin")
        return self

    def to(self, device, non_blocking=False):
        calls.append(("to", str(device), non_blocking))
        return self

    batch = {"tokens": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 4, dtype=torch.long)}
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    training.to_device(batch, torch.device("cuda", 1))
    assert calls == ["pin", ("to", "cuda:1", True)] * 2
    calls.clear()
    assert training.to_device(batch, torch.device("cpu")) is batch and calls == []


def test_tf32_is_on_for_fp32_runs_unless_turned_off():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        assert parse([]).precision.no_tf32 is False
        training.set_tf32(not parse([]).precision.no_tf32)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        training.set_tf32(not parse(["--no-tf32"]).precision.no_tf32)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("name,dtype,tf32,peak", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, True, 989.0),
    ("NVIDIA H100 PCIe", torch.bfloat16, True, 756.0),
    ("NVIDIA H100 NVL", torch.float16, True, 835.0),
    ("NVIDIA H100 80GB HBM3", torch.float32, True, 494.5),
    ("NVIDIA H100 80GB HBM3", torch.float32, False, 67.0),
    ("NVIDIA H200", torch.bfloat16, True, 989.0),
    ("NVIDIA A100-SXM4-80GB", torch.float32, True, 156.0),
    ("Tesla T4", torch.bfloat16, True, None),
])
def test_mfu_is_measured_against_the_peak_of_the_device_and_dtype_in_use(name, dtype, tf32, peak):
    assert metrics.peak_tflops_of(name, dtype, tf32) == peak


def test_an_unsynchronized_bubble_is_reported_as_unmeasured():
    record = {"iteration": 10, "train_iters": 10, "consumed_samples": 80, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0,
              "loss_scale": 1.0, "skipped": 0, "ms_per_iter": 1.0, "tokens_per_sec": 1.0, "tflops_per_gpu": 1.0,
              "bubble_theory": 0.2, "bubble_measured": None}
    assert "measured n/a" in metrics.format_log_line(record)
    assert "bubble 25.0% (theory 20.0%)" in metrics.format_log_line({**record, "bubble_measured": 0.25})


def sequence_parallel_dropout_of(rank, world, seed):
    from megalite import parallel
    from megalite.models.rng import hidden_dropout

    parallel.initialize_model_parallel(world)
    torch.manual_seed(seed)
    x = torch.rand(4096, 2, 64).add(1.0).bfloat16()  # values in [1, 2): every mantissa
    out = hidden_dropout(x, 0.1, training=True, sequence_parallel=True)
    kept = out != 0
    exact = (x.double() * kept / 0.9).sum()
    return (out.double().sum() / exact).item(), kept.double().mean().item()


def test_sequence_parallel_dropout_in_bf16_keeps_the_branch_scale():
    for ratio, kept in run_ranks(sequence_parallel_dropout_of, 2, args=(1234,)):
        assert abs(kept - 0.9) < 0.01
        # A bf16 scale (1/0.9 -> 1.109375) gave 1 - 1.6e-3; one rounding of the fp32 product is unbiased.
        assert abs(ratio - 1.0) < 2e-4, ratio


def test_full_weights_are_drawn_on_the_gpu_when_building_on_one():
    from megalite.parallel.layers import init_device

    assert init_device(torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert init_device("cpu") == torch.device("cpu") and init_device(None) == torch.device("cpu")
    assert init_device("meta") == torch.device("meta"), "a meta build (shapes only) draws nothing, never on a GPU"


def test_model_build_benchmark_extrapolates_a_stage(tmp_path):
    import json
    import runpy
    import sys

    from cli import ROOT

    out = tmp_path / "build.json"
    argv = sys.argv
    sys.argv = ["bench_model_build.py", "--model", "gpt-tiny", "--tp", "2", "--pp", "2", "--layers", "2",
                "--json", str(out)]
    try:
        runpy.run_path(str(ROOT / "scripts" / "bench_model_build.py"), run_name="__main__")
    finally:
        sys.argv = argv
    r = json.loads(out.read_text())
    assert r["stage_layers"] == 2 and r["layers_built"] == 2 and r["seconds_per_layer"] > 0
    assert r["first_stage_seconds"] == pytest.approx(2 * r["seconds_per_layer"] + r["embedding_seconds"])
    from megalite.parallel import state
    assert state.get_tensor_model_parallel_world_size.__name__ != "<lambda>", "the fake TP state is undone"


def compiled_layer_at_tp(rank, world, sequence_parallel, attention_backend):
    import torch._dynamo

    from megalite import parallel
    from megalite.models import preset
    from megalite.models.transformer import TransformerLayer, compile_layers

    parallel.initialize_model_parallel(world)
    parallel.model_parallel_manual_seed(1)
    config = preset("gpt-tiny", sequence_parallel=sequence_parallel, attention_backend=attention_backend)
    eager = TransformerLayer(config, 0, seed=3)
    compiled = TransformerLayer(config, 0, seed=3)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(compiled)(torch.randn(16 // (world if sequence_parallel else 1), 2,
                                                             config.hidden_size), None)

    class Holder(torch.nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.layers = torch.nn.ModuleList([layer])

    compile_layers(Holder(compiled), backend="aot_eager")
    torch.manual_seed(rank // world)  # the same input on every TP rank
    x = torch.randn(16 // (world if sequence_parallel else 1), 2, config.hidden_size, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    a, b = eager(x, None), compiled(y, None)
    a.square().sum().backward()
    b.square().sum().backward()
    grads = [(p.grad, q.grad) for p, q in zip(eager.parameters(), compiled.parameters())]
    close = all(torch.allclose(g, h, rtol=1e-5, atol=1e-6) for g, h in grads)
    return explained.graph_break_count, explained.graph_count, torch.allclose(a, b, rtol=1e-5, atol=1e-6), close


@pytest.mark.parametrize("sequence_parallel,attention_backend", [(False, "sdpa"), (True, "sdpa"), (False, "torch")],
                         ids=["tp2", "tp2-sp", "tp2-explicit-attention"])
def test_a_layer_compiles_without_graph_breaks_at_tp2(sequence_parallel, attention_backend):
    """The in-place TP all-reduce (mark_dirty) and the sequence-parallel gather / reduce-scatter
    trace into one graph per layer, and the compiled layer computes what the eager one does."""
    for breaks, graphs, same_out, same_grads in run_ranks(compiled_layer_at_tp, 2,
                                                        args=(sequence_parallel, attention_backend)):
        assert breaks == 0 and graphs == 1
        assert same_out and same_grads


def tp1_collectives_are_the_identity(rank, world):
    from megalite import parallel

    parallel.initialize_model_parallel(1)
    x = torch.randn(4, 2, 8, requires_grad=True)
    fns = [parallel.copy_to_tensor_model_parallel_region, parallel.reduce_from_tensor_model_parallel_region,
           parallel.scatter_to_tensor_model_parallel_region, parallel.gather_from_tensor_model_parallel_region,
           parallel.scatter_to_sequence_parallel_region, parallel.gather_from_sequence_parallel_region,
           parallel.reduce_scatter_to_sequence_parallel_region]
    return [fn(x) is x for fn in fns]


def test_tensor_parallel_collectives_add_no_autograd_node_at_tp1():
    """Each would be a launch (and a node in backward) on a GPU for nothing."""
    assert run_ranks(tp1_collectives_are_the_identity, 1)[0] == [True] * 7
