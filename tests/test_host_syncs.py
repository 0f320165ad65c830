"""Host synchronizations in a steady-state training iteration: on a GPU each one stalls the host
until the device catches up, so the iterations between log lines make none."""
from __future__ import annotations

from megalite.testing import run_ranks
from training_ranks import gpt_run


def syncs_per_iteration(rank, world, argv, first, last):
    from megalite import runtime
    from megalite.testing import count_host_syncs

    with count_host_syncs(label=lambda: runtime._PHASE[0]) as seen:
        gpt_run(argv)
    steady = [f"iteration {i}:" for i in range(first, last + 1)]
    return seen.during(lambda phase: phase.startswith(tuple(steady)))


def test_steady_state_iterations_make_no_host_sync_at_tp2_pp2_dp2_with_the_distributed_optimizer():
    argv = ["--tp", "2", "--pp", "2", "--use-distributed-optimizer", "--train-iters", "5", "--log-interval", "5",
            "--seq-length", "16", "--global-batch-size", "8", "--micro-batch-size", "1", "--eval-interval", "0"]
    per_rank = run_ranks(syncs_per_iteration, 8, args=(argv, 2, 4))
    for rank, calls in enumerate(per_rank):
        assert calls == [], f"rank {rank}: {calls[:10]}"


def test_fp16_dynamic_loss_scaling_costs_one_host_sync_a_step_and_bf16_none():
    argv = ["--pp", "2", "--train-iters", "4", "--log-interval", "4", "--seq-length", "16", "--global-batch-size", "4",
            "--micro-batch-size", "1", "--eval-interval", "0"]
    for calls in run_ranks(syncs_per_iteration, 2, args=(argv + ["--fp16"], 2, 3)):
        assert [what.split(" at ")[1].split(":")[0] for _, what in calls] == ["optimizer.py"] * 2, calls
    for calls in run_ranks(syncs_per_iteration, 2, args=(argv + ["--bf16"], 2, 3)):
        assert calls == []


def test_zero_stages_2_and_3_add_no_host_sync():
    # Gathers and reduce-scatters are waited on as work handles (a stream wait on a GPU), never read.
    argv = ["--tp", "2", "--train-iters", "4", "--log-interval", "4", "--seq-length", "16", "--global-batch-size", "4",
            "--micro-batch-size", "1", "--eval-interval", "0", "--bf16"]
    for stage in ("2", "3"):
        for rank, calls in enumerate(run_ranks(syncs_per_iteration, 4, args=(argv + ["--zero-stage", stage], 2, 3))):
            assert calls == [], f"stage {stage}, rank {rank}: {calls[:10]}"
