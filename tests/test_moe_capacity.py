"""Expert capacity: no expert takes more than its capacity, the drop policies keep the assignments
they say, the dropped fraction is a hand count, padding every expert to its capacity changes no
number (both dispatchers, EP 1 and 2), and a capacity-limited model trains at EP 2 to the one-device
losses."""
import pytest
import torch

from helpers import assert_rel_close, fresh_seed, rel_err
from megalite import parallel
from megalite.models.moe.capacity import drop_over_capacity, expert_capacity
from megalite.models.moe.dispatcher import make_dispatcher
from megalite.models.moe.experts import GroupedMLP
from megalite.parallel.layers import normal_init
from megalite.testing import run_ranks
from test_moe_dispatch import E, H, K, TOKENS, _config, _full_weights, reference_moe
from test_moe_training import BASE
from training_ranks import train_losses


def test_capacity_is_megatrons_per_rank_formula():
    assert expert_capacity(tokens=12, topk=2, num_experts=8, factor=1.0) == 3
    assert expert_capacity(tokens=12, topk=2, num_experts=8, factor=1.5) == 5  # ceil(4.5)


def test_each_policy_keeps_what_it_says_and_the_dropped_count_is_a_hand_count():
    # 6 tokens, top-1, 2 experts, capacity 2: expert 0 wanted by tokens 0, 1, 3, 4; expert 1 by 2, 5
    indices = torch.tensor([[0], [0], [1], [0], [0], [1]])
    weights = torch.tensor([[0.1], [0.9], [0.5], [0.3], [0.8], [0.4]])
    by_probs = drop_over_capacity(weights, indices, 2, 2, "probs")
    assert by_probs.view(-1).tolist() == [2, 0, 1, 2, 0, 1]  # tokens 1 and 4 (0.9, 0.8) kept
    by_position = drop_over_capacity(weights, indices, 2, 2, "position")
    assert by_position.view(-1).tolist() == [0, 0, 1, 2, 2, 1]  # tokens 0 and 1 kept
    assert int((by_probs == 2).sum()) == 2 == int((by_position == 2).sum())  # 2 of 6 dropped


def test_no_expert_ever_takes_more_than_its_capacity():
    gen = torch.Generator().manual_seed(fresh_seed())
    for _ in range(20):
        t, k, e = 50, 2, 8
        indices = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        indices[:30, 0] = 3  # a hot expert
        weights = torch.rand(t, k, generator=gen)
        cap = expert_capacity(t, k, e, 1.0)
        for policy in ("probs", "position"):
            kept = drop_over_capacity(weights, indices, e, cap, policy)
            per_expert = torch.bincount(kept.view(-1), minlength=e + 1)[:e]
            assert int(per_expert.max()) <= cap
            # nothing under capacity is dropped: an expert drops only when it is full
            wanted = torch.bincount(indices.view(-1), minlength=e)
            assert torch.equal(per_expert, wanted.clamp(max=cap))


def _padded_equals_unpadded(rank, world, seed, ep):
    if world > 1:
        parallel.initialize_model_parallel(expert_model_parallel_size=ep)
    try:
        fc1, fc2 = _full_weights(seed, True)
        gen = torch.Generator().manual_seed(seed)
        experts = GroupedMLP(_config(True), normal_init(0.02, gen), normal_init(0.02, gen))
        x_all = torch.randn(world * TOKENS, H, generator=torch.Generator().manual_seed(seed + 1))
        w_all = torch.rand(world * TOKENS, K, generator=torch.Generator().manual_seed(seed + 2)) + 0.1
        i_all = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(world * TOKENS)])
        i_all[:, 0] = torch.where(torch.arange(world * TOKENS) % 2 == 0, 1, i_all[:, 0])  # expert 1 is hot
        mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
        cap = expert_capacity(TOKENS, K, E, 1.0)
        routed = drop_over_capacity(w_all[mine], i_all[mine], E, cap, "probs")
        assert (routed == E).any(), "the case must drop something"
        # one device, with every rank's drops
        all_routed = torch.cat([drop_over_capacity(w_all[r * TOKENS:(r + 1) * TOKENS], i_all[r * TOKENS:(r + 1) * TOKENS],
                                                   E, cap, "probs") for r in range(world)])
        ref = reference_moe(x_all, w_all * (all_routed < E), all_routed.clamp(max=E - 1), fc1, fc2, True)
        for kind in ("alltoall", "allgather"):
            d = make_dispatcher(kind, E)
            plain = d(x_all[mine], w_all[mine], routed, experts)
            padded = d(x_all[mine], w_all[mine], routed, experts, pad_to=cap)
            assert_rel_close(padded, plain, tol=1e-6, what=f"{kind} padded against unpadded")
            assert_rel_close(plain, ref[mine], what=f"{kind} with drops against the loop over experts")
    finally:
        if world > 1:
            parallel.destroy_model_parallel()


def test_padding_to_capacity_changes_no_number_at_ep_1():
    _padded_equals_unpadded(0, 1, fresh_seed(), 1)


def test_padding_to_capacity_changes_no_number_at_ep_2():
    run_ranks(_padded_equals_unpadded, 2, args=(fresh_seed(), 2))


@pytest.mark.slow
def test_a_capacity_limited_model_trains_at_ep2_to_the_one_device_losses():
    argv = BASE + ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]
    one = run_ranks(train_losses, 1, args=(argv,))[0]
    ep2 = run_ranks(train_losses, 2, args=(argv + ["--ep", "2"],))[0]
    assert rel_err(torch.tensor(ep2), torch.tensor(one)) <= 1e-5, (ep2, one)
