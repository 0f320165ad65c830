"""megalite.testing.run_ranks: every rank's result in rank order; a process group that failed to
initialize (gloo's connect flakes under load) spawns the ranks once more, a failure of the ranks'
own code never does."""
import pytest
import torch.distributed as dist

from megalite.testing import RankFailure, run_ranks


def _world(rank, world):
    return rank, dist.get_world_size()


def _fail_and_count(rank, world, log):
    with open(log, "a") as f:
        f.write(f"{rank}\n")
    if world > 1:  # every rank past its initialization before any fails: a rank that raised and exited
        # at once closed its sockets while its peer was still connecting, and the peer's initialization
        # failed instead of its code (seen once in a clean-clone CI run, 2026-12-04)
        dist.barrier()
    raise ValueError(f"boom on rank {rank}")


def test_a_failed_initialization_spawns_the_ranks_again(capfd):
    assert run_ranks(_world, 2, env={"MEGALITE_TEST_FAIL_INIT": "0,1"}) == [(0, 2), (1, 2)]
    assert "_world: the process group failed to initialize on 2 rank(s); spawning the ranks again" \
        in capfd.readouterr().err


def test_one_ranks_failed_initialization_spawns_every_rank_again(tmp_path, capfd):
    # rank 1's code fails too, but that spawn proved nothing: rank 0 never joined its process group
    log = tmp_path / "calls"
    with pytest.raises(RankFailure, match="boom on rank 1"):
        run_ranks(_fail_and_count, 2, args=(str(log),), env={"MEGALITE_TEST_FAIL_INIT": "0"})
    assert "failed to initialize on 1 rank(s); spawning the ranks again" in capfd.readouterr().err
    assert sorted(log.read_text().split()) == ["0", "1"]  # the second spawn (rank 0 could not start the first)


def test_a_failure_in_the_ranks_code_is_not_retried(tmp_path):
    # one rank: a process group of one connects to nobody, so gloo cannot flake here
    log = tmp_path / "calls"
    with pytest.raises(RankFailure, match="boom on rank 0"):
        run_ranks(_fail_and_count, 1, args=(str(log),))
    assert log.read_text().split() == ["0"]  # one spawn
