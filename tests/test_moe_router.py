"""The router's score functions against their formulas, group-limited top-k, the expert bias moving
selection only, the load-balancing and z-losses against a hand computation, and the MoE settings'
bad values ending in one line each."""
import pytest
import torch

from megalite.models.config import TransformerConfig, moe_layer_pattern
from megalite.models.moe import losses
from megalite.models.moe.router import route


def _config(**moe):
    return TransformerConfig(num_layers=4, hidden_size=8, num_attention_heads=2, num_moe_experts=8,
                             **{"moe_router_topk": 2, **moe})


def test_softmax_after_topk_is_softmax_over_the_topk_logits_and_equals_renormalised_pre_softmax():
    logits = torch.randn(10, 8, dtype=torch.float32)
    w, i, scores = route(logits, _config())
    top = logits.topk(2, dim=-1)
    assert torch.equal(i, top.indices)
    torch.testing.assert_close(w, torch.softmax(top.values, -1), rtol=0, atol=0)
    torch.testing.assert_close(w.sum(-1), torch.ones(10))
    wp, ip, _ = route(logits, _config(moe_router_pre_softmax=True))
    assert torch.equal(ip, i)  # softmax is monotonic: the same experts
    torch.testing.assert_close(wp, torch.softmax(logits, -1).gather(1, i))  # not renormalised
    torch.testing.assert_close(wp / wp.sum(-1, keepdim=True), w)  # renormalised: the same weights
    torch.testing.assert_close(scores, torch.softmax(logits, -1))


def test_sigmoid_routing_selects_with_the_bias_and_weights_without_it():
    logits = torch.randn(6, 8)
    bias = torch.zeros(8)
    bias[7] = 100.0  # every token picks expert 7
    w, i, _ = route(logits, _config(moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5), bias)
    assert (i == 7).any(-1).all()
    sig = torch.sigmoid(logits).gather(1, i)
    torch.testing.assert_close(w, 2.5 * sig / sig.sum(-1, keepdim=True))


def test_group_limited_topk_picks_experts_of_the_best_groups_only():
    # 4 groups of 2; a group's score: the sum of its top topk / group_topk scores
    logits = torch.tensor([[9.0, -9, 0, 0, 5, 5, 8.5, -9]])
    _, i, _ = route(logits, _config(moe_router_num_groups=4, moe_router_group_topk=1))
    # one group, scored by its top 2: (9, -9) = 0, (0, 0) = 0, (5, 5) = 10, (8.5, -9) = -0.5
    assert sorted(i[0].tolist()) == [4, 5]
    _, i, _ = route(logits, _config(moe_router_num_groups=4, moe_router_group_topk=2))
    assert sorted(i[0].tolist()) == [0, 6]  # two groups, scored by their best: 9 and 8.5
    _, i_free, _ = route(logits, _config())
    assert sorted(i_free[0].tolist()) == [0, 6]


def test_the_aux_loss_equals_the_switch_transformer_formula():
    torch.manual_seed(0)
    logits = torch.randn(12, 8, requires_grad=True)
    c = _config()
    w, i, scores = route(logits, c)
    loss = losses.load_balancing_loss("aux_loss", scores, i, 8, 2, sequences=3, coeff=0.1)
    f = torch.bincount(i.reshape(-1), minlength=8).float() / (12 * 2)  # fraction of assignments
    p = torch.softmax(logits, -1).mean(0)  # mean probability
    torch.testing.assert_close(loss, 0.1 * 8 * (f * p).sum())
    # per sequence (tokens are [s, b]: token t belongs to sequence t % 3)
    seq = losses.load_balancing_loss("seq_aux_loss", scores, i, 8, 2, sequences=3, coeff=0.1)
    want = 0
    for b in range(3):
        rows = torch.arange(b, 12, 3)
        fb = torch.bincount(i[rows].reshape(-1), minlength=8).float() / (4 * 2)
        want = want + 0.1 * 8 * (fb * torch.softmax(logits[rows], -1).mean(0)).sum() / 3
    torch.testing.assert_close(seq, want)
    z = losses.z_loss(logits, sequences=3, coeff=1e-3)
    torch.testing.assert_close(z, 1e-3 * torch.logsumexp(logits, -1).square().mean())


def test_a_micro_batch_weighs_its_share_of_the_global_batch():
    logits = torch.randn(8, 8)
    _, i, scores = route(logits, _config())
    whole = losses.load_balancing_loss("aux_loss", scores, i, 8, 2, sequences=2, coeff=1.0)
    losses.set_batch(global_sequences=8, micro_sequences=2)
    try:
        part = losses.load_balancing_loss("aux_loss", scores, i, 8, 2, sequences=2, coeff=1.0)
    finally:
        losses.set_batch(None, None)
    torch.testing.assert_close(part, whole / 4)


def test_attach_adds_the_loss_gradient_times_the_loss_scale():
    x = torch.randn(3, requires_grad=True)
    p = torch.randn(2, requires_grad=True)
    losses.set_batch(None, None, loss_scale=8.0)
    try:
        (losses.attach(x * 2, (p * p).sum()).sum()).backward()
    finally:
        losses.set_batch(None, None)
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    torch.testing.assert_close(p.grad, 8.0 * 2 * p.detach())


@pytest.mark.parametrize("moe, message", [
    (dict(moe_router_topk=9), r"--moe-router-topk \(9\) must be between 1 and the number of experts \(8\)"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=1, moe_router_topk=4),
     r"--moe-router-group-topk 1 groups of 2 experts cannot hold --moe-router-topk 4"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), r"--moe-router-num-groups \(3\) must divide"),
    (dict(moe_layer_freq=[0, 1, 1]), r"--moe-layer-freq lists 3 entries .* for 4 layers"),
    (dict(moe_layer_freq="([0]*1+[1]*2)"), r"lists 3 entries"),
    (dict(moe_layer_freq="[0,1]x"), r"is not an int, a list"),
    (dict(moe_router_enable_expert_bias=True), r"needs --moe-router-score-function sigmoid"),
    (dict(moe_pad_expert_input_to_capacity=True), r"needs --moe-expert-capacity-factor"),
])
def test_bad_moe_settings_end_in_one_line_naming_the_fix(moe, message):
    with pytest.raises(ValueError, match=message):
        _config(**moe)


def test_moe_layer_freq_spellings():
    assert moe_layer_pattern(1, 4) == [1, 1, 1, 1]
    assert moe_layer_pattern(2, 4) == [1, 0, 1, 0]
    assert moe_layer_pattern("([0]*1+[1]*3)", 4) == [0, 1, 1, 1]
    assert moe_layer_pattern("[0,1,1,1]", 4) == [0, 1, 1, 1]
    assert _config(moe_layer_freq="([0]*1+[1]*3)").is_moe_layer(0) is False


def test_flops_count_the_active_experts_only():
    from megalite.metrics import model_flops_per_iteration

    dense = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128)
    moe = dense.replace(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=64, moe_layer_freq=[0, 1])
    s, b = 32, 4
    extra = 3 * 2.0 * s * b * (64 * 8 + 2 * 64 * 64 * 2 - 64 * 128 * 2)  # layer 1: router + 2 experts - dense MLP
    assert model_flops_per_iteration(moe, b, s) == model_flops_per_iteration(dense, b, s) + extra
    # experts the router skips cost nothing: 64 experts of the same width, the same FLOPs but the router's
    many = moe.replace(num_moe_experts=64)
    assert model_flops_per_iteration(many, b, s) - model_flops_per_iteration(moe, b, s) == 3 * 2.0 * s * b * 64 * 56
