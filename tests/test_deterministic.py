"""--deterministic-mode: Megatron-LM's environment checks (NCCL_ALGO, and cuBLAS's workspace),
PyTorch's deterministic algorithms switched on in the ranks, the same losses as without it at every
layout (with uninitialized memory filled with NaN: a read of memory never written would show), and
no operation reached that PyTorch refuses on CUDA in this mode (so a GPU run will not stop on one)."""
import os

import pytest
import torch

from megalite import determinism
from megalite.errors import UsageError
from megalite.testing import run_ranks
from training_ranks import parse

BASE = ["--train-iters", "2", "--global-batch-size", "8", "--micro-batch-size", "2", "--log-interval", "1"]
LAYOUTS = {
    "tp2 sp": ["--tp", "2", "--sequence-parallel"],
    "dp2 zero3": ["--zero-stage", "3"],
    "cp2": ["--cp", "2"],
    "moe ep2": ["--model", "moe-tiny", "--ep", "2"],
    "deepseek tp2 sp (MLA, MTP)": ["--model", "deepseek-tiny", "--tp", "2", "--sequence-parallel"],
    "pp2 zb-h1 delayed wgrad": ["--pp", "2", "--pipeline-schedule", "zb-h1", "--delay-wgrad-compute"],
    "fp8 tp2 sp": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--tp", "2", "--sequence-parallel"],
    "bert tp2": ["--tp", "2"],
}


def test_nccl_and_cublas_are_set_when_unset_and_kept_when_repeatable():
    env = {}
    assert determinism.prepare_environment(env, "nccl") == ["NCCL_ALGO=Ring", "CUBLAS_WORKSPACE_CONFIG=:4096:8"]
    assert env == {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    for algo in ("Ring", "^NVLS"):
        env = {"NCCL_ALGO": algo, "CUBLAS_WORKSPACE_CONFIG": ":16:8"}
        assert determinism.prepare_environment(env, "nccl") == []
        assert env == {"NCCL_ALGO": algo, "CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    env = {"NCCL_ALGO": "NVLS"}
    assert determinism.prepare_environment({}, "gloo") == [] and determinism.prepare_environment(env, "gloo") == []
    assert env == {"NCCL_ALGO": "NVLS"}  # gloo reads neither


@pytest.mark.parametrize("env, says", [
    ({"NCCL_ALGO": "NVLS"}, "NCCL_ALGO=NVLS may reduce in no fixed order"),
    ({"NCCL_ALGO": "Ring,Tree"}, "NCCL_ALGO=Ring,Tree may reduce in no fixed order"),
    # in Megatron-LM's list, but NCCL has no Tree or CollNet all-gather, reduce-scatter or broadcast
    ({"NCCL_ALGO": "Tree"}, "NCCL_ALGO=Tree leaves NCCL no algorithm"),
    ({"NCCL_ALGO": "CollnetDirect"}, "NCCL_ALGO=CollnetDirect leaves NCCL no algorithm"),
    ({"NCCL_ALGO": "CollnetChain"}, "NCCL_ALGO=CollnetChain leaves NCCL no algorithm"),
    ({"CUBLAS_WORKSPACE_CONFIG": ":0:0"}, "CUBLAS_WORKSPACE_CONFIG=:0:0 does not make cuBLAS repeatable")])
def test_a_variable_that_cannot_repeat_the_sums_is_refused_in_one_line(env, says):
    with pytest.raises(UsageError) as e:
        determinism.prepare_environment(dict(env), "nccl")
    message = str(e.value)
    assert "\n" not in message and message.startswith("--deterministic-mode: " + says), message
    assert "unset it" in message


def test_the_variables_are_set_before_the_process_group_starts(monkeypatch):
    """The order setup() keeps, replayed for a GPU rank on CPU: NCCL reads NCCL_ALGO when the
    process group starts its communicators, cuBLAS its workspace at its first handle."""
    from megalite.training import build

    seen = []

    class Started(Exception):
        pass

    def init_distributed(*args):
        seen.append(("init", {k: os.environ.get(k) for k in ("NCCL_ALGO", "CUBLAS_WORKSPACE_CONFIG")}))
        raise Started

    monkeypatch.delenv("NCCL_ALGO", raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(build, "select_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(build, "validate", lambda *a, **k: 1)
    monkeypatch.setattr(build, "set_tf32", lambda enabled: None)
    monkeypatch.setattr(build, "init_distributed", init_distributed)
    monkeypatch.setattr(build, "say", lambda *parts, **k: seen.append(("say", " ".join(parts))))
    with determinism.scoped(), pytest.raises(Started):
        build.setup(parse(["--deterministic-mode"]), 1)
    assert seen == [("say", "megalite: --deterministic-mode: set NCCL_ALGO=Ring, CUBLAS_WORKSPACE_CONFIG=:4096:8"),
                    ("init", {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})]
    # and the run's scope put everything back
    assert "NCCL_ALGO" not in os.environ and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic


def test_the_flag_is_megalites_own_and_free_on_resume():
    from megalite.training.resume_policy import FREE, POLICY

    assert parse(["--deterministic-mode"]).training.deterministic_mode
    assert not parse([]).training.deterministic_mode
    assert POLICY["deterministic_mode"] == FREE


def _bag_max():
    weight = torch.randn(5, 3, requires_grad=True)
    torch.nn.functional.embedding_bag(torch.tensor([0, 2, 4]), weight, torch.tensor([0, 2]), mode="max").sum().backward()


_REFUSED = {  # on CUDA in the mode: the audit's name, and a call that reaches it
    "cumsum": lambda: torch.randn(4).cumsum(0),
    "histc": lambda: torch.histc(torch.rand(10), bins=4),
    "bincount": lambda: torch.bincount(torch.tensor([0, 1, 1]), weights=torch.ones(3)),
    "median": lambda: torch.median(torch.rand(5), dim=0),
    "nanmedian": lambda: torch.nanmedian(torch.rand(5), dim=0),
    "kthvalue": lambda: torch.kthvalue(torch.rand(5), 2),
    "put": lambda: torch.zeros(3).put_(torch.tensor([0]), torch.ones(1)),
    "index_reduce": lambda: torch.zeros(3).index_reduce_(0, torch.tensor([0, 0]), torch.ones(2), "prod"),
    "scatter_reduce": lambda: torch.zeros(3).scatter_reduce(0, torch.tensor([0, 0]), torch.ones(2), "prod"),
    "scatter": lambda: torch.zeros(3).scatter_(0, torch.tensor([0, 0]), torch.ones(2), reduce="multiply"),
    "nll_loss2d_forward": lambda: torch.nn.functional.cross_entropy(torch.randn(2, 3, 4, 4),
                                                                    torch.zeros(2, 4, 4, dtype=torch.long)),
    "embedding_bag": _bag_max,
    "avg_pool3d_backward": lambda: torch.nn.functional.avg_pool3d(torch.randn(1, 1, 2, 2, 2, requires_grad=True),
                                                                  2).sum().backward(),
    "adaptive_avg_pool2d_backward": lambda: torch.nn.functional.adaptive_avg_pool2d(
        torch.randn(1, 1, 4, 4, requires_grad=True), 2).sum().backward(),
    "upsample_bilinear2d_backward": lambda: torch.nn.functional.interpolate(
        torch.randn(1, 1, 2, 2, requires_grad=True), scale_factor=2, mode="bilinear").sum().backward(),
    "upsample_bilinear2d_aa_backward": lambda: torch.nn.functional.interpolate(
        torch.randn(1, 1, 4, 4, requires_grad=True), size=2, mode="bilinear", antialias=True).sum().backward(),
    "reflection_pad1d_backward": lambda: torch.nn.functional.pad(torch.randn(1, 1, 4, requires_grad=True), (1, 1),
                                                                 mode="reflect").sum().backward(),
}
_RUN = {  # deterministic on CUDA (or made so by the mode): reached, never found
    "integer cumsum": lambda: torch.arange(5).cumsum(0),
    "bincount without weights": lambda: torch.bincount(torch.tensor([0, 1, 1])),
    "median without dim": lambda: torch.median(torch.rand(5)),
    "1-d cross-entropy": lambda: torch.nn.functional.cross_entropy(torch.randn(4, 3), torch.tensor([0, 1, 2, 0])),
    "2-d cross-entropy, no reduction": lambda: torch.nn.functional.cross_entropy(
        torch.randn(2, 3, 4, 4), torch.zeros(2, 4, 4, dtype=torch.long), reduction="none"),
    "index_add": lambda: torch.zeros(3).index_add_(0, torch.tensor([0, 0]), torch.ones(2)),
    "scatter_add": lambda: torch.zeros(3).scatter_add_(0, torch.tensor([1, 1]), torch.ones(2)),
    "index_put accumulate": lambda: torch.zeros(3).index_put_((torch.tensor([1, 1]),), torch.ones(2), accumulate=True),
    "scatter_reduce sum": lambda: torch.zeros(3).scatter_reduce(0, torch.tensor([0, 0]), torch.ones(2), "sum"),
    "scatter add": lambda: torch.zeros(3).scatter_(0, torch.tensor([0, 0]), torch.ones(2), reduce="add"),
    "embedding_bag sum": lambda: torch.nn.functional.embedding_bag(torch.tensor([0, 2]), torch.randn(5, 3),
                                                                   torch.tensor([0, 1])),
}


@pytest.mark.filterwarnings("ignore:index_reduce|The reduce argument")  # beta / deprecated, reached on purpose
@pytest.mark.parametrize("name", list(_REFUSED))
def test_the_audit_finds_each_operation_cuda_refuses_in_the_mode(name):
    with determinism.CudaDeterminismAudit() as audit:
        _REFUSED[name]()
    assert audit.found == {name: 1}, audit.found


@pytest.mark.parametrize("name", list(_RUN))
def test_the_audit_passes_what_cuda_runs_deterministically(name):
    with determinism.CudaDeterminismAudit() as audit:
        _RUN[name]()
    assert audit.found == {} and audit.operations, (audit.found, audit.operations)


def test_top_p_sampling_reaches_no_cumsum_in_the_mode_and_draws_alike():
    """The prefix sums of top-p as triangular matmuls in the mode (PyTorch refuses a float cumsum
    on CUDA there): the same sums to rounding, the same tokens."""
    from megalite.generation.sampling import Sampling, next_tokens

    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)) * 3
    sampling = Sampling(temperature=0.7, top_p=0.9, seed=5)
    plain = next_tokens(logits, sampling, sampling.generator("cpu"))
    with determinism.scoped():
        torch.use_deterministic_algorithms(True)
        probs = torch.softmax(logits, dim=-1)
        assert torch.allclose(determinism.prefix_sums(probs), probs.cumsum(-1), rtol=1e-5, atol=1e-6)
        with determinism.CudaDeterminismAudit() as audit:
            tokens = next_tokens(logits, sampling, sampling.generator("cpu"))
    assert audit.found == {} and "mm" in audit.operations or "bmm" in audit.operations, audit.operations
    assert torch.equal(tokens, plain)
    assert not torch.are_deterministic_algorithms_enabled()  # the scope ended it


def _runs(rank, world, cases):
    """Each case without, then with --deterministic-mode under the audit: losses, the flag run's
    findings, how many of its operations ran in the mode, and whether the mode outlived the run."""
    import pretrain_bert
    import pretrain_gpt

    from megalite.training import pretrain

    out = []
    for name, argv in cases:
        bert = name.startswith("bert")
        task = pretrain_bert.task() if bert else pretrain_gpt.task()
        model = ["--model", "bert-tiny"] if bert else []
        without = [r["loss"] for r in pretrain(parse(BASE + argv + model), task).records]  # (no audit: its cost)
        with determinism.CudaDeterminismAudit() as audit:
            flagged = [r["loss"] for r in pretrain(parse(BASE + argv + model + ["--deterministic-mode"]), task).records]
        out.append(((without, flagged), audit.found, (audit.under_the_mode, sum(audit.operations.values())),
                    torch.are_deterministic_algorithms_enabled() or torch.backends.cudnn.deterministic))
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_runs, 2, args=(list(LAYOUTS.items()),), timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("index, name", list(enumerate(LAYOUTS)))
def test_the_mode_trains_to_the_same_losses_and_reaches_no_operation_cuda_refuses(runs, index, name):
    for rank_runs in runs:
        (without, with_mode), found, (inside, total), outlived = rank_runs[index]
        assert without == with_mode and len(with_mode) == 2, (name, without, with_mode)  # bitwise, NaN-filled memory
        assert all(v == v for v in with_mode)
        assert found == {}, (name, found)
        assert inside == total > 0, name  # the mode on for the flag's run, all of it
        assert not outlived, name  # and off again after it


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
        env = {k: v for k, v in os.environ.items() if k not in ("NCCL_ALGO", "CUBLAS_WORKSPACE_CONFIG")}
        run = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), "--mock-data", *BASE, "--train-iters", "5",
                              "--model", "moe-tiny", "--bf16", "--deterministic-mode", "--metrics-file", str(metrics)],
                             capture_output=True, text=True, timeout=600, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "--deterministic-mode: set NCCL_ALGO=Ring, CUBLAS_WORKSPACE_CONFIG=:4096:8" in run.stdout
        losses.append(logged_losses(metrics))
    assert len(losses[0]) == 5 and losses[0] == losses[1], losses
