"""ZeRO stages 2 and 3 (megalite.optim.zero): the same training as plain data parallelism under every
layout, the memory each rank holds, the bytes each step moves, and the gathers' order."""
from __future__ import annotations

import json
from fractions import Fraction

import pytest
import torch

from helpers import rel_err
from megalite.testing import counting_collectives, ring_bytes, run_ranks
from training_ranks import gpt_run, parse, several, whole_params

BASE = ["--seq-length", "32", "--global-batch-size", "8", "--micro-batch-size", "2", "--log-interval", "1"]
STAGES = (0, 1, 2, 3)

# (ranks, flags): (tp, pp, dp) as the issue names them, then interleaving and recomputation.
LAYOUTS = {
    "tp1-pp1-dp4": (4, []),
    "tp2-pp1-dp2": (4, ["--tp", "2"]),
    "tp1-pp2-dp2": (4, ["--pp", "2"]),
    "tp2-pp2-dp2": (8, ["--tp", "2", "--pp", "2"]),
    "tp1-pp2-dp2-interleaved": (4, ["--pp", "2", "--vpp", "2", "--num-layers", "4"]),
    "tp2-pp2-dp2-recompute-sp": (8, ["--tp", "2", "--pp", "2", "--recompute", "full", "--sequence-parallel"]),
    # GQA, SwiGLU, rope, an untied output layer; qk-norm and SP norms summed over TP on the shards.
    "llama-tp2-pp1-dp2-qknorm-sp": (4, ["--model", "llama-tiny", "--tp", "2", "--qk-layernorm", "--sequence-parallel"]),
}


def train_variants(rank, world, argv, variants: dict):
    """Losses and final parameters of the same run with each variant's extra flags (one process group)."""
    out = {}
    for key, flags in variants.items():
        run = gpt_run(argv + list(flags))
        out[key] = {"losses": [r["loss"] for r in run.records], "params": whole_params(run)}
    return out


def train_at_each_stage(rank, world, argv, stages=STAGES):
    return train_variants(rank, world, argv, {stage: ["--zero-stage", str(stage)] for stage in stages})


def once_each(fn, cases: dict) -> dict:
    """key -> each rank's fn(rank, world, argv) for cases' key -> (world, argv): one spawn per world size."""
    out = {}
    for world in sorted({w for w, _ in cases.values()}):
        keys = [k for k, (w, _) in cases.items() if w == world]
        per_rank = run_ranks(several, world, args=(fn, [cases[k][1] for k in keys]), timeout=900)
        out.update(zip(keys, map(list, zip(*per_rank))))  # key -> [rank 0's result, rank 1's, ...]
    return out


# The layout matrix runs 3 steps: the third runs on weights two sharded updates made, which is where a
# stage goes wrong (more add time, not coverage). It compares training only: no validation pass
# (stage 3's gathers under evaluation run in the memory tests' runs below).
MATRIX = ["--train-iters", "3", "--eval-interval", "0"]


@pytest.fixture(scope="module")
def by_layout():
    return once_each(train_at_each_stage, {n: (ranks, BASE + flags + MATRIX) for n, (ranks, flags) in LAYOUTS.items()})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_zero_stage_trains_like_plain_data_parallelism(by_layout, layout):
    for by_stage in by_layout[layout]:
        plain = by_stage[0]
        for stage in (1, 2, 3):
            for a, b in zip(by_stage[stage]["losses"], plain["losses"]):
                assert rel_err(torch.tensor(a), torch.tensor(b)) <= 1e-5, (layout, stage, a, b)
            # The whole model at once, to 1e-4: where a gradient is a near-cancellation (a key bias's is
            # zero up to rounding; a rare token's embedding row), Adam's division by sqrt(v) turns the
            # summation order's last bits into steps of up to lr, so no tensor compares alone.
            whole = torch.cat([by_stage[stage]["params"][n].reshape(-1) for n in plain["params"]])
            assert rel_err(whole, torch.cat([p.reshape(-1) for p in plain["params"].values()])) <= 1e-4


def test_stage_3_gather_options_train_the_same_through_interleaved_pipelines():
    # Interleaved 1F1B holds several micro-batches in flight: layers kept from forward to backward
    # are counted per micro-batch, and kept for the step they are gathered once.
    # Global batch 16: 4 micro-batches a rank reach the steady phase (2 are all warm-up and cool-down).
    argv = BASE + ["--pp", "2", "--vpp", "2", "--num-layers", "4", "--global-batch-size", "16", *MATRIX]
    variants = {"plain": ["--zero-stage", "0"], "default": ["--zero-stage", "3"],
                "keep-to-backward": ["--zero-stage", "3", "--zero-reshard-after-forward", "false"],
                "keep-for-step": ["--zero-stage", "3", "--zero-keep-params-for-step"],
                "recompute": ["--zero-stage", "3", "--recompute", "full", "--zero-reshard-after-forward", "false"]}
    for by_variant in run_ranks(train_variants, 4, args=(argv, variants), timeout=600):
        reference = by_variant["default"]["losses"]
        for a, b in zip(by_variant["plain"]["losses"], reference):
            assert rel_err(torch.tensor(a), torch.tensor(b)) <= 1e-5
        for key in ("keep-to-backward", "keep-for-step", "recompute"):
            assert by_variant[key]["losses"] == reference, key  # the same reductions, gathered otherwise


PRECISIONS = {"bf16": ["--bf16"], "fp16": ["--fp16"], "bf16-reduce": ["--bf16", "--grad-reduce-dtype", "bf16"]}


@pytest.fixture(scope="module")
def by_precision():
    """pp 2 ties the word embedding over the first and last stage; fp16 scales the loss dynamically
    (from 2^16: none of these steps overflows; test_optim.py forces one). 3 steps, as the layout
    matrix (the third on weights two sharded updates made); validation kept (pp 2, stage 3)."""
    return once_each(train_at_each_stage, {n: (4, BASE + ["--pp", "2", "--train-iters", "3", *flags])
                                           for n, flags in PRECISIONS.items()})


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_zero_stages_keep_mixed_precision_training_with_tied_embeddings_across_stages(by_precision, precision):
    for by_stage in by_precision[precision]:
        plain = by_stage[0]["losses"]
        for stage in (1, 2, 3):
            # bf16 parameters round the masters' last-bit differences (another summation order).
            for a, b in zip(by_stage[stage]["losses"], plain):
                assert abs(a - b) / abs(b) <= 1e-4, (precision, stage, a, b)


def test_one_micro_batch_per_step_makes_stages_1_2_and_3_bitwise_equal():
    # dp 2 x micro-batch 2 = global batch 4: one micro-batch, so stage 2's per-backward reduction is
    # stage 1's one reduction; two ranks sum commutatively, so stage 3's units change nothing either.
    # Clipping off: stage 3's pieces cut the global norm's sum of squares elsewhere (docs/optimizer.md).
    # 3 steps: the last loss and the weights carry two updates through Adam's moments, bit for bit.
    argv = ["--seq-length", "32", "--global-batch-size", "4", "--micro-batch-size", "2", "--log-interval", "1",
            "--train-iters", "3", "--clip-grad", "0"]
    results = run_ranks(train_at_each_stage, 2, args=(argv, (1, 2, 3)))
    for by_stage in results:
        for stage in (2, 3):
            assert by_stage[stage]["losses"] == by_stage[1]["losses"]
            for name, p in by_stage[1]["params"].items():
                assert torch.equal(by_stage[stage]["params"][name], p), (stage, name)


# -- memory ---------------------------------------------------------------------------------------
def held_bytes(rank, world, argv):
    """What a rank holds after training: the buffers' storage and last-step peaks, the optimizer's
    state, and the sizes of stage 3's units (parameter bytes; layer units apart)."""
    run = gpt_run(argv)
    (buf,) = run.buffers
    element = torch.empty(0, dtype=buf.param_dtype).element_size()
    layer_units = [b.numel * element for b in buf.buckets if b.index in getattr(buf, "layer_unit_indices", ())]
    other_units = [b.numel * element for b in buf.buckets if b.index not in getattr(buf, "layer_unit_indices", ())]
    return {"stored": buf.stored_bytes(), "padded": buf.numel, "real": sum(buf.numel_of.values()),
            "owned": sum(piece.hi - piece.lo for piece in run.optimizer.pieces),
            "optimizer": run.optimizer.state_bytes(), "layer_units": layer_units, "other_units": other_units}


MEMORY = BASE + ["--train-iters", "2", "--num-layers", "4", "--bf16", "--grad-reduce-dtype", "bf16"]
HELD = [(2, ["--zero-stage", "3"]), (2, ["--zero-stage", "3", "--zero-reshard-after-forward", "false"]),
        *((4, ["--zero-stage", str(s)]) for s in STAGES)]


@pytest.fixture(scope="module")
def held():
    """(dp, flags as a tuple) -> each rank's held_bytes."""
    return once_each(held_bytes, {(dp, tuple(flags)): (dp, MEMORY + flags) for dp, flags in HELD})


@pytest.mark.parametrize("dp", [2, 4])
def test_stage_3_holds_2_plus_2_plus_12_bytes_per_parameter_over_dp_and_two_gathered_layers(held, dp):
    for got in held[(dp, ("--zero-stage", "3"))]:
        stored, shard = got["stored"], got["padded"] // dp
        # bf16 parameter shard, bf16 gradient shard, fp32 master + Adam's two moments for owned elements.
        assert stored["params"] == 2 * shard and stored["grads"] == 2 * shard
        assert got["optimizer"] == 12 * got["owned"]
        state = stored["params"] + stored["grads"] + got["optimizer"]
        assert state == pytest.approx(16 * got["real"] / dp, rel=0.03)  # padding of each unit to 64 x dp
        # Gathered at once: the chunk's embeddings / final norm, and two layers (one working, one prefetched).
        assert stored["peak_gathered"] == sum(got["other_units"]) + 2 * max(got["layer_units"])


def held_while_saving(rank, world, argv):
    run = gpt_run(argv)
    (buf,) = run.buffers
    element = torch.empty(0, dtype=buf.param_dtype).element_size()
    sizes = {b.index: b.numel * element for b in buf.buckets}
    # The step's peaks were reset after its update: what the count holds now is the save's.
    return {"save_peak": buf.peak["gathered"], "layers": [sizes[i] for i in buf.layer_unit_indices],
            "others": [n for i, n in sizes.items() if i not in buf.layer_unit_indices]}


def test_a_stage_3_save_gathers_one_layer_at_a_time(tmp_path):
    argv = MEMORY + ["--zero-stage", "3", "--train-iters", "1", "--eval-iters", "0", "--save", str(tmp_path)]
    for got in run_ranks(held_while_saving, 2, args=(argv,)):
        assert got["save_peak"] == sum(got["others"]) + max(got["layers"])


def after_training(rank, world, argv):
    run = gpt_run(argv)
    weight = run.model_chunks[0].layers[0].mlp.fc1.weight
    outside = weight.numel()
    with run.optimizer.whole_parameters():
        inside, total = tuple(weight.shape), float(weight.detach().abs().sum())
    return outside, inside, total


def test_after_training_stage_3_parameters_are_empty_until_gathered_whole():
    # Read outside whole_parameters(), a parameter is an empty tensor (a loud error in any use),
    # never freed memory; inside, it is whole and trained.
    argv = BASE + ["--zero-stage", "3", "--train-iters", "1"]
    for outside, inside, total in run_ranks(after_training, 2, args=(argv,)):
        assert outside == 0 and inside == (512, 128) and total > 0


def test_keeping_gathered_layers_until_backward_holds_every_layer(held):
    for got in held[(2, ("--zero-stage", "3", "--zero-reshard-after-forward", "false"))]:
        assert got["stored"]["peak_gathered"] == sum(got["other_units"]) + sum(got["layer_units"])


def test_stored_state_falls_stage_by_stage(held):
    dp = 4
    per_stage = {s: held[(dp, ("--zero-stage", str(s)))][0] for s in STAGES}
    state = {s: g["stored"]["params"] + g["stored"]["grads"] + g["optimizer"] for s, g in per_stage.items()}
    real = per_stage[0]["real"]
    # bf16 parameters, fp32 gradients below stage 2 (bf16 shards from stage 2), fp32 master + Adam.
    assert state[0] == pytest.approx((2 + 4 + 12) * real, rel=0.02)
    assert state[1] == pytest.approx((2 + 4 + 12 / dp) * real, rel=0.02)
    assert state[2] == pytest.approx((2 + (2 + 12) / dp) * real, rel=0.02)
    assert state[3] == pytest.approx((2 + 2 + 12) / dp * real, rel=0.03)
    # Stage 2 holds whole-bucket gradients only while they reduce: at most three buckets of the step.
    assert 0 < per_stage[2]["stored"]["peak_grad_buckets"] <= 3 * 2 * 40_000_000


# -- communication ---------------------------------------------------------------------------------
def step_traffic(rank, world, argv):
    """Bytes this rank sends for data parallelism in one step (ring volumes), and its buffer size."""
    sent: list[Fraction] = []
    with counting_collectives(lambda kind, nbytes, n: sent.append(ring_bytes(kind, nbytes, n)), dp_buffers_only=True):
        run = gpt_run(argv + ["--train-iters", "1"])
    buf = run.buffers[0]
    return {"sent": sum(sent, Fraction(0)), "padded": buf.numel, "units": [b.numel for b in buf.buckets],
            "layers": sorted(getattr(buf, "layer_unit_indices", ()))}


def traffic(*cases: tuple) -> list[tuple[Fraction, int, dict]]:
    """(sent, padded, what step_traffic saw on rank 0) for each (stage, micro_batches, *extra), all in one spawn."""
    dp = 2
    argvs = [["--seq-length", "32", "--micro-batch-size", "2", "--log-interval", "1", "--num-layers", "3",
              "--eval-iters", "0", "--global-batch-size", str(2 * dp * micro_batches), "--zero-stage", str(stage),
              *extra] for stage, micro_batches, *extra in cases]
    return [(got["sent"], got["padded"], got) for got in run_ranks(several, dp, args=(step_traffic, argvs))[0]]


def turns_kept(got: dict, m: int) -> int:
    """Elements stage 3 does not gather again at the turns of m micro-batches (one chunk, pp 1): each
    backward finds its forward's last layer (the lowest unit: layers are units last first) and the
    rest whole; each later forward finds the backward's first layer and the rest (with the embeddings)."""
    layers = got["layers"]
    rest = sum(n for i, n in enumerate(got["units"]) if i not in layers)
    last, first = got["units"][min(layers)], got["units"][max(layers)]
    return m * (rest + last) + (m - 1) * (rest + first)


def test_stage_2_sends_what_stage_1_sends_and_stage_3_half_again_plain_data_parallelism_less_the_turns():
    per_element = {}
    for stage, (sent, padded, got) in zip(STAGES, traffic(*((stage, 1) for stage in STAGES))):
        per_element[stage] = sent / padded
    ring = Fraction(1, 2)  # (n - 1) / n at dp 2; fp32 everywhere: 4 bytes an element
    assert per_element[0] == 2 * ring * 4  # one all-reduce of the gradients
    assert per_element[1] == per_element[2] == 2 * ring * 4  # reduce-scatter + all-gather
    # all-gather in forward and in backward, reduce-scatter; the backward gathers no unit its forward ended with
    kept = turns_kept(got, 1)
    assert 0 < kept < padded / 2
    assert per_element[3] == 3 * ring * 4 - ring * 4 * Fraction(kept, padded)


def test_traffic_per_step_with_micro_batches_follows_each_stages_formula():
    m, ring = 3, Fraction(1, 2) * 4
    expected = {
        (2,): lambda got: (m + 1) * ring,  # a reduce-scatter per backward, one all-gather after the step
        # per micro-batch: gather, gather again for backward, reduce-scatter; less what the turns keep
        (3,): lambda got: 3 * m * ring - ring * Fraction(turns_kept(got, m), got["padded"]),
        (3, "--zero-reshard-after-forward", "false"): lambda got: 2 * m * ring,
        (3, "--zero-keep-params-for-step"): lambda got: (1 + m) * ring,  # one gather a step
    }
    for ((stage, *extra), per_element), (sent, padded, got) in zip(
            expected.items(), traffic(*((stage, m, *extra) for stage, *extra in expected))):
        assert sent / padded == per_element(got), (stage, extra)


def dp_collectives_in_order(rank, world, argv):
    """Each data-parallel collective this rank issues in a step: (kind, bytes, group ranks)."""
    import torch.distributed as dist

    from megalite import parallel

    issued = []
    with counting_collectives(lambda kind, nbytes, n: issued.append(kind + f" {nbytes} B"), dp_buffers_only=True):
        gpt_run(argv + ["--train-iters", "1", "--eval-iters", "0"])
    return issued, tuple(dist.get_process_group_ranks(parallel.get_data_parallel_group()))


@pytest.mark.parametrize("flags", [["--tp", "2", "--pp", "2", "--recompute", "full"],
                                   ["--pp", "2", "--vpp", "2", "--num-layers", "4", "--zero-reshard-after-forward",
                                    "false"]], ids=["tp2-pp2-dp2-recompute", "pp2-dp2-interleaved"])
def test_every_member_of_a_dp_group_issues_the_same_zero_3_collectives_in_the_same_order(flags):
    # NCCL matches collectives on a communicator by the order they are issued: a rank that gathers
    # another unit, or the same one at another point, hangs the step on a GPU.
    world = 8 if "--tp" in flags else 4
    argv = BASE + ["--zero-stage", "3", *flags]
    by_group: dict[tuple, list] = {}
    for issued, group in run_ranks(dp_collectives_in_order, world, args=(argv,)):
        by_group.setdefault(group, []).append(issued)
    assert len(by_group) == world // 2
    for group, sequences in by_group.items():
        assert len(sequences) == 2 and sequences[0] == sequences[1] and len(sequences[0]) > 10, group


# -- gathers: order and timeline --------------------------------------------------------------------
def gathers_and_trace(rank, world, argv, trace):
    run = gpt_run(argv + ["--timeline", str(trace)])
    return run.buffers[0].gather_log


def test_stage_3_prefetches_the_next_layer_keeps_the_units_at_each_turn_and_draws_its_gathers(tmp_path):
    trace = tmp_path / "trace.json"
    argv = BASE + ["--train-iters", "1", "--num-layers", "3", "--global-batch-size", "8", "--zero-stage", "3",
                   "--eval-iters", "0"]  # 2 micro-batches a rank
    log = run_ranks(gathers_and_trace, 2, args=(argv, trace))[0]
    # Units: layers 2, 1, 0 are units 0, 1, 2 (backward order), the rest is unit 3. A backward begins
    # with what its forward ended with (the rest, layer 2); the next forward with what the backward
    # ended with (layer 0, then the rest with the embeddings): neither is gathered again.
    step = log
    first_forward = [(3, "forward"), (2, "prefetch forward"), (1, "prefetch forward"), (0, "prefetch forward")]
    backward = [(1, "prefetch backward"), (2, "prefetch backward")]
    assert step == first_forward + backward + [(1, "prefetch forward"), (0, "prefetch forward")] + backward
    events = json.loads(trace.read_text())["traceEvents"]
    gathers = [e for e in events if e.get("cat") == "zero-gather"]
    rows = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert len(gathers) == 2 * len(step) and all(e["tid"] == 1 for e in gathers)  # both ranks
    assert any("all-gathers" in name for name in rows)
    assert any(e.get("cat") == "zero-wait" for e in events)
    # each wait for a gradient reduce-scatter too: per backward one per unit (the last two in flight
    # are landed at its end), on the compute row
    reduce_waits = [e for e in events if e.get("cat") == "zero-reduce-wait" and e["pid"] == 0]
    assert len(reduce_waits) == 2 * 4 and all(e["tid"] == 0 for e in reduce_waits)


# -- the command line ----------------------------------------------------------------------------------
def test_the_distributed_optimizer_flag_is_stage_1_and_every_stage_shards_the_optimizer():
    assert parse(["--use-distributed-optimizer"]).data_parallel.zero_stage == 1
    for stage in STAGES:
        assert parse(["--zero-stage", str(stage)]).data_parallel.use_distributed_optimizer == (stage >= 1)
    assert parse(["--zero-stage", "3"]).data_parallel.zero_reshard_after_forward is True


@pytest.mark.parametrize("argv, says", [
    (["--use-distributed-optimizer", "--zero-stage", "0"], "--use-distributed-optimizer is ZeRO stage 1"),
    (["--zero-stage", "2", "--zero-reshard-after-forward", "false"], "apply to --zero-stage 3"),
    (["--zero-keep-params-for-step"], "apply to --zero-stage 3"),
    (["--zero-stage", "3", "--zero-reshard-after-forward", "maybe"], "expected true or false"),
])
def test_contradictory_zero_flags_are_refused_in_one_line(argv, says, capsys):
    from megalite import arguments
    from megalite.runtime import UsageError

    with pytest.raises((SystemExit, UsageError)) as e:  # the parser's line, or the configuration check's
        arguments.model_config(parse(argv))
    assert says in (str(e.value) if e.type is UsageError else capsys.readouterr().err)


def test_stage_3_with_torch_compile_is_refused_naming_the_alternative():
    from megalite import arguments
    from megalite.runtime import UsageError

    args = parse(["--zero-stage", "3", "--torch-compile"])
    with pytest.raises(UsageError, match="--zero-stage 2"):
        arguments.validate(args, 2, arguments.model_config(args))


# -- parameters a backward does not reach ---------------------------------------------------------
def skipping_backwards(rank, world, skipped):
    """Three linear layers, each its own stage-2 bucket; micro-batch i skips layer skipped[i] (None:
    none) on every rank. Returns (reduced gradient shards, plain autograd's gradients summed over
    ranks for the same elements, whether the buffer warned)."""
    import warnings

    import torch.distributed as dist

    from megalite.optim.zero import ShardedGradBuffer

    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
    reference = [p.detach().clone().requires_grad_() for p in layers.parameters()]
    buf = ShardedGradBuffer(list(layers.parameters()), param_dtype=torch.float32, grad_dtype=torch.float32,
                            bucket_numel=72, dp_group=dist.group.WORLD, dp_size=world)
    assert len(buf.buckets) == 3

    def forward(weights, x, skip):
        for k in range(3):
            if k != skip:
                x = torch.tanh(x @ weights[2 * k].t() + weights[2 * k + 1])
        return x.square().sum()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for micro_batch, skip in enumerate(skipped):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + micro_batch))
            forward(list(layers.parameters()), x, skip).backward()
            forward(reference, x, skip).backward()
        buf.finish_grad_sync()
    got, want = [], []
    for p, r in zip(layers.parameters(), reference):
        summed = torch.zeros(r.numel()) if r.grad is None else r.grad.reshape(-1).clone()
        dist.all_reduce(summed)
        lo, hi = buf.param_range(p)
        bucket = buf.bucket_of[id(p)]
        own_lo, own_hi = (bucket.start + x for x in buf.owned_range(bucket))
        a, b = max(lo, own_lo), min(hi, own_hi)
        if a < b:
            got.append(buf.grad_slice(a, b).clone())
            want.append(summed[a - lo:b - lo])
    return torch.cat(got), torch.cat(want), [str(w.message) for w in caught]


@pytest.mark.parametrize("skipped", [[1], [None, 1], [2, 0, None]],
                         ids=["middle-layer", "reached-then-not", "last-then-first"])
def test_stage_2_parameters_no_rank_reaches_add_nothing_and_are_warned_about_once(skipped):
    for got, want, warned in run_ranks(skipping_backwards, 2, args=(skipped,)):
        # Per micro-batch sums over ranks, then over micro-batches: the reference's order is the other.
        assert rel_err(got, want) <= 1e-6
        assert len(warned) == 1 and "not complete when this backward ended" in warned[0], warned


def warned_in_training(rank, world, argv):
    run = gpt_run(argv)
    return [buf.unreached_warned for buf in run.buffers]


@pytest.mark.parametrize("stage", [2, 3])
def test_every_gpt_backward_completes_every_bucket_so_nothing_is_warned(stage):
    argv = BASE + ["--pp", "2", "--train-iters", "1", "--eval-iters", "0", "--zero-stage", str(stage),
                   "--ddp-bucket-size", "3000"]
    for warned in run_ranks(warned_in_training, 4, args=(argv,)):
        assert warned == [False]


def test_in_backward_tells_forward_from_backward():
    from megalite.optim.zero import _in_backward

    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(_in_backward()))
    assert not _in_backward()
    y.sum().backward()
    assert seen == [True] and not _in_backward()


def test_stage_3_refuses_a_chunk_without_layers_naming_the_fix():
    from megalite.optim.zero import layer_units

    chunk = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="no `layers`.*--zero-stage 2"):
        layer_units(chunk, list(chunk.parameters()), lambda p: False)
