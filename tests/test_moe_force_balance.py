"""--moe-router-force-load-balancing: tokens a trained router would send to two experts spread over
all of them; the logits standard normal, a function of each token's signs alone (a slice of the
tokens gets its rows of the whole's logits); the gradient straight through to the router's weight;
and training with the flag gives the one-device losses at EP 2, TP 2 (SP) and PP 2 x EP 2, different
from routing by the router's scores."""
import torch

from helpers import rel_err
from megalite.models.config import TransformerConfig
from megalite.models.moe.balanced import hashed_logits
from megalite.models.moe.router import TopKRouter, route
from megalite.testing import run_ranks
from training_ranks import one_device_each, several, train_losses

from test_moe_training import BASE, THREE


def _router(force: bool) -> TopKRouter:
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=8,
                               moe_router_topk=2, moe_router_force_load_balancing=force)
    router = TopKRouter(config)
    with torch.no_grad():  # experts 0 and 1 point along the tokens' common direction
        router.weight.zero_()
        router.weight[0, 0], router.weight[1, 0] = 5.0, 4.0
    return router


def _tokens(n: int = 4096) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    tokens = 1e-3 * torch.randn(n, 16, generator=g)
    tokens[:, 0] += 1.0
    return tokens


def test_forced_balancing_spreads_tokens_the_router_sends_to_two_experts_over_all_eight():
    tokens = _tokens()
    _, own, _, _ = _router(False)(tokens)
    assert set(own.unique().tolist()) == {0, 1}  # the router's own choice: two experts for every token
    _, indices, _, logits = _router(True)(tokens)
    counts = torch.bincount(indices.reshape(-1), minlength=8).float()
    even = tokens.shape[0] * 2 / 8  # 1,024 assignments an expert
    sigma = (tokens.shape[0] * 2 * (1 / 8) * (7 / 8)) ** 0.5  # binomial spread: about 30
    assert (counts - even).abs().max() < 5 * sigma, counts
    assert abs(logits.mean().item()) < 0.05 and abs(logits.std().item() - 1.0) < 0.05
    assert indices.unique(dim=1).shape == indices.shape  # two different experts per token


def test_a_tokens_logits_depend_on_its_own_signs_only():
    tokens = _tokens(64)
    whole = hashed_logits(tokens, 8)
    assert torch.equal(hashed_logits(tokens[10:20], 8), whole[10:20])  # any split of the tokens: the same rows
    assert torch.equal(hashed_logits(tokens.to(torch.bfloat16), 8), whole)  # rounding keeps the signs
    assert torch.equal(hashed_logits(tokens * (1 + 1e-6), 8), whole)  # a sum in another order: the same
    flipped = tokens.clone()
    flipped[5, 3] = -flipped[5, 3]  # one sign of one token
    changed = (hashed_logits(flipped, 8) != whole).any(-1)
    assert changed.tolist() == [i == 5 for i in range(64)]


def test_a_router_with_nan_weights_still_gives_nan_logits_for_the_nonfinite_check():
    router = _router(True)
    with torch.no_grad():
        router.weight[3, 2] = float("nan")
    assert torch.isnan(router(_tokens(8))[3]).all()  # NaN times any token is NaN: every row


def test_the_gradient_goes_straight_through_to_the_routers_weight():
    tokens = _tokens(32)
    router = _router(True)
    weights, indices, scores, logits = router(tokens)
    target = torch.randn_like(scores)
    (weights.sum() + (scores * target).sum()).backward()
    # by hand: the same loss on the hashed logits as a leaf, its gradient times the tokens
    leaf = hashed_logits(tokens, 8).requires_grad_()
    w, i, s = route(leaf, router.config)
    assert torch.equal(i, indices)
    (w.sum() + (s * target).sum()).backward()
    torch.testing.assert_close(router.weight.grad, leaf.grad.t() @ tokens, rtol=1e-6, atol=1e-7)


def test_training_with_forced_balancing_gives_the_one_device_losses_at_ep2_tp2_and_pp2_ep2():
    forced = BASE + THREE + ["--moe-router-force-load-balancing"]
    one, unforced = one_device_each(train_losses, [forced, BASE + THREE])  # one spawn
    assert rel_err(torch.tensor(one), torch.tensor(unforced)) > 1e-4, (one, unforced)  # the flag routes otherwise
    layouts = [["--ep", "2"], ["--tp", "2", "--sequence-parallel"]]
    at_two = run_ranks(several, 2, args=(train_losses, [forced + layout for layout in layouts]))[0]
    at_four = run_ranks(train_losses, 4, args=(forced + ["--pp", "2", "--ep", "2"],))[-1]  # the last stage logs
    for layout, losses in zip([*layouts, ["--pp", "2", "--ep", "2"]], [*at_two, at_four]):
        assert rel_err(torch.tensor(losses), torch.tensor(one)) <= 1e-5, (layout, losses, one)
