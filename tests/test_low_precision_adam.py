"""--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16: AdamW with its moments
stored in bf16, computed in fp32. With fp32 moments it is PyTorch's AdamW; with bf16 ones each step by
hand from the stored moments; the skip and the clip on the device; training at tp 2, dp 2, ZeRO-1 and
ZeRO-3 equal to one rank with half the moments' bytes; resume across layouts and into fp32 moments;
under Muon's AdamW part; Megatron-LM's flags and the refusals."""
from __future__ import annotations

import pytest
import torch

from helpers import rel_err
from megalite.optim.low_precision_adam import LowPrecisionAdamW
from megalite.testing import run_ranks
from training_ranks import gpt_run, parse, refusal, train_losses


def _pair(dtype):
    torch.manual_seed(0)
    a = torch.randn(40, 24)
    b = a.clone()
    ref = torch.optim.AdamW([{"params": [a], "weight_decay": 0.1}], lr=0.01, betas=(0.9, 0.95), eps=1e-8, fused=True)
    low = LowPrecisionAdamW([{"params": [b], "weight_decay": 0.1}], lr=0.01, betas=(0.9, 0.95), eps=1e-8,
                            exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
    return a, b, ref, low


def test_with_fp32_moments_it_is_pytorchs_adamw():
    a, b, ref, low = _pair(torch.float32)
    for _ in range(5):
        g = torch.randn(40, 24)
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        low.step()
    assert rel_err(b, a) <= 1e-6
    assert rel_err(low.state[b]["exp_avg_sq"], ref.state[a]["exp_avg_sq"]) <= 1e-6


def test_bf16_moments_step_by_hand_from_what_is_stored():
    a, b, _, low = _pair(torch.bfloat16)
    w, m, v = b.clone(), torch.zeros(40, 24), torch.zeros(40, 24)
    for t in range(1, 4):
        g = torch.randn(40, 24)
        b.grad = g.clone()
        low.step()
        w = w * (1 - 0.01 * 0.1)
        m = m.bfloat16().float().lerp(g, 0.1)  # what was stored, read as fp32
        v = v.bfloat16().float() * 0.95 + 0.05 * g * g
        w = w - 0.01 / (1 - 0.9 ** t) * m / ((v.sqrt() / (1 - 0.95 ** t) ** 0.5) + 1e-8)
        assert rel_err(b, w) <= 1e-6, t
        assert low.state[b]["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(low.state[b]["exp_avg"], m.bfloat16())  # stored rounded
    assert not torch.equal(a, b)


def test_without_pytorchs_fused_kernel_the_passes_give_its_numbers(monkeypatch):
    import megalite.optim.low_precision_adam as low_module

    results = []
    for fused in (low_module._FUSED, None):
        monkeypatch.setattr(low_module, "_FUSED", fused)
        _, b, _, low = _pair(torch.bfloat16)
        torch.manual_seed(5)
        for t in range(3):
            b.grad = torch.randn(40, 24) * (4 if t == 1 else 1)
            low.grad_scale = torch.tensor(4.0) if t == 1 else None
            low.found_inf = torch.tensor(1.0 if t == 2 else 0.0)
            low.step()
        results.append((b.clone(), low.state[b]["exp_avg_sq"].float(), low.state[b]["step"].clone()))
    (w1, v1, s1), (w2, v2, s2) = results
    assert rel_err(w2, w1) <= 1e-6 and rel_err(v2, v1) <= 1e-2 and torch.equal(s1, s2) and int(s1) == 2


def test_a_skipped_step_changes_nothing_and_the_clip_divides():
    _, b, _, low = _pair(torch.bfloat16)
    b.grad = torch.randn(40, 24)
    low.step()
    names = ("exp_avg", "exp_avg_sq", "step")
    before = [b.clone()] + [low.state[b][k].clone() for k in names]
    b.grad = torch.full((40, 24), float("nan"))
    low.found_inf = torch.tensor(1.0)
    low.step()
    assert torch.equal(b, before[0]) and all(torch.equal(low.state[b][k], t) for k, t in zip(names, before[1:]))
    _, c, _, other = _pair(torch.bfloat16)
    c.copy_(b)
    other.load_state_dict(low.state_dict())
    g = torch.randn(40, 24)
    b.grad, c.grad = g * 4, g
    low.found_inf, low.grad_scale = torch.tensor(0.0), torch.tensor(4.0)
    low.step()
    other.step()
    assert rel_err(b, c) <= 1e-6


LOW = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
RUN = ["--model", "llama-tiny", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
       "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "16",
       "--global-batch-size", "4", "--micro-batch-size", "1", "--log-interval", "1", "--train-iters", "4",
       "--lr", "0.01"]


def _losses_and_bytes(rank, world, argv):
    run = gpt_run(argv)
    numel = sum(p.numel() for piece in run.optimizer.pieces for p in [piece.master])
    dtypes = sorted({str(s["exp_avg"].dtype) for s in run.optimizer.inner.state.values() if "exp_avg" in s})
    return [r["loss"] for r in run.records], run.optimizer.state_bytes(), numel, dtypes


@pytest.mark.slow
def test_training_at_tp2_dp2_zero1_zero3_gives_one_ranks_losses_in_half_the_moments():
    [(want, low_bytes, numel, dtypes)] = run_ranks(_losses_and_bytes, 1, args=(RUN + LOW,))
    [(fp32, fp32_bytes, _, _)] = run_ranks(_losses_and_bytes, 1, args=(RUN,))
    assert dtypes == ["torch.bfloat16"] and low_bytes == fp32_bytes - 4 * numel  # 2 + 2 bytes, not 4 + 4
    assert want != fp32  # the rounding moves the losses
    for world, layout in ((2, ["--tp", "2"]), (2, []), (2, ["--use-distributed-optimizer"]),
                          (2, ["--zero-stage", "3"])):
        got = run_ranks(_losses_and_bytes, world, args=(RUN + LOW + layout,))[-1][0]
        assert rel_err(torch.tensor(got), torch.tensor(want)) <= 1e-5, (layout, got, want)
    muon = ["--optimizer", "muon", "--muon-fp32-matmul-prec", "highest"]
    [(with_muon, _, _, dtypes)] = run_ranks(_losses_and_bytes, 1, args=(RUN + LOW + muon,))
    assert "torch.bfloat16" in dtypes and "torch.float32" in dtypes  # AdamW's moments bf16, Muon's momentum fp32


def test_resume_across_layouts_and_into_fp32_moments(tmp_path):
    save = RUN + LOW + ["--train-iters", "2", "--save", str(tmp_path / "ck"), "--save-interval", "2"]
    run_ranks(train_losses, 1, args=(save,))
    [straight] = run_ranks(train_losses, 1, args=(RUN + LOW,))
    resumed = run_ranks(_losses_and_bytes, 2, args=(RUN + LOW + ["--tp", "2", "--load", str(tmp_path / "ck")],))
    assert rel_err(torch.tensor(resumed[0][0]), torch.tensor(straight[2:])) <= 1e-5
    assert resumed[0][3] == ["torch.bfloat16"]
    [(into_fp32, _, _, dtypes)] = run_ranks(_losses_and_bytes, 1, args=(RUN + ["--load", str(tmp_path / "ck")],))
    assert dtypes == ["torch.float32"] and len(into_fp32) == 2
    [fresh] = run_ranks(train_losses, 1, args=(RUN + ["--load", str(tmp_path / "ck"), "--no-load-optim"],))
    assert into_fp32[1] != fresh[1]  # the moments were taken, not started anew


def test_local_sgd_resumes_bf16_moments_into_fp32_ones_and_muon_into_adam(tmp_path):
    local = RUN + ["--local-sgd-interval", "2", "--train-iters", "4"]
    save = ["--train-iters", "2", "--save", str(tmp_path / "ck"), "--save-interval", "2"]
    run_ranks(train_losses, 2, args=(local + LOW + save,))
    resumed = run_ranks(_losses_and_bytes, 2, args=(local + ["--load", str(tmp_path / "ck")],))
    assert resumed[0][3] == ["torch.float32"] and len(resumed[0][0]) == 2
    muon = ["--optimizer", "muon", "--muon-fp32-matmul-prec", "highest"]
    run_ranks(train_losses, 2, args=(local + muon + save[:-3] + [str(tmp_path / "muon"), "--save-interval", "2"],))
    adam = run_ranks(train_losses, 2, args=(local + ["--load", str(tmp_path / "muon")],))
    assert len(adam[0]) == 2 and all(x == x for x in adam[0])  # Muon's matrices' Adam state starts anew


def test_megatron_lms_flags_and_the_refusals():
    o = parse(RUN + LOW + ["--main-params-dtype", "fp32", "--main-grads-dtype", "fp32"]).optimizer
    assert (o.use_precision_aware_optimizer, o.exp_avg_dtype, o.exp_avg_sq_dtype) == (True, "bf16", "bf16")
    assert "--use-precision-aware-optimizer" in refusal(RUN + ["--exp-avg-dtype", "bf16"], 1)
    assert "use bf16" in refusal(RUN + ["--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "fp8"], 1)
    assert "fp32 master" in refusal(RUN + ["--use-precision-aware-optimizer", "--main-params-dtype", "fp16"], 1)
    assert "main gradients" in refusal(RUN + ["--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"], 1)
    assert "sgd" in refusal(RUN + LOW + ["--optimizer", "sgd"], 1)
