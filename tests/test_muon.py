"""--optimizer muon: Newton-Schulz against its formula in float64; the update (decoupled weight decay,
momentum, Nesterov, scale modes, the q/k/v split) by hand; the tensor-parallel modes on two ranks
against the whole matrix (blockwise: each shard alone); which parameters Muon takes; training at
tp 2 (duplicated and distributed), dp 2, pp 2, cp 2, ep 2 and etp 2 equal to one rank; the step skipped
on the device with no host sync; checkpoints across layouts and optimizers; Megatron-LM's flags and
the refusals."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import rel_err
from megalite.optim.muon import Matrix, Muon, Rows
from megalite.optim.newton_schulz import newton_schulz, scale_factor
from megalite.testing import run_ranks
from training_ranks import gpt_run, parse, refusal, steady_host_syncs, train_losses

# Keller Jordan's quintic coefficients (modded-nanogpt), written out again: the test's own copy.
COEFFICIENTS = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]


def reference_ns(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The iteration in float64, one matrix at a time."""
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm()
    for i in range(steps):
        a, b, c = COEFFICIENTS[i % 5]
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def reference_update(g: torch.Tensor, rows=None, units=1) -> torch.Tensor:
    """The scaled orthogonalized update of a matrix, split into q/k/v parts of `rows` widths."""
    if rows is None:
        return reference_ns(g) * max(g.shape) ** 0.5
    parts = g.view(units, sum(rows), -1).split(rows, dim=1)
    done = [reference_update(p.reshape(-1, g.shape[1])).view(units, -1, g.shape[1]) for p in parts]
    return torch.cat(done, dim=1).view(g.shape)


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (3, 7, 5)])
def test_newton_schulz_is_the_quintic_iteration(shape):
    torch.manual_seed(0)
    g = torch.randn(shape)
    for steps in (5, 10):
        got = newton_schulz(g, steps, "highest")
        want = torch.stack([reference_ns(m, steps) for m in g.view(-1, *shape[-2:])]).view(shape)
        assert rel_err(got, want) <= 1e-5, steps
    singular = torch.linalg.svdvals(newton_schulz(g, 5, "highest").double())
    assert singular.min() > 0.6 and singular.max() < 1.25  # near orthogonal, as the coefficients aim
    bf16 = newton_schulz(g, 5, "medium", emulate_bf16=False)  # in bf16 (Megatron-LM's default precision)
    assert bf16.dtype == torch.float32 and 0 < rel_err(bf16, newton_schulz(g, 5, "highest")) < 0.05
    # off a GPU, bf16 GEMMs emulated (fp32 GEMMs of bf16 values, results rounded): bf16's numbers to
    # a rounding here and there (the order of the sums), at fp32's speed
    emulated = newton_schulz(g, 5, "medium")
    assert rel_err(emulated, bf16) < 0.02 and 0 < rel_err(emulated, newton_schulz(g, 5, "highest"))
    with pytest.raises(ValueError, match="multiple of 5"):
        newton_schulz(g, 3)


@pytest.mark.gpu
def test_on_a_gpu_medium_runs_bf16_gemms_and_the_cpus_emulation_agrees():
    torch.manual_seed(6)
    g = torch.randn(256, 1024)
    gpu = newton_schulz(g.cuda(), 5, "medium").cpu()  # true bf16 GEMMs (the CPU path: the emulation test above)
    assert rel_err(gpu, newton_schulz(g, 5, "medium")) < 0.02 and 0 < rel_err(gpu, newton_schulz(g, 5, "highest"))


def test_permuted_rows_and_columns_give_the_permuted_result():
    torch.manual_seed(1)
    g = torch.randn(8, 12)
    rows, cols = torch.randperm(8), torch.randperm(12)
    got = newton_schulz(g[rows][:, cols], 5, "highest")
    assert rel_err(got, newton_schulz(g, 5, "highest")[rows][:, cols]) <= 1e-5


def test_scale_modes():
    assert scale_factor(8, 2, "spectral") == 8 ** 0.5 and scale_factor(2, 8, "spectral") == 8 ** 0.5
    assert scale_factor(8, 2, "shape_scaling") == 2.0 and scale_factor(2, 8, "shape_scaling") == 1.0
    assert scale_factor(2, 8, "unit_rms_norm") == 0.5


def _muon(params, matrices, **kw):
    options = dict(lr=0.1, momentum=0.9, nesterov=False, steps=5, precision="highest", scale_mode="spectral",
                   extra_scale=1.0, tp_mode="blockwise")
    options.update(kw)
    return Muon([{"params": params, "weight_decay": 0.05}], matrices, **options)


@pytest.mark.parametrize("nesterov", [False, True])
def test_two_steps_by_hand_weight_decay_momentum_nesterov_and_the_qkv_split(nesterov):
    torch.manual_seed(2)
    w, qkv = torch.randn(5, 7), torch.randn(2 * 4, 6)  # qkv: 2 groups of (q 2 rows, k 1, v 1)
    w0, qkv0 = w.clone(), qkv.clone()
    opt = _muon([w, qkv], [Matrix([w]), Matrix([qkv], Rows((2, 1, 1)))], nesterov=nesterov, extra_scale=0.5)
    momenta = [torch.zeros_like(w), torch.zeros_like(qkv)]
    for _ in range(2):
        grads = [torch.randn_like(w), torch.randn_like(qkv)]
        w.grad, qkv.grad = grads
        opt.step()
        for i, (ref, g, rows) in enumerate(((w0, grads[0], None), (qkv0, grads[1], (2, 1, 1)))):
            momenta[i] = 0.9 * momenta[i] + 0.1 * g
            u = 0.1 * g + 0.9 * momenta[i] if nesterov else momenta[i]
            ref.mul_(1 - 0.1 * 0.05).sub_(0.1 * 0.5 * reference_update(u, rows, units=2).float())
        assert rel_err(w, w0) <= 1e-5 and rel_err(qkv, qkv0) <= 1e-5
        assert rel_err(opt.state[w]["exp_avg"], momenta[0]) <= 1e-6
    assert int(opt.state[w]["step"]) == 2


def test_a_step_with_inf_is_skipped_on_the_device_and_the_clip_rides_in_grad_scale():
    torch.manual_seed(3)
    w = torch.randn(4, 6)
    opt = _muon([w], [Matrix([w])])
    w.grad = torch.randn(4, 6)
    opt.step()
    before, momentum = w.clone(), opt.state[w]["exp_avg"].clone()
    w.grad = torch.full((4, 6), float("nan"))
    opt.found_inf = torch.tensor(1.0)
    opt.step()
    assert torch.equal(w, before) and torch.equal(opt.state[w]["exp_avg"], momentum)
    assert int(opt.state[w]["step"]) == 1
    opt.found_inf, opt.grad_scale = torch.tensor(0.0), torch.tensor(4.0)
    g = torch.randn(4, 6)
    w.grad = g * 4
    opt.step()
    want = before * (1 - 0.1 * 0.05) - 0.1 * reference_update(0.9 * momentum + 0.1 * g).float()
    assert rel_err(w, want) <= 1e-5 and int(opt.state[w]["step"]) == 2


def test_a_loaded_state_keeps_the_lr_reaching_both_optimizers():
    from megalite.optim.muon import MuonAndAdamW

    w, b = torch.randn(4, 6), torch.randn(4)
    muon = _muon([w], [Matrix([w])])
    adam = torch.optim.AdamW([{"params": [b], "weight_decay": 0.0}], lr=0.1, fused=True)
    both = MuonAndAdamW(muon, adam)
    w.grad, b.grad = torch.randn(4, 6), torch.randn(4)
    both.step()
    both.load_state_dict(both.state_dict())
    for group in both.param_groups:
        group["lr"] = 0.5
    assert adam.param_groups[0]["lr"] == 0.5 and muon.group_of[id(w)]["lr"] == 0.5


def _tp_modes(rank, world):
    """Each mode's update of a rows- and a columns-sharded matrix on two ranks, from the whole gradients."""
    import torch.distributed as dist

    from megalite.parallel.layers import tp_shard

    torch.manual_seed(4)
    fc1, qkv, proj = torch.randn(16, 6), torch.randn(4 * 4, 6), torch.randn(6, 10)  # qkv: 4 units of (2, 1, 1)
    out = {}
    for mode in ("blockwise", "duplicated", "distributed"):
        shards = [tp_shard(fc1, 0, world, rank, 2).clone(), tp_shard(qkv, 0, world, rank).clone(),
                  tp_shard(proj, 1, world, rank).clone()]
        grads = [tp_shard(g, d, world, rank, b) for g, d, b in ((fc1, 0, 2), (qkv, 0, 1), (proj, 1, 1))]
        common = dict(group=dist.group.WORLD, size=world, rank=rank)
        matrices = [Matrix([shards[0]], dim=-2, blocks=2, **common), Matrix([shards[1]], Rows((2, 1, 1)), dim=-2,
                                                                            **common),
                    Matrix([shards[2]], dim=-1, **common)]
        opt = _muon(shards, matrices, tp_mode=mode, momentum=0.0)
        opt.param_groups[0]["weight_decay"] = 0.0
        zeros = [s.clone() for s in shards]
        for s, g in zip(shards, grads):
            s.grad = g.clone()
        opt.step()
        out[mode] = [(z - s) / 0.1 for z, s in zip(zeros, shards)]  # each shard's update
    return out


def test_tensor_parallel_modes_against_the_whole_matrices():
    from megalite.parallel.layers import tp_shard

    results = run_ranks(_tp_modes, 2)
    torch.manual_seed(4)
    fc1, qkv, proj = torch.randn(16, 6), torch.randn(4 * 4, 6), torch.randn(6, 10)
    whole = [reference_update(fc1), reference_update(qkv, (2, 1, 1), units=4), reference_update(proj)]
    for rank, out in enumerate(results):
        for mode in ("duplicated", "distributed"):  # one device's update, this rank's shard of it
            for got, want, dim, blocks in zip(out[mode], whole, (0, 0, 1), (2, 1, 1)):
                assert rel_err(got, tp_shard(want, dim, 2, rank, blocks).float()) <= 1e-5, mode
        shards = [tp_shard(fc1, 0, 2, rank, 2), tp_shard(qkv, 0, 2, rank), tp_shard(proj, 1, 2, rank)]
        blockwise = [reference_update(shards[0]), reference_update(shards[1], (2, 1, 1), units=2),
                     reference_update(shards[2])]
        for got, want in zip(out["blockwise"], blockwise):
            assert rel_err(got, want.float()) <= 1e-5
        assert rel_err(out["blockwise"][0], out["duplicated"][0]) > 1e-2  # a shard alone is another matrix


GQA = ["--model", "llama-tiny", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
       "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "16", "--global-batch-size", "4",
       "--micro-batch-size", "1", "--log-interval", "1", "--train-iters", "4", "--lr", "0.05",
       "--optimizer", "muon", "--muon-fp32-matmul-prec", "highest", "--muon-tp-mode", "duplicated"]
MOE = ["--model", "gpt-tiny", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
       "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--swiglu",
       "--disable-bias-linear", "--seq-length", "16", "--global-batch-size", "4", "--micro-batch-size", "1",
       "--log-interval", "1", "--train-iters", "3", "--lr", "0.01", "--optimizer", "muon",
       "--muon-fp32-matmul-prec", "highest", "--muon-tp-mode", "duplicated"]


def _muon_matrices(rank, world, argv):
    run = gpt_run(argv)
    inner = run.optimizer.inner
    names = {id(p): n for chunk in run.model_chunks for n, p in chunk.named_parameters()}
    masters = {id(piece.master): names[id(piece.param)] for piece in run.optimizer.pieces}
    matrices = [([masters[id(m)] for m in mx.masters], mx.rows and mx.rows.widths, mx.dim)
                for mx in inner.muon.matrices]
    adam = sorted(masters[id(m)] for g in inner.adam.param_groups for m in g["params"])
    moments = {masters[id(m)]: sorted(k for k in inner.state[m] if k != "step") for g in inner.param_groups
               for m in g["params"]}
    return matrices, adam, moments


def test_which_parameters_muon_takes_and_how_it_splits_them():
    (matrices, adam, moments), = run_ranks(_muon_matrices, 1, args=(GQA,))
    by_name = {tuple(names): (rows, dim) for names, rows, dim in matrices}
    assert by_name[("layers.0.attention.q.weight",)] == (None, None)
    assert by_name[("layers.0.attention.kv.weight",)] == ((16, 16), None)  # [groups, (k, v), head_dim]
    assert ("layers.1.mlp.fc2.weight",) in by_name and ("layers.0.attention.proj.weight",) in by_name
    assert all(n.endswith(("word_embeddings.weight", "output_layer.weight", "layernorm.weight")) for n in adam), adam
    assert any(n.endswith("word_embeddings.weight") for n in adam)
    assert moments["layers.0.mlp.fc1.weight"] == ["exp_avg"]
    assert moments["layers.0.input_layernorm.weight"] == ["exp_avg", "exp_avg_sq"]
    (joined, _, _), = run_ranks(_muon_matrices, 1, args=(GQA + ["--muon-no-split-qkv"],))
    assert ["layers.0.attention.q.weight", "layers.0.attention.kv.weight"] in [names for names, _, _ in joined]
    (experts, adam, _), = run_ranks(_muon_matrices, 1, args=(MOE,))
    names = [n for ns, _, _ in experts for n in ns]
    assert "layers.0.mlp.experts.fc1_weight" in names and "layers.0.mlp.router.weight" in names
    assert "layers.0.attention.qkv.weight" in names and (16, 16, 16) in [r for _, r, _ in experts]


@pytest.mark.slow
def test_training_at_tp2_dp2_pp2_cp2_ep2_etp2_gives_one_ranks_losses():
    [want] = run_ranks(train_losses, 1, args=(GQA,))
    for world, layout in ((2, ["--tp", "2", "--sequence-parallel"]),
                          (2, ["--tp", "2", "--muon-tp-mode", "distributed"]),
                          (2, []), (2, ["--pp", "2"]), (2, ["--cp", "2"])):
        got = run_ranks(train_losses, world, args=(GQA + layout,))[-1]
        assert rel_err(torch.tensor(got), torch.tensor(want)) <= 1e-5, (layout, got, want)
    # --tp above the query groups: each rank holds part of a key group (the split needs it gathered)
    got = run_ranks(train_losses, 4, args=(GQA + ["--tp", "4", "--muon-tp-mode", "distributed"],))[-1]
    assert rel_err(torch.tensor(got), torch.tensor(want)) <= 1e-5, got
    [joined] = run_ranks(train_losses, 1, args=(GQA + ["--muon-no-split-qkv"],))
    assert rel_err(torch.tensor(joined), torch.tensor(want)) > 1e-5  # [q; k; v] as one matrix moves the losses
    for mode in ("duplicated", "distributed"):
        got = run_ranks(train_losses, 2, args=(GQA + ["--muon-no-split-qkv", "--tp", "2", "--muon-tp-mode", mode],))
        assert rel_err(torch.tensor(got[-1]), torch.tensor(joined)) <= 1e-5, (mode, got, joined)
    blockwise = run_ranks(train_losses, 2, args=(GQA + ["--tp", "2", "--muon-tp-mode", "blockwise"],))[-1]
    assert rel_err(torch.tensor(blockwise), torch.tensor(want)) > 1e-4  # Megatron-LM's default: per shard
    [moe] = run_ranks(train_losses, 1, args=(MOE,))
    for layout in (["--ep", "2"], ["--tp", "2", "--sequence-parallel", "--etp", "2", "--muon-tp-mode", "distributed"]):
        got = run_ranks(train_losses, 2, args=(MOE + layout,))[-1]
        assert rel_err(torch.tensor(got), torch.tensor(moe)) <= 1e-5, (layout, got, moe)


DIST = GQA[:-6] + ["--optimizer", "dist_muon"] + GQA[-4:]  # duplicated, highest


def _losses_and_state(rank, world, argv):
    run = gpt_run(argv)
    return [r["loss"] for r in run.records], run.optimizer.state_bytes()


@pytest.mark.slow
def test_dist_muon_shards_whole_layers_and_trains_as_one_rank(tmp_path):
    [(want, whole)] = run_ranks(_losses_and_state, 1, args=(GQA,))
    for world, layout in ((2, []), (4, ["--tp", "2"]), (2, ["--pp", "2"])):
        results = run_ranks(_losses_and_state, world, args=(DIST + layout,))
        got = results[-1][0]
        assert rel_err(torch.tensor(got), torch.tensor(want)) <= 1e-5, (layout, got, want)
        if not layout:  # each parameter's state on one rank, whole layers and parameters as even as they go
            assert sum(r[1] for r in results) == whole and max(r[1] for r in results) < 0.6 * whole, (whole, results)
    # pp 2 x dp 2: the tied embedding's two copies, each updated by its own stage's owner
    got = run_ranks(train_losses, 4, args=(DIST + ["--pp", "2"],))[-1]
    assert rel_err(torch.tensor(got), torch.tensor(want)) <= 1e-5, got
    # bf16 weights (fp32 masters copied, the others' zeroed and summed) with QK-clip, clipping off (the
    # gradient norm sums in another order over the layer-wise pieces): bitwise plain Muon's at dp 2
    extra = ["--bf16", "--qk-clip", "--qk-clip-threshold", "0.05", "--clip-grad", "0"]
    plain = run_ranks(train_losses, 2, args=(GQA + extra,))[0]
    assert run_ranks(train_losses, 2, args=(DIST + extra,))[0] == plain
    [moe] = run_ranks(train_losses, 1, args=(MOE,))
    moe_dist = MOE[:-6] + ["--optimizer", "dist_muon"] + MOE[-4:]
    got = run_ranks(train_losses, 4, args=(moe_dist + ["--ep", "2"],))[-1]  # experts over EDP 2
    assert rel_err(torch.tensor(got), torch.tensor(moe)) <= 1e-5, got
    save = DIST[:-6] + ["--train-iters", "2", "--save", str(tmp_path / "ck"), "--save-interval", "2"] + DIST[-6:]
    run_ranks(train_losses, 2, args=(save,))
    [resumed] = run_ranks(train_losses, 1, args=(GQA + ["--load", str(tmp_path / "ck")],))  # into plain Muon
    assert rel_err(torch.tensor(resumed), torch.tensor(want[2:])) <= 1e-5


def test_a_step_makes_no_host_sync():
    quiet = GQA[:-2] + ["--muon-tp-mode", "blockwise", "--bf16", "--log-interval", "100", "--train-iters", "5"]
    [counts] = run_ranks(steady_host_syncs, 1, args=([quiet],))  # (iterations 2 and 3 log nothing)
    assert counts == [0]


def _states_after(rank, world, argv):
    run = gpt_run(argv)
    names = {id(p): n for chunk in run.model_chunks for n, p in chunk.named_parameters()}
    states = {names[id(piece.param)]: run.optimizer.inner.state.get(piece.master, {}) for piece in run.optimizer.pieces}
    return ([r["loss"] for r in run.records], {n: int(s["step"]) for n, s in states.items() if "step" in s},
            {n: sorted(s) for n, s in states.items()})


def test_checkpoints_resume_across_layouts_and_optimizers(tmp_path):
    save = GQA[:-6] + ["--train-iters", "2", "--save", str(tmp_path / "ck"), "--save-interval", "2"] + GQA[-6:]
    run_ranks(train_losses, 1, args=(save,))
    resumed = run_ranks(train_losses, 2, args=(GQA + ["--tp", "2", "--load", str(tmp_path / "ck")],))[0]
    [straight] = run_ranks(train_losses, 1, args=(GQA,))
    assert rel_err(torch.tensor(resumed), torch.tensor(straight[2:])) <= 1e-5
    adam = GQA[:-6]
    [(into_adam, steps, keys)] = run_ranks(_states_after, 1, args=(adam + ["--load", str(tmp_path / "ck")],))
    assert len(into_adam) == 2 and all(math.isfinite(x) for x in into_adam)
    # Adam's state of Muon's matrices starts anew (no second moment saved): two steps, the rest four
    assert steps["layers.0.mlp.fc1.weight"] == 2 and steps["layers.0.input_layernorm.weight"] == 4
    assert keys["layers.0.mlp.fc1.weight"] == ["exp_avg", "exp_avg_sq", "step"]
    sgd = adam + ["--optimizer", "sgd"]
    run_ranks(train_losses, 1, args=(sgd + ["--train-iters", "2", "--save", str(tmp_path / "sgd"),
                                            "--save-interval", "2"],))
    [(_, _, keys)] = run_ranks(_states_after, 1, args=(sgd + ["--load", str(tmp_path / "sgd")],))
    assert all("exp_avg_sq" not in k for k in keys.values()), keys  # SGD resumes with its one moment
    run_ranks(train_losses, 1, args=(adam + ["--train-iters", "2", "--save", str(tmp_path / "adam"),
                                             "--save-interval", "2"],))
    [from_adam] = run_ranks(train_losses, 1, args=(GQA + ["--load", str(tmp_path / "adam")],))
    assert len(from_adam) == 2 and all(math.isfinite(x) for x in from_adam)  # its momentum: Adam's first moment


def test_megatron_lms_flags_and_the_refusals():
    config = parse(GQA + ["--muon-momentum", "0.95", "--muon-use-nesterov", "--muon-no-split-qkv",
                          "--muon-scale-mode", "unit_rms_norm", "--muon-num-ns-steps", "10",
                          "--muon-extra-scale-factor", "0.2"]).optimizer
    assert (config.optimizer, config.muon_momentum, config.muon_use_nesterov, config.muon_split_qkv,
            config.muon_scale_mode, config.muon_num_ns_steps, config.muon_extra_scale_factor) == (
        "muon", 0.95, True, False, "unit_rms_norm", 10, 0.2)
    default = parse(["--optimizer", "muon"]).optimizer
    assert (default.muon_momentum, default.muon_tp_mode, default.muon_fp32_matmul_prec) == (0.9, "blockwise", "medium")
    assert "drop --use-distributed-optimizer" in refusal(GQA + ["--use-distributed-optimizer"], 2)
    assert "query groups" in refusal(GQA[:-2] + ["--tp", "4"], 4)
    assert "--optimizer muon" in refusal(["--muon-momentum", "0.5"], 1)
    assert "multiple of 5" in refusal(GQA + ["--muon-num-ns-steps", "3"], 1)
    assert "--local-sgd-interval" in refusal(DIST + ["--local-sgd-interval", "2"], 2)
    assert "whole layers" in refusal(DIST + ["--use-distributed-optimizer"], 2)
