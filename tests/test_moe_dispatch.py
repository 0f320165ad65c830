"""The MoE layer's experts and both token dispatchers equal a one-device loop over experts (fp32,
<= 1e-5 relative: outputs, input and routing-weight gradients, every expert's weight gradients),
at EP 1, 2, 4, 8 and with expert tensor parallelism, for uniform routing, skewed routing where
some experts get no tokens, and every token to one expert; all-gather equals all-to-all."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers import assert_rel_close, fresh_seed
from megalite import parallel
from megalite.models.config import TransformerConfig
from megalite.models.moe.dispatcher import make_dispatcher
from megalite.models.moe.experts import GroupedMLP, grouped_linear
from megalite.parallel import traffic
from megalite.parallel.layers import normal_init
from megalite.parallel.state import expert_grid
from megalite.testing import run_ranks

E, K, H, FFN, TOKENS = 8, 2, 8, 12, 6  # experts, top-k, hidden, expert width, tokens per rank


def _config(gated=True, dispatcher="alltoall"):
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=FFN,
                             num_moe_experts=E, moe_router_topk=K, gated_linear_unit=gated,
                             activation="silu" if gated else "gelu", moe_token_dispatcher_type=dispatcher,
                             add_bias_linear=False)  # (experts with biases run at ETP 1: test_moe_biases.py)


def _full_weights(seed, gated):
    gen = torch.Generator().manual_seed(seed)
    fc1 = torch.zeros(E, (2 if gated else 1) * FFN, H).normal_(0, 0.02, generator=gen)
    fc2 = torch.zeros(E, H, FFN).normal_(0, 0.02, generator=gen)
    return fc1, fc2


def _routing(pattern, tokens, seed):
    gen = torch.Generator().manual_seed(seed + 7)
    if pattern == "uniform":
        indices = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
    elif pattern == "skewed":  # experts 0-2 only: 3-7 get nothing
        indices = torch.stack([torch.randperm(3, generator=gen)[:K] for _ in range(tokens)])
    else:  # every token to expert 5 first
        indices = torch.stack([torch.tensor([5, int(torch.randint(0, 5, (1,), generator=gen))]) for _ in range(tokens)])
    weights = torch.rand(tokens, K, generator=gen) + 0.1
    return weights, indices


def reference_moe(x, weights, indices, fc1, fc2, gated):
    """What transformers' eager MoE does: a loop over experts, each token's outputs weighted and added."""
    out = torch.zeros_like(x)
    for e in range(E):
        token, slot = (indices == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        h = x[token] @ fc1[e].t()
        if gated:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        out = out.index_add(0, token, (h @ fc2[e].t()) * weights[token, slot].unsqueeze(-1))
    return out


def _one_case(world, rank, ep, etp, dispatcher, pattern, gated, seed):
    """One case, in the expert layout already initialized (ep, etp name it)."""
    fc1, fc2 = _full_weights(seed, gated)
    gen = torch.Generator().manual_seed(seed)
    init = normal_init(0.02, gen)
    experts = GroupedMLP(_config(gated), init, init)
    x_all = torch.randn(world * TOKENS, H, generator=torch.Generator().manual_seed(seed + 1))
    g_all = torch.randn(world * TOKENS, H, generator=torch.Generator().manual_seed(seed + 2))
    w_all, i_all = _routing(pattern, world * TOKENS, seed)
    # one device
    fc1r, fc2r = fc1.clone().requires_grad_(), fc2.clone().requires_grad_()
    xr, wr = x_all.clone().requires_grad_(), w_all.clone().requires_grad_()
    ref = reference_moe(xr, wr, i_all, fc1r, fc2r, gated)
    (ref * g_all).sum().backward()
    # this rank's tokens
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    x, w = x_all[mine].clone().requires_grad_(), w_all[mine].clone().requires_grad_()
    traffic.take()
    out = make_dispatcher(dispatcher, E)(x, w, i_all[mine], experts)
    sent = traffic.take().get("ep", 0)
    (out * g_all[mine]).sum().backward()
    assert_rel_close(out, ref[mine], what=f"{dispatcher} output")
    if dispatcher == "alltoall" and etp == 1:
        # Bytes: the rows that cross to another rank of this EP group, out and back. With ETP 1 a rank's
        # EP rank is rank % ep and its EP group the ranks with the same rank // ep.
        local, here = E // ep, rank % ep
        group = [r for r in range(world) if r // ep == rank // ep and r != rank]
        out_rows = int((i_all[mine] // local != here).sum())
        in_rows = sum(int((i_all[r * TOKENS:(r + 1) * TOKENS] // local == here).sum()) for r in group)
        assert sent == (out_rows + in_rows) * H * 4, (sent, out_rows, in_rows)
    assert_rel_close(x.grad, xr.grad[mine], what="token gradient")
    assert_rel_close(w.grad, wr.grad[mine], what="routing-weight gradient")
    # Expert gradients: summed over the copies of this shard (EDP), then this rank's part of the full.
    local = E // ep
    ep_rank, etp_rank = parallel.get_expert_model_parallel_rank(), parallel.get_expert_tensor_parallel_rank()
    experts_here = slice(ep_rank * local, (ep_rank + 1) * local)
    for p, full, dim, blocks in ((experts.fc1_weight, fc1r.grad, 1, 2 if gated else 1),
                                 (experts.fc2_weight, fc2r.grad, 2, 1)):
        grad = p.grad.clone()
        if dist.is_initialized():
            dist.all_reduce(grad, group=parallel.get_expert_data_parallel_group())
        want = torch.cat([b.chunk(etp, dim)[etp_rank] for b in full[experts_here].chunk(blocks, dim)], dim)
        assert_rel_close(grad, want, what=f"expert weight gradient (dim {dim})")
    return out.detach(), sent


LAYOUTS = ((2, 1), (4, 1), (8, 1), (2, 2), (4, 2))
CASES = [(d, pattern, gated) for d in ("alltoall", "allgather")
         for pattern, gated in (("uniform", True), ("skewed", True), ("one", False))]


def _matrix(rank, world, seed, layouts):
    sent = {}
    for ep, etp in layouts:  # one set of groups per layout, every case in it
        parallel.initialize_model_parallel(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        try:
            outs = {case: _one_case(world, rank, ep, etp, *case, seed) for case in CASES}
        finally:
            parallel.destroy_model_parallel()
        for _, pattern, gated in CASES:  # the two dispatchers give the same numbers
            a, b = outs["alltoall", pattern, gated][0], outs["allgather", pattern, gated][0]
            assert_rel_close(a, b, what="all-gather against all-to-all")
        sent.update({(ep, etp, *case): n for case, (_, n) in outs.items()})
    return sent


@pytest.mark.slow
def test_both_dispatchers_equal_one_device_at_every_expert_layout_and_routing():
    run_ranks(_matrix, 8, args=(fresh_seed(), LAYOUTS), timeout=600)


def test_both_dispatchers_at_ep_2_equal_one_device():
    run_ranks(_matrix, 2, args=(fresh_seed(), ((2, 1),)), timeout=120)


def test_grouped_experts_at_ep_1_equal_the_loop_over_experts():
    seed = fresh_seed()
    for gated, pattern in ((True, "uniform"), (True, "skewed"), (False, "one")):
        _one_case(1, 0, 1, 1, "alltoall", pattern, gated, seed)
        _one_case(1, 0, 1, 1, "allgather", pattern, gated, seed)


def test_grouped_linear_gives_a_zero_gradient_to_an_expert_without_tokens():
    x = torch.randn(5, 4, requires_grad=True)
    w = torch.randn(3, 6, 4, requires_grad=True)
    y = grouped_linear(x, w, [2, 0, 3])
    assert torch.equal(y[:2], x[:2] @ w[0].t()) and torch.equal(y[2:], x[2:] @ w[2].t())
    y.sum().backward()
    assert torch.equal(w.grad[1], torch.zeros(6, 4)) and w.grad[0].abs().sum() > 0


def test_expert_grid_folds_onto_the_dense_ranks_and_names_a_bad_size():
    assert expert_grid(2, 1, 4, 2, ep=4, etp=1) == {"expert_tensor": 1, "expert": 4, "expert_data": 2, "pipeline": 2}
    assert expert_grid(2, 2, 2, 1, ep=2) == {"expert_tensor": 2, "expert": 2, "expert_data": 2, "pipeline": 1}
    with pytest.raises(ValueError, match=r"expert-tensor x expert parallel sizes \(1 x 3 = 3\) do not divide .* 8"):
        expert_grid(2, 1, 4, 1, ep=3, etp=1)
