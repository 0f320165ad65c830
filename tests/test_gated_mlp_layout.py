"""The gated MLP's fc1 as [gate; up], each half split over TP (issue 30): at TP 1, 2 and 4 (with and
without sequence parallelism) its outputs and gradients equal those of the interleaved layout megalite
used before (rows gate_i, up_i, written out here as the reference); a seed builds the same function
as before; the shard helpers invert each other; a checkpoint written before the change (format
version 2, tp 2 x dp 2, ZeRO-1) resumes after it at TP 1, 2 and 4 to the losses of the run that wrote
it; and a version 2 local-SGD replica state of a gated model is refused in one line."""
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_rel_close, gather_tp, tp_slice
from megalite import checkpoint, parallel
from megalite.models import TransformerConfig
from megalite.models.mlp import GatedMLP, mlp_layer
from megalite.parallel.layers import normal_init, partition_blocks, tp_shard, tp_unshard
from megalite.runtime import UsageError
from megalite.testing import run_ranks
from training_ranks import train_losses

FIXTURES = Path(__file__).parent / "fixtures"
V2_CHECKPOINT = FIXTURES / "checkpoint_v2_swiglu"  # written at e7e9094, the last interleaved layout
HIDDEN, FFN, S, B = 32, 48, 8, 2


def _config(**kw) -> TransformerConfig:
    return TransformerConfig(**{**dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN,
                                       vocab_size=64, gated_linear_unit=True, activation="silu",
                                       add_bias_linear=True), **kw})


def interleaved_reference(x, w, b, w2, b2):
    """The gated MLP as megalite computed it before issue 30: fc1's rows alternate gate and up."""
    y = F.linear(x, w, b)
    return F.linear(F.silu(y[..., 0::2]) * y[..., 1::2], w2, b2)


def _layouts_agree(rank, world):
    gen = torch.Generator().manual_seed(7)
    w_old = torch.randn(2 * FFN, HIDDEN, generator=gen) * 0.2  # interleaved rows, as stored before
    b_old = torch.randn(2 * FFN, generator=gen) * 0.1
    w2, b2 = torch.randn(HIDDEN, FFN, generator=gen) * 0.2, torch.randn(HIDDEN, generator=gen) * 0.1
    x = torch.randn(S, B, HIDDEN, generator=gen)
    gy = torch.randn(S, B, HIDDEN, generator=gen)
    ref = [t.clone().requires_grad_() for t in (x, w_old, b_old, w2, b2)]
    want = interleaved_reference(*ref)
    (want * gy).sum().backward()
    halves = lambda t: torch.cat((t[0::2], t[1::2]))  # noqa: E731 - the layout change itself
    results = []
    for tp in (1, 2, 4):
        for sp in ((False, True) if tp > 1 else (False,)):
            parallel.initialize_model_parallel(tp)
            mlp = GatedMLP(_config(sequence_parallel=sp), normal_init(), normal_init(), device="cpu")
            assert partition_blocks(mlp.fc1.weight) == 2 and partition_blocks(mlp.fc1.bias) == 2
            assert partition_blocks(mlp.fc2.weight) == 1
            with torch.no_grad():
                mlp.fc1.weight.copy_(tp_shard(halves(w_old), 0, tp, parallel.get_tensor_model_parallel_rank(), 2))
                mlp.fc1.bias.copy_(tp_shard(halves(b_old), 0, tp, parallel.get_tensor_model_parallel_rank(), 2))
                mlp.fc2.weight.copy_(tp_slice(w2, 1))
                mlp.fc2.bias.copy_(b2)
            x_in = (tp_slice(x, 0) if sp else x).clone().requires_grad_()
            out = mlp(x_in)
            (out * (tp_slice(gy, 0) if sp else gy)).sum().backward()
            what = f"tp {tp}{' sp' if sp else ''}"
            assert_rel_close(gather_tp(out, 0) if sp else out, want.detach(), what=f"output {what}")
            x_grad = gather_tp(x_in.grad, 0) if sp else x_in.grad
            assert_rel_close(x_grad, ref[0].grad, what=f"input grad {what}")
            assert_rel_close(gather_tp(mlp.fc1.weight.grad, 0, 2), halves(ref[1].grad), what=f"fc1 weight grad {what}")
            assert_rel_close(gather_tp(mlp.fc1.bias.grad, 0, 2), halves(ref[2].grad), what=f"fc1 bias grad {what}")
            assert_rel_close(gather_tp(mlp.fc2.weight.grad, 1), ref[3].grad, what=f"fc2 weight grad {what}")
            fc2_bias_grad = mlp.fc2.bias.grad.clone()
            if sp:  # the bias saw this rank's sequence shard only
                torch.distributed.all_reduce(fc2_bias_grad, group=parallel.get_tensor_model_parallel_group())
            assert_rel_close(fc2_bias_grad, ref[4].grad, what=f"fc2 bias grad {what}")
            results.append(what)
            parallel.destroy_model_parallel()
    return results


@pytest.mark.slow
def test_halves_layout_equals_the_interleaved_one_at_tp_1_2_and_4():
    done = run_ranks(_layouts_agree, 4)
    assert done[0] == ["tp 1", "tp 2", "tp 2 sp", "tp 4", "tp 4 sp"]


def test_a_seed_builds_the_function_it_built_with_interleaved_rows():
    """The init draws the interleaved matrix as before and stacks its halves, so every seeded run
    computes the function it computed before (to the matmul's rounding)."""
    c = _config()
    draw = lambda: normal_init(0.2, torch.Generator().manual_seed(3))  # noqa: E731
    mlp = mlp_layer(c, draw(), normal_init(0.2), device="cpu")
    w_old = torch.zeros(2 * FFN, HIDDEN)
    draw()(w_old)
    assert torch.equal(mlp.fc1.weight, torch.cat((w_old[0::2], w_old[1::2])))
    x = torch.randn(S, B, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = interleaved_reference(x, w_old, torch.zeros(2 * FFN), mlp.fc2.weight, mlp.fc2.bias)
    assert_rel_close(mlp(x), want, what="seeded gated MLP")


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_tp_shard_and_unshard_invert_each_other(tp):
    full = torch.arange(2 * 12 * 3).view(24, 3)
    shards = [tp_shard(full, 0, tp, r, blocks=2) for r in range(tp)]
    gate, up = full.chunk(2)
    for r, s in enumerate(shards):
        assert torch.equal(s, torch.cat((gate.chunk(tp)[r], up.chunk(tp)[r])))
    assert torch.equal(tp_unshard(shards, 0, blocks=2), full)
    wide = torch.arange(24 * 12).view(24, 12)
    assert torch.equal(tp_unshard([tp_shard(wide, 1, tp, r) for r in range(tp)], 1), wide)


def test_column_parallel_blocks_refuse_gathered_output():
    with pytest.raises(ValueError, match="gather_output needs partition_blocks=1"):
        parallel.ColumnParallelLinear(4, 8, gather_output=True, partition_blocks=2, device="cpu")


def test_a_version_2_checkpoint_reads_fc1_as_halves():
    reader = checkpoint.CheckpointReader(V2_CHECKPOINT)
    assert reader.metadata["format_version"] == 2 and reader.config.gated_linear_unit
    # Assembled as stored (interleaved), then put in halves: the two must be the same rows.
    stored = reader._stored_full_tensor("layers.0.mlp.fc1.weight")
    assert torch.equal(reader.full_tensor("layers.0.mlp.fc1.weight"), torch.cat((stored[0::2], stored[1::2])))
    state = reader.full_optimizer_state("layers.1.mlp.fc1.bias")
    assert state["exp_avg"].shape == (2 * 48,)
    _, _, sd = checkpoint.load_full_state_dict(V2_CHECKPOINT)
    assert torch.equal(sd["layers.0.mlp.fc1.weight"], reader.full_tensor("layers.0.mlp.fc1.weight"))


def _v2_argv(**changes) -> list[str]:
    fixture = json.loads((FIXTURES / "checkpoint_v2_swiglu_losses.json").read_text())
    argv = list(fixture["argv"])
    for flag, value in changes.items():
        i = argv.index(flag)
        if value is None:
            del argv[i:i + 2]
        else:
            argv[i + 1] = value
    return argv, fixture["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("tp,zero", [(2, True), (1, False), (4, False)], ids=["tp2-dp2-zero1", "tp1", "tp4"])
def test_a_checkpoint_saved_before_the_change_resumes_after_it(tmp_path, tp, zero):
    """Saved at iteration 3 of a tp 2 x dp 2 ZeRO-1 run (rows interleaved); iterations 4-6 resumed at
    the same layout (its ZeRO shards read back) and resharded to TP 1 and 4 match the losses that run
    logged."""
    load = tmp_path / "ckpt"
    shutil.copytree(V2_CHECKPOINT, load)
    argv, losses = _v2_argv(**{"--save": None, "--save-interval": None, "--tp": str(tp)})
    if not zero:
        argv.remove("--use-distributed-optimizer")
    world = tp * 2 if zero else tp
    resumed = run_ranks(train_losses, world, args=(argv + ["--load", str(load)],))[0]
    assert len(resumed) == 3
    assert_rel_close(torch.tensor(resumed), torch.tensor(losses[3:]), what=f"resumed losses at tp {tp}")


def test_version_2_local_sgd_replica_state_of_a_gated_model_is_refused(tmp_path, monkeypatch):
    reader = checkpoint.CheckpointReader(V2_CHECKPOINT)
    f = reader.rank_file(0)
    monkeypatch.setitem(f.meta, "replica", {"value": None})
    with pytest.raises(UsageError, match="format version 2.*local SGD replica state of a gated MLP"):
        reader.replica(0)
