"""Each tensor-parallel layer equals its single-device counterpart (fp32, <= 1e-5 relative):
forward output, input gradient and weight gradients, for TP = 1, 2, 4, on fresh random inputs."""
import pytest
import torch
import torch.nn.functional as F

from helpers import assert_rel_close, fresh_seed, gather_tp, tp_slice
from megalite import parallel
from megalite.testing import run_ranks

S, B, IN, OUT, VOCAB = 8, 3, 16, 24, 64


def _full_weight(seed, shape):
    torch.manual_seed(seed)
    return torch.zeros(shape).normal_(0.0, 0.02)


def _column(seed, tp, gather_output, sequence_parallel):
    torch.manual_seed(seed)
    layer = parallel.ColumnParallelLinear(IN, OUT, gather_output=gather_output, sequence_parallel=sequence_parallel)
    w = _full_weight(seed, (OUT, IN)).requires_grad_()
    # The layer's weight is exactly this rank's block of the full initialization.
    assert torch.equal(layer.weight.detach(), tp_slice(w.detach(), 0))
    gen = torch.Generator().manual_seed(seed + 1)
    b = torch.randn(OUT, generator=gen).requires_grad_()
    with torch.no_grad():
        layer.bias.copy_(tp_slice(b, 0))
    x = torch.randn(S, B, IN, generator=gen).requires_grad_()
    gy = torch.randn(S, B, OUT, generator=gen)
    y_ref = F.linear(x, w, b)
    (y_ref * gy).sum().backward()

    x_in = tp_slice(x.detach(), 0).clone() if sequence_parallel else x.detach().clone()
    x_in.requires_grad_()
    y = layer(x_in)
    if gather_output:
        assert_rel_close(y, y_ref, what="column output")
        (y * gy).sum().backward()
    else:
        assert_rel_close(y, tp_slice(y_ref, -1), what="column output shard")
        (y * tp_slice(gy, -1)).sum().backward()
    x_grad_ref = tp_slice(x.grad, 0) if sequence_parallel else x.grad
    assert_rel_close(x_in.grad, x_grad_ref, what="column input grad")
    assert_rel_close(layer.weight.grad, tp_slice(w.grad, 0), what="column weight grad")
    assert_rel_close(layer.bias.grad, tp_slice(b.grad, 0), what="column bias grad")
    assert_rel_close(gather_tp(layer.weight.grad, 0), w.grad, what="gathered column weight grad")


def _row(seed, tp, input_is_parallel, sequence_parallel):
    torch.manual_seed(seed)
    layer = parallel.RowParallelLinear(IN, OUT, input_is_parallel=input_is_parallel,
                                       sequence_parallel=sequence_parallel)
    w = _full_weight(seed, (OUT, IN)).requires_grad_()
    assert torch.equal(layer.weight.detach(), tp_slice(w.detach(), 1))
    gen = torch.Generator().manual_seed(seed + 1)
    b = torch.randn(OUT, generator=gen).requires_grad_()
    with torch.no_grad():
        layer.bias.copy_(b)
    x = torch.randn(S, B, IN, generator=gen).requires_grad_()
    gy = torch.randn(S, B, OUT, generator=gen)
    y_ref = F.linear(x, w, b)
    (y_ref * gy).sum().backward()

    x_in = (tp_slice(x.detach(), -1) if input_is_parallel else x.detach()).clone().requires_grad_()
    y = layer(x_in)
    if sequence_parallel:
        assert_rel_close(y, tp_slice(y_ref, 0), what="row output sequence shard")
        (y * tp_slice(gy, 0)).sum().backward()
        # The bias saw only this rank's slice of the sequence: its gradient is partial.
        bias_grad = layer.bias.grad.clone()
        torch.distributed.all_reduce(bias_grad, group=parallel.get_tensor_model_parallel_group())
    else:
        assert_rel_close(y, y_ref, what="row output")
        (y * gy).sum().backward()
        bias_grad = layer.bias.grad
    assert getattr(layer.bias, "sequence_parallel", False) == sequence_parallel
    assert_rel_close(x_in.grad, tp_slice(x.grad, -1) if input_is_parallel else x.grad, what="row input grad")
    assert_rel_close(layer.weight.grad, tp_slice(w.grad, 1), what="row weight grad")
    assert_rel_close(bias_grad, b.grad, what="row bias grad")


def _embedding(seed, tp, sequence_parallel):
    real_vocab = VOCAB - 5  # the last rows are padding
    torch.manual_seed(seed)
    emb = parallel.VocabParallelEmbedding(VOCAB, IN, num_real_embeddings=real_vocab,
                                          sequence_parallel=sequence_parallel)
    torch.manual_seed(seed)
    w = torch.zeros(VOCAB, IN)
    w[:real_vocab].normal_(0.0, 0.02)
    assert torch.equal(emb.weight.detach(), tp_slice(w, 0)), "embedding init is not the full table's block"
    assert torch.count_nonzero(w[real_vocab:]) == 0
    w.requires_grad_()
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, real_vocab, (S, B), generator=gen)
    gy = torch.randn(S, B, IN, generator=gen)
    y_ref = F.embedding(ids, w)
    (y_ref * gy).sum().backward()
    y = emb(ids)
    if sequence_parallel:
        assert_rel_close(y, tp_slice(y_ref, 0), what="embedding output shard")
        (y * tp_slice(gy, 0)).sum().backward()
    else:
        assert_rel_close(y, y_ref, what="embedding output")
        (y * gy).sum().backward()
    assert_rel_close(emb.weight.grad, tp_slice(w.grad, 0), what="embedding weight grad")


def _cross_entropy(seed, tp):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(S, B, VOCAB, generator=gen) * 3).requires_grad_()
    target = torch.randint(0, VOCAB, (S, B), generator=gen)
    gl = torch.rand(S, B, generator=gen)
    loss_ref = F.cross_entropy(logits.view(-1, VOCAB), target.view(-1), reduction="none").view(S, B)
    (loss_ref * gl).sum().backward()
    shard = tp_slice(logits.detach(), -1).clone().requires_grad_()
    loss = parallel.vocab_parallel_cross_entropy(shard, target)
    assert_rel_close(loss, loss_ref, what="cross-entropy loss")
    (loss * gl).sum().backward()
    assert_rel_close(shard.grad, tp_slice(logits.grad, -1), what="cross-entropy logits grad")

    # Padding columns at -inf take no probability and get no gradient.
    padded = torch.cat([logits.detach(), torch.full((S, B, VOCAB), float("-inf"))], dim=-1)
    shard = tp_slice(padded, -1).clone().requires_grad_()
    loss = parallel.vocab_parallel_cross_entropy(shard, target)
    assert_rel_close(loss, loss_ref, what="cross-entropy loss with padded vocabulary")
    loss.sum().backward()
    assert torch.isfinite(shard.grad).all()


def check_layers(rank, world, seed):
    parallel.initialize_model_parallel(world)
    assert parallel.get_tensor_model_parallel_world_size() == world
    for gather_output in (False, True):
        _column(seed, world, gather_output, sequence_parallel=False)
    for input_is_parallel in (True, False):
        _row(seed, world, input_is_parallel, sequence_parallel=False)
    _embedding(seed, world, sequence_parallel=False)
    _cross_entropy(seed, world)
    if world > 1:
        _column(seed, world, gather_output=False, sequence_parallel=True)
        _row(seed, world, input_is_parallel=True, sequence_parallel=True)
        _embedding(seed, world, sequence_parallel=True)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parallel_layers_match_single_device(tp):
    run_ranks(check_layers, tp, args=(fresh_seed(),))


def test_layers_work_without_torch_distributed():
    """Researchers can use the layers in a plain single-process script."""
    torch.manual_seed(0)
    layer = parallel.ColumnParallelLinear(IN, OUT)
    assert layer(torch.randn(2, IN)).shape == (2, OUT)


def _column_of_10(rank, world):
    parallel.initialize_model_parallel(world)
    parallel.ColumnParallelLinear(IN, 10)


def test_sizes_not_divisible_by_tp_name_both_numbers():
    with pytest.raises(Exception, match=r"output_size \(10\) is not divisible by the tensor-parallel size \(4\)"):
        run_ranks(_column_of_10, 4)


def parameters_and_flags(rank, world):
    parallel.initialize_model_parallel(world)
    column = parallel.ColumnParallelLinear(IN, OUT)
    row = parallel.RowParallelLinear(IN, OUT, sequence_parallel=True)
    flags = ("tensor_model_parallel", "partition_dim", "sequence_parallel")
    try:
        parallel.RowParallelLinear(IN + 1, OUT)
        refused = None
    except ValueError as e:
        refused = str(e)
    return {
        name: (tuple(p.shape), {f: getattr(p, f) for f in flags if hasattr(p, f)})
        for layer, prefix in ((column, "column"), (row, "row"))
        for name, p in ((f"{prefix}.weight", layer.weight), (f"{prefix}.bias", layer.bias))
    } | {"sizes": (column.output_size_per_partition, row.input_size_per_partition), "refused": refused}


def test_column_and_row_parameters_are_shaped_and_flagged_for_their_split():
    for r in run_ranks(parameters_and_flags, 2):
        assert r["column.weight"] == ((OUT // 2, IN), {"tensor_model_parallel": True, "partition_dim": 0})
        assert r["column.bias"] == ((OUT // 2,), {"tensor_model_parallel": True, "partition_dim": 0})
        assert r["row.weight"] == ((OUT, IN // 2), {"tensor_model_parallel": True, "partition_dim": 1})
        assert r["row.bias"] == ((OUT,), {"sequence_parallel": True}), "whole, summed over sequence shards"
        assert r["sizes"] == (OUT // 2, IN // 2)
        assert r["refused"] == (f"input_size ({IN + 1}) is not divisible by the tensor-parallel size (2): "
                                "choose sizes so that it divides")


def test_conflicting_layer_options_are_refused_before_any_weight_is_drawn():
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match="^ColumnParallelLinear: gather_output and sequence_parallel cannot be combined$"):
        parallel.ColumnParallelLinear(IN, OUT, gather_output=True, sequence_parallel=True)
    with pytest.raises(ValueError, match="^RowParallelLinear: sequence_parallel needs input_is_parallel=True$"):
        parallel.RowParallelLinear(IN, OUT, input_is_parallel=False, sequence_parallel=True)
    assert torch.equal(torch.get_rng_state(), rng), "a refused layer leaves the RNG where it was"
    for layer in (parallel.ColumnParallelLinear(IN, OUT, bias=False), parallel.RowParallelLinear(IN, OUT, bias=False)):
        assert layer.bias is None and list(layer.state_dict()) == ["weight"]
