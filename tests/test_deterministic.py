"""--deterministic-mode: Megatron-LM's environment checks (NCCL_ALGO, and cuBLAS's workspace),
PyTorch's deterministic algorithms switched on in the ranks, the same losses as without it at every
layout (with uninitialized memory filled with NaN: a read of memory never written would show), and
no operation reached that PyTorch refuses on CUDA in this mode (so a GPU run will not stop on one)."""
import pytest
import torch

from megalite.errors import UsageError
from megalite.testing import run_ranks
from megalite.training import determinism
from training_ranks import parse

BASE = ["--train-iters", "3", "--global-batch-size", "8", "--micro-batch-size", "2", "--log-interval", "1"]
LAYOUTS = {
    "tp2 sp": ["--tp", "2", "--sequence-parallel"],
    "pp2 interleaved": ["--pp", "2", "--vpp", "2"],
    "dp2 zero3": ["--zero-stage", "3"],
    "cp2": ["--cp", "2"],
    "moe ep2": ["--model", "moe-tiny", "--ep", "2"],
    "deepseek tp2 sp (MLA, MTP)": ["--model", "deepseek-tiny", "--tp", "2", "--sequence-parallel"],
    "pp2 zb-h1 delayed wgrad": ["--pp", "2", "--pipeline-schedule", "zb-h1", "--delay-wgrad-compute"],
    "bf16 dp2 zero2": ["--bf16", "--zero-stage", "2"],
    "fp8 tp2 sp": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--tp", "2", "--sequence-parallel"],
    "bert tp2": ["--tp", "2"],
}


def test_nccl_and_cublas_are_set_when_unset_and_kept_when_repeatable():
    env = {}
    assert determinism.prepare_environment(env, "nccl") == ["NCCL_ALGO=^NVLS", "CUBLAS_WORKSPACE_CONFIG=:4096:8"]
    assert env == {"NCCL_ALGO": "^NVLS", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    for algo in determinism.NCCL_ALGOS:  # Megatron-LM's list
        env = {"NCCL_ALGO": algo, "CUBLAS_WORKSPACE_CONFIG": ":16:8"}
        assert determinism.prepare_environment(env, "nccl") == []
        assert env == {"NCCL_ALGO": algo, "CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    env = {"NCCL_ALGO": "NVLS"}
    assert determinism.prepare_environment({}, "gloo") == [] and determinism.prepare_environment(env, "gloo") == []
    assert env == {"NCCL_ALGO": "NVLS"}  # gloo reads neither


@pytest.mark.parametrize("env, named", [({"NCCL_ALGO": "NVLS"}, "NCCL_ALGO=NVLS"),
                                        ({"NCCL_ALGO": "Ring,Tree"}, "NCCL_ALGO=Ring,Tree"),
                                        ({"CUBLAS_WORKSPACE_CONFIG": ":0:0"}, "CUBLAS_WORKSPACE_CONFIG=:0:0")])
def test_a_variable_that_reduces_in_no_fixed_order_is_refused_in_one_line(env, named):
    with pytest.raises(UsageError) as e:
        determinism.prepare_environment(dict(env), "nccl")
    message = str(e.value)
    assert "\n" not in message and message.startswith("--deterministic-mode: " + named)
    assert "unset it" in message


def test_the_flag_is_megalites_own_and_free_on_resume():
    from megalite.training.resume_policy import FREE, POLICY

    assert parse(["--deterministic-mode"]).training.deterministic_mode
    assert not parse([]).training.deterministic_mode
    assert POLICY["deterministic_mode"] == FREE


def test_the_audit_finds_what_cuda_refuses_and_passes_what_it_runs_deterministically():
    x = torch.randn(8, 4, requires_grad=True)
    with determinism.CudaDeterminismAudit() as audit:
        x.cumsum(0).sum().backward()  # float cumsum: refused on CUDA
        torch.arange(5).cumsum(0)  # integer: exact in any order
        torch.histc(torch.rand(10), bins=4)
        torch.bincount(torch.tensor([0, 1, 1]))  # counts without weights: fine
        torch.bincount(torch.tensor([0, 1, 1]), weights=torch.ones(3))
        torch.zeros(3).index_add_(0, torch.tensor([0, 0]), torch.ones(2))  # deterministic path under the flag
        torch.zeros(3).scatter_add_(0, torch.tensor([1, 1]), torch.ones(2))
        torch.median(torch.rand(5), dim=0)  # with indices
        torch.median(torch.rand(5))  # without
        torch.nn.functional.cross_entropy(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))  # 1-d: fine
        torch.nn.functional.cross_entropy(torch.randn(2, 3, 4, 4), torch.zeros(2, 4, 4, dtype=torch.long))
    assert audit.found == {"cumsum": 2, "histc": 1, "bincount": 1, "median": 1, "nll_loss2d_forward": 1}, audit.found
    assert audit.operations["index_add"] == 1 and audit.operations["scatter_add"] == 1


def _runs(rank, world, cases):
    """Each case without, then with --deterministic-mode (under the audit): losses, the audit's
    findings and whether PyTorch's deterministic algorithms were on after it."""
    import pretrain_bert
    import pretrain_gpt

    from megalite.training import pretrain

    out = []
    try:
        for name, argv in cases:
            bert = name.startswith("bert")
            task = pretrain_bert.task() if bert else pretrain_gpt.task()
            losses = []
            for flag in ([], ["--deterministic-mode"]):
                args = parse(BASE + argv + flag + (["--model", "bert-tiny"] if bert else []))
                with determinism.CudaDeterminismAudit() as audit:
                    losses.append([r["loss"] for r in pretrain(args, task).records])
            out.append((losses, audit.found, torch.are_deterministic_algorithms_enabled(),
                        torch.utils.deterministic.fill_uninitialized_memory, torch.backends.cudnn.deterministic))
            torch.use_deterministic_algorithms(False)  # the next case's first run without it
    finally:
        torch.use_deterministic_algorithms(False)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_runs, 2, args=(list(LAYOUTS.items()),), timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("index, name", list(enumerate(LAYOUTS)))
def test_the_mode_trains_to_the_same_losses_and_reaches_no_operation_cuda_refuses(runs, index, name):
    for rank_runs in runs:
        (without, with_mode), found, enabled, fills, cudnn = rank_runs[index]
        assert without == with_mode, (name, without, with_mode)  # bitwise, NaN-filled memory included
        assert all(v == v for v in with_mode)
        assert found == {}, (name, found)
        assert enabled and fills and cudnn, name


@pytest.mark.gpu
def test_two_runs_on_a_gpu_give_bitwise_the_same_losses(tmp_path):
    """What the CPU tests above cannot show: a GPU's atomics and cuBLAS really held to one order."""
    import subprocess
    import sys

    from cli import ROOT, losses as logged_losses

    assert torch.cuda.is_available()
    losses = []
    for i in range(2):
        metrics = tmp_path / f"m{i}.jsonl"
        run = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), "--mock-data", *BASE, "--train-iters", "5",
                              "--model", "moe-tiny", "--bf16", "--deterministic-mode", "--metrics-file", str(metrics)],
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        losses.append(logged_losses(metrics))
    assert len(losses[0]) == 5 and losses[0] == losses[1], losses
