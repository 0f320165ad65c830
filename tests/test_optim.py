"""Data parallelism and the optimizer: bucketed overlapped reduction, the distributed optimizer
(ZeRO-1), mixed precision with loss scaling, global-norm clipping, weight decay and LR schedule."""
import copy

import pytest
import torch
import torch.distributed as dist

from helpers import fresh_seed, ops_run, rel_err, tiny_gpt_and_optimizer
from megalite import parallel
from megalite.models import GPTModel, TransformerConfig
from megalite.optim import DynamicLossScaler, LRSchedule, ParamAndGradBuffer
from megalite.testing import run_ranks
from training_ranks import parse, train_params, train_with_inf_at

BASE = ["--seq-length", "32", "--log-interval", "1", "--global-batch-size", "16", "--micro-batch-size", "2"]


@pytest.mark.parametrize("dp", [2, 4])
def test_distributed_optimizer_is_bitwise_equal_to_the_plain_one(dp):
    # Small buckets so that shards cut through parameters; clipping off (its coefficient comes
    # from a norm summed in another order, see docs/optimizer.md). Three steps (Adam's moments
    # carried over two updates), two accumulated micro-batches per rank.
    argv = ["--seq-length", "32", "--log-interval", "1", "--global-batch-size", str(4 * dp), "--micro-batch-size", "2",
            "--train-iters", "3", "--ddp-bucket-size", "30000", "--clip-grad", "0"]
    plain = run_ranks(train_params, dp, args=(argv,))
    sharded = run_ranks(train_params, dp, args=(argv + ["--use-distributed-optimizer"],))
    for a, b in zip(plain, sharded):
        for name, p in a["params"].items():
            assert torch.equal(p, b["params"][name]), f"{name} differs after 3 steps at dp={dp}"
        assert [r["loss"] for r in a["records"]] == [r["loss"] for r in b["records"]]


def test_optimizer_state_bytes_fall_as_one_over_dp():
    argv = BASE + ["--train-iters", "1", "--use-distributed-optimizer", "--ddp-bucket-size", "100000"]
    per_rank = {dp: run_ranks(train_params, dp, args=(argv,))[0]["state_bytes"] for dp in (1, 2, 4)}
    for dp in (2, 4):
        # Shards are exact up to the padding of each bucket to a multiple of dp.
        assert per_rank[dp] == pytest.approx(per_rank[1] / dp, rel=0.01), per_rank


LAYOUT_222 = ["--tp", "2", "--pp", "2", "--global-batch-size", "8", "--micro-batch-size", "2", "--seq-length", "32",
              "--train-iters", "2", "--log-interval", "1"]


@pytest.fixture(scope="module")
def single_device_222():
    """The one-device run both 2x2x2 cases compare against (run once)."""
    return run_ranks(train_params, 1, args=(LAYOUT_222[4:],))[0]["records"]


@pytest.mark.parametrize("extra", [[], ["--use-distributed-optimizer"]], ids=["plain", "distributed"])
def test_global_grad_norm_at_222_equals_single_device(extra, single_device_222):
    single = single_device_222
    parallel_run = run_ranks(train_params, 8, args=(LAYOUT_222 + extra,))
    for out in parallel_run:
        for a, b in zip(out["records"], single):
            assert rel_err(torch.tensor(a["grad_norm"]), torch.tensor(b["grad_norm"])) <= 1e-5
            assert rel_err(torch.tensor(a["loss"]), torch.tensor(b["loss"])) <= 1e-5


def overlapped_vs_naive(rank, world, seed):
    """Bucketed, overlapped reduction gives the gradients of a plain all-reduce after backward,
    and the first bucket is launched while backward still has gradients to produce."""
    parallel.initialize_model_parallel(1)
    config = TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=100,
                               max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config, seed=seed)
    naive = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed + rank)  # each DP rank its own data
    ids = torch.randint(0, 100, (2, 16), generator=gen)

    naive(ids, labels=ids).sum().backward()
    for p in naive.parameters():
        dist.all_reduce(p.grad)

    params = list(model.parameters())
    buf = ParamAndGradBuffer(params, param_dtype=torch.float32, grad_dtype=torch.float32, bucket_numel=2000,
                             dp_group=parallel.get_data_parallel_group(), dp_size=world, reduce_scatter=False)
    assert len(buf.buckets) > 3, "the test needs several buckets"
    model(ids, labels=ids).sum().backward()  # a non-final micro-batch: accumulate only
    assert buf.launch_log == []
    buf.zero_grad()
    buf.enable_sync()
    model(ids, labels=ids).sum().backward()
    launched_during_backward = list(buf.launch_log)
    buf.finish_grad_sync()
    for (name, p), q in zip(model.named_parameters(), naive.parameters()):
        assert torch.allclose(p.main_grad, q.grad, rtol=1e-6, atol=1e-7), name
    return launched_during_backward, len(params)


def test_bucketed_overlapped_reduction_matches_naive_and_starts_before_backward_ends():
    for launched, num_params in run_ranks(overlapped_vs_naive, 2, args=(fresh_seed(),)):
        assert launched, "no bucket was launched during backward"
        first_bucket, grads_ready_then = launched[0]
        assert first_bucket == 0 and grads_ready_then < num_params, launched
        assert len(launched) > 1


def test_fp16_forced_overflow_skips_exactly_that_step_and_lowers_the_scale():
    # Two micro-batches an iteration (every one of iteration 3 overflows).
    argv = ["--seq-length", "32", "--log-interval", "1", "--global-batch-size", "8", "--micro-batch-size", "4",
            "--train-iters", "6", "--fp16", "--hysteresis", "1", "--initial-loss-scale", "1024"]
    records, adam_steps = run_ranks(train_with_inf_at, 1, args=(argv, 3))[0]
    assert [r["skipped"] for r in records] == [0, 0, 1, 0, 0, 0]
    assert [r["loss_scale"] for r in records] == [1024, 1024, 512, 512, 512, 512]
    assert adam_steps == 5, "the skipped step must not update the weights or Adam's state"
    assert all(torch.isfinite(torch.tensor(r["loss"])) for i, r in enumerate(records) if i != 2)
    assert records[-1]["loss"] < records[0]["loss"]


# bf16 vs fp32 on the tiny GPT over 50 steps (global batch 8 of 32 tokens, two micro-batches):
# the documented tolerance (docs/optimizer.md).
BF16_TOLERANCE = 0.01


def test_bf16_loss_curve_tracks_fp32():
    argv = ["--seq-length", "32", "--log-interval", "1", "--global-batch-size", "8", "--micro-batch-size", "4",
            "--train-iters", "50"]
    fp32 = [r["loss"] for r in run_ranks(train_params, 1, args=(argv,))[0]["records"]]
    bf16 = [r["loss"] for r in run_ranks(train_params, 1, args=(argv + ["--bf16"],))[0]["records"]]
    worst = max(abs(a - b) for a, b in zip(fp32, bf16))
    assert worst <= BF16_TOLERANCE, f"bf16 drifts {worst:.4f} from fp32"
    assert bf16[-1] < bf16[0] - 0.5, "bf16 must learn"


def test_bf16_gradient_reduction_tracks_fp32_reduction():
    # dp 2, two micro-batches per rank
    argv = ["--seq-length", "32", "--log-interval", "1", "--global-batch-size", "8", "--micro-batch-size", "2",
            "--train-iters", "10"]
    fp32 = run_ranks(train_params, 2, args=(argv,))[0]["records"]
    bf16 = run_ranks(train_params, 2, args=(argv + ["--grad-reduce-dtype", "bf16"],))[0]["records"]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(fp32, bf16)) < 0.01
    assert fp32[-1]["loss"] != bf16[-1]["loss"], "bf16 reduction must actually be used"


def test_dynamic_loss_scaler_growth_hysteresis_and_floor():
    s = DynamicLossScaler(initial_scale=8, growth_interval=2, hysteresis=2, min_scale=2)
    s.update(False)
    s.update(False)
    assert s.scale == 16
    s.update(True)
    assert s.scale == 16, "hysteresis: the first overflow keeps the scale"
    s.update(True)
    assert s.scale == 8
    for _ in range(6):
        s.update(True)
    assert s.scale == 2, "never below min_scale"


def test_weight_decay_skips_biases_and_norm_weights_only():
    unchanged = run_ranks(_wd_step, 1)[0]
    for name, same in unchanged.items():
        is_matrix = name.endswith("weight") and "layernorm" not in name
        assert same != is_matrix, name


def _wd_step(rank, world):
    model, _, opt = tiny_gpt_and_optimizer(num_layers=1, weight_decay=0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step(lr=0.1, clip_grad=0)  # zero gradients: only weight decay moves weights
    return {n: torch.equal(p.detach(), before[n]) for n, p in model.named_parameters()}


def test_lr_schedule_warms_up_then_decays_to_min_lr():
    s = LRSchedule(1.0, 0.1, warmup_iters=4, decay_iters=14, style="cosine")
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(4) == 1.0 and s(9) == pytest.approx(0.55) and s(14) == pytest.approx(0.1) and s(100) == pytest.approx(0.1)
    lin = LRSchedule(1.0, 0.0, warmup_iters=0, decay_iters=10, style="linear")
    assert lin(5) == pytest.approx(0.5)


def test_apex_adam_without_apex_is_a_clear_error():
    from megalite.arguments import model_config, validate
    from megalite.runtime import UsageError

    args = parse(["--use-apex-adam"])
    with pytest.raises(UsageError, match="NVIDIA apex built from source"):
        validate(args, 1, model_config(args))


def _decoupled_runs(rank, world, base):
    """Parameters after one step: --decoupled-lr D beside --lr L, then everything at D, then at L."""
    return [train_params(rank, world, base + extra)["params"] for extra in (
        ["--lr", "1e-3", "--decoupled-lr", "4e-3"], ["--lr", "4e-3"], ["--lr", "1e-3"])]


def test_decoupled_lr_moves_the_embedding_and_output_layer_at_their_own_rate():
    base = ["--model", "llama-tiny", "--train-iters", "1", "--seq-length", "32", "--min-lr", "0"]  # untied output
    decoupled, all_at_d, all_at_l = run_ranks(_decoupled_runs, 1, args=(base,))[0]
    apart = [n for n in decoupled if n.endswith(("word_embeddings.weight", "output_layer.weight"))]
    assert len(apart) == 2
    for name, p in decoupled.items():
        want = all_at_d[name] if name in apart else all_at_l[name]
        assert torch.equal(p, want), name
    assert not torch.equal(decoupled[apart[0]], all_at_l[apart[0]])


def _clipped_steps(rank, world, optimizer="adamw"):
    """Two steps clipped at 1.0, then one with clipping off, against torch's clip_grad_norm_ and
    the fused AdamW (or SGD: --optimizer sgd) on copies; the operators each step runs."""
    from megalite.training.build import _use_plain_sgd

    model, _, opt = tiny_gpt_and_optimizer(num_layers=1, weight_decay=0.0)
    params = list(model.parameters())
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    if optimizer == "sgd":
        _use_plain_sgd(opt, 0.1)
        reference = torch.optim.SGD(copies, lr=0.1, momentum=0.0, fused=True)
    else:
        reference = torch.optim.AdamW(copies, lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)
    g = torch.Generator().manual_seed(0)
    worst, ops, grads_after, scales_left = 0.0, [], [], []
    for clip in (1.0, 1.0, 0.0):
        grads = [torch.randn(p.shape, generator=g) * 10 for p in params]  # a norm far above 1
        for p, c, grad in zip(params, copies, grads):
            p.main_grad.copy_(grad)
            c.grad = grad.clone()
        if clip:
            torch.nn.utils.clip_grad_norm_(copies, clip)
        reference.step()
        ops.append(ops_run(lambda: opt.step(lr=0.1, clip_grad=clip)))
        worst = max(worst, max(rel_err(p.detach(), c.detach()) for p, c in zip(params, copies)))
        grads_after.append(max(rel_err(p.main_grad, c.grad) for p, c in zip(params, copies)))
        scales_left.append(getattr(opt.inner, "grad_scale", None))
    return worst, ops, grads_after, scales_left


FUSED_KERNEL = {"adamw": "_fused_adamw_", "sgd": "_fused_sgd_"}


@pytest.mark.parametrize("optimizer", list(FUSED_KERNEL))
def test_clipping_rides_in_the_fused_updates_grad_scale_with_no_pass_of_its_own(optimizer):
    """The clip's divisor is the `grad_scale` the fused update (AdamW; SGD under --optimizer sgd)
    applies as it reads each gradient: no multiply over the gradients before the update, the same
    update as torch's clip_grad_norm_ then the optimizer within rounding (a division by the
    reciprocal instead of a multiplication), the stored gradients clipped; a step with clipping
    off carries no stale scale, and none is left on the inner optimizer after a step."""
    worst, ops, grads_after, scales_left = run_ranks(_clipped_steps, 1, args=(optimizer,))[0]
    assert worst < 1e-6, worst
    assert max(grads_after) < 1e-6, grads_after  # the gradients are left clipped, as a multiply leaves them
    assert grads_after[2] == 0.0  # clipping off: the gradients untouched
    for ran in ops:
        assert FUSED_KERNEL[optimizer] in ran
        assert not {"mul_", "_foreach_mul_", "div_", "_foreach_div_"} & set(ran), ran
    assert scales_left == [None, None, None]
