"""--tp-comm-overlap (issue #50): with sequence parallelism the all-gather before a column-parallel GEMM
and the reduce-scatter after a row-parallel one (and their conjugates backward) run as rings of sends
pipelined with per-shard GEMMs. Claims: the numbers are bitwise those of the run without it (layers
at tp 2 and 4, a GPT's gradients, training losses, gradient norms and weights); every transfer is in
flight while a GEMM runs; the bytes counted are the plain collectives'; no host sync is added; a
layout it cannot apply to is refused in one line."""
import pytest
import torch
import torch.nn.functional as F

from helpers import assert_rel_close, fresh_seed, gather_tp, tp_slice
from megalite import parallel
from megalite.errors import UsageError
from megalite.parallel import tp_overlap, traffic
from megalite.testing import run_ranks
from training_ranks import parse, train_params

S, B, H, FFN = 16, 2, 24, 40


def _pair(seed: int, overlap: bool, pieces: int = 1):
    """A column-parallel -> gelu -> row-parallel pair under SP (each shard's GEMMs in `pieces`): its
    output, input gradient, weight gradients and the bytes it counted (forward and backward)."""
    torch.manual_seed(seed)
    col = parallel.ColumnParallelLinear(H, FFN, sequence_parallel=True, tp_comm_overlap=overlap,
                                        tp_comm_overlap_splits=pieces)
    row = parallel.RowParallelLinear(FFN, H, sequence_parallel=True, tp_comm_overlap=overlap,
                                     tp_comm_overlap_splits=pieces)
    gen = torch.Generator().manual_seed(seed + 1)
    x_full, gy_full = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)
    x = tp_slice(x_full, 0).clone().requires_grad_()
    traffic.take()
    y = row(F.gelu(col(x)))
    (y * tp_slice(gy_full, 0)).sum().backward()
    grads = {f"{n}.{k}": p.grad.clone() for n, m in (("col", col), ("row", row)) for k, p in m.named_parameters()}
    return {"y": y.detach(), "dx": x.grad.clone(), "grads": grads, "bytes": traffic.take(),
            "modules": (col, row), "inputs": (x_full, gy_full)}


def _logging_ring(log: list):
    """Wrap the ring's steps and the GEMMs so a run leaves its order of events: X a transfer posted,
    W one waited for, G a GEMM, D a layer's weight gradients."""
    exchange, wait, mm, addmm = tp_overlap._exchange, tp_overlap._wait, torch.mm, torch.addmm
    weight_grads = tp_overlap._grads_of_weight

    def logged(tag, fn):
        def call(*a, **k):
            log.append(tag)
            return fn(*a, **k)
        return call
    tp_overlap._exchange, tp_overlap._wait = logged("X", exchange), logged("W", wait)
    torch.mm, torch.addmm = logged("G", mm), logged("G", addmm)
    tp_overlap._grads_of_weight = logged("D", weight_grads)
    return lambda: (setattr(tp_overlap, "_exchange", exchange), setattr(tp_overlap, "_wait", wait),
                    setattr(torch, "mm", mm), setattr(torch, "addmm", addmm),
                    setattr(tp_overlap, "_grads_of_weight", weight_grads))


def _layer_matrix(rank, world, seed):
    from megalite.testing import count_host_syncs

    out = {}
    # 3 pieces of a tp-4 shard's 8 rows: 2, 3 and 3 (uneven on purpose)
    for tp, pieces in ((2, 1), (4, 1), (2, 3), (4, 3)):
        parallel.initialize_model_parallel(tp)
        plain = _pair(seed, False, pieces)
        log: list = []
        restore = _logging_ring(log)
        try:
            with count_host_syncs() as syncs:
                overlapped = _pair(seed, True, pieces)
        finally:
            restore()
        # The per-shard GEMMs compute the layer pair's function (to rounding: not one GEMM over all rows).
        col, row = plain["modules"]
        x_full, gy_full = plain["inputs"]
        w1, b1 = gather_tp(col.weight, 0), gather_tp(col.bias, 0)
        w2 = gather_tp(row.weight, 1)
        assert_rel_close(plain["y"], tp_slice(F.linear(F.gelu(F.linear(x_full, w1, b1)), w2, row.bias), 0),
                         what=f"tp {tp} output")
        same = [k for k in ("y", "dx") if torch.equal(plain[k], overlapped[k])]
        same += sorted(k for k, g in plain["grads"].items() if torch.equal(g, overlapped["grads"][k]))
        out[tp, pieces] = {"same": same, "bytes": (plain["bytes"], overlapped["bytes"]), "events": "".join(log),
                   "syncs": syncs.calls, "grads": sorted(plain["grads"])}
        parallel.destroy_model_parallel()
    return out


def test_layers_at_tp_2_and_4_give_bitwise_the_plain_numbers_with_transfers_behind_gemms():
    for rank, out in enumerate(run_ranks(_layer_matrix, 4, args=(fresh_seed(),))):
        for (tp, pieces), r in out.items():
            assert r["same"] == ["y", "dx", *r["grads"]], (rank, tp, pieces, r["same"])
            plain, overlapped = r["bytes"]
            # Two gathers and two reduce-scatters of [S, B, H] fp32, (tp-1)/tp of each sent.
            assert plain == overlapped == {"sp": 4 * S * B * H * 4 * (tp - 1) // tp}, (plain, overlapped)
            assert r["syncs"] == []
            events = r["events"]
            # Four rings (gather and reduce-scatter forward, their conjugates backward) of tp-1
            # transfers a piece each; every transfer is posted, then a GEMM runs, then it is waited for.
            assert events.count("X") == events.count("W") == 4 * (tp - 1) * pieces, events
            assert "XW" not in events and events.startswith("X" * pieces + "G"), events
            # The first gather: the own shard's pieces all sent, then multiplied; then each piece that
            # arrives waited for and multiplied (and passed on) before the next piece is waited for.
            ring = ("X" * pieces + "G" * pieces + "WXG" * pieces * (tp - 2) + "WG" * pieces)
            assert events.startswith(ring), (tp, pieces, events[:len(ring)])
            # The column layer's backward (the last ring) computes its weight gradients while its
            # last partial sum travels; the row layer's need the whole gathered gradient, after its ring.
            assert events.count("D") == 2 and events.rindex("X") < events.rindex("D") < events.rindex("W"), events


def _gpt_gradients(overlap: bool, seed: int):
    from megalite.models import GPTModel, TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100,
                               max_position_embeddings=16, hidden_dropout=0.1, attention_dropout=0.1,
                               sequence_parallel=True, tp_comm_overlap=overlap)
    parallel.model_parallel_manual_seed(seed)
    model = GPTModel(config, seed=seed).train()
    gen = torch.Generator().manual_seed(seed + 1)
    ids, labels = torch.randint(0, 100, (3, 16), generator=gen), torch.randint(0, 100, (3, 16), generator=gen)
    loss = model(ids, labels=labels)
    loss.sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _gpt_and_training(rank, world, seed, argv, sync_argv):
    from megalite import runtime
    from megalite.testing import count_host_syncs

    parallel.initialize_model_parallel(world)
    grads = [_gpt_gradients(overlap, seed) for overlap in (False, True)]
    parallel.destroy_model_parallel()
    splits = ["--tp-comm-overlap-splits", "3"]
    runs = _trainings(rank, world, [argv, argv + ["--tp-comm-overlap"], argv + splits,
                                    argv + splits + ["--tp-comm-overlap"]], fuse=False)
    with count_host_syncs(label=lambda: runtime._PHASE[0]) as seen:
        train_params(rank, world, sync_argv)
    steady = seen.during(lambda phase: phase.startswith(("iteration 2:", "iteration 3:")))
    return grads, runs, steady


TRAIN = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--hidden-dropout", "0.1",
         "--attention-dropout", "0.1", "--eval-interval", "0", "--sequence-parallel"]


def _assert_same_training(plain, overlapped):
    assert len(plain["records"]) == len(overlapped["records"]) > 0
    for a, b in zip(plain["records"], overlapped["records"]):
        for key in ("loss", "grad_norm", "comm_bytes"):
            assert a[key] == b[key], (key, a[key], b[key])
    for name, p in plain["params"].items():
        assert torch.equal(p, overlapped["params"][name]), name


def test_a_tiny_gpt_trains_bitwise_alike_with_and_without_overlap_and_makes_no_host_sync():
    argv = TRAIN + ["--tp", "2", "--train-iters", "3", "--log-interval", "1"]
    sync_argv = TRAIN + ["--tp", "2", "--train-iters", "4", "--log-interval", "4", "--tp-comm-overlap"]
    for rank, (grads, runs, steady) in enumerate(run_ranks(_gpt_and_training, 2,
                                                           args=(fresh_seed(), argv, sync_argv))):
        (loss_a, grads_a), (loss_b, grads_b) = grads
        assert torch.equal(loss_a, loss_b)
        assert [n for n, g in grads_a.items() if not torch.equal(g, grads_b[n])] == []
        _assert_same_training(*runs[:2])
        _assert_same_training(*runs[2:])  # --tp-comm-overlap-splits 3, without and with the overlap
        assert runs[0]["records"][0]["comm_bytes"]["sp"] > 0
        assert runs[0]["transfers"] == runs[2]["transfers"] == 0 < runs[1]["transfers"]
        assert runs[3]["transfers"] == 3 * runs[1]["transfers"]  # a transfer a piece
        # Other pieces, other GEMM shapes: the same function, to rounding
        for a, b in zip(runs[0]["records"], runs[2]["records"]):
            assert_rel_close(torch.tensor(b["loss"]), torch.tensor(a["loss"]), what="splits loss")
        assert runs[0]["routes"] == runs[1]["routes"] == {(False, False)}  # autograd takes the gradients
        assert steady == [], f"rank {rank}: {steady[:10]}"


def _trainings(rank, world, argvs, fuse=True):
    """Each run's parameters and records, the transfers its rings posted and how its weight gradients
    went (split for a W pass; written into the gradient buffer)."""
    from megalite.parallel import grad_accumulation

    if fuse:  # every weight's gradient written by its GEMM into the buffer
        grad_accumulation.MIN_FUSED_NUMEL = 0
    exchange, grads_of_weight = tp_overlap._exchange, tp_overlap._grads_of_weight
    runs = []
    for argv in argvs:
        seen = {"transfers": 0, "routes": set()}

        def counted(*a, seen=seen):
            seen["transfers"] += 1
            return exchange(*a)

        def routed(ctx, *a, seen=seen):
            seen["routes"].add((ctx.split, ctx.buffer is not None))
            return grads_of_weight(ctx, *a)
        tp_overlap._exchange, tp_overlap._grads_of_weight = counted, routed
        try:
            runs.append({**train_params(rank, world, argv), **seen})
        finally:
            tp_overlap._exchange, tp_overlap._grads_of_weight = exchange, grads_of_weight
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tp", "4"], ["--tp", "2", "--pp", "2", "--pipeline-schedule", "zb-h1",
                                                    "--recompute", "full"]], ids=["tp4", "tp2-pp2-zb-recompute"])
def test_overlap_is_bitwise_at_tp4_and_under_split_backward_recompute_and_fused_weight_gradients(layout):
    argv = TRAIN + layout + ["--train-iters", "2", "--log-interval", "1", "--global-batch-size", "8"]
    split = "zb-h1" in layout
    for plain, overlapped in run_ranks(_trainings, 4, args=([argv, argv + ["--tp-comm-overlap"]],)):
        _assert_same_training(plain, overlapped)
        assert plain["transfers"] == 0 < overlapped["transfers"]
        # zb-h1 hands weight gradients to its W passes; 1F1B writes them into the buffer.
        assert plain["routes"] == overlapped["routes"] == {(split, not split)}, overlapped["routes"]


@pytest.mark.parametrize("argv", [["--tp", "2"], ["--tp", "1", "--sequence-parallel"]], ids=["no-sp", "tp1"])
def test_a_layout_without_sequence_parallel_shards_is_refused_in_one_line(argv):
    from megalite.config import model_config

    with pytest.raises(UsageError) as e:
        model_config(parse(argv + ["--tp-comm-overlap"]))
    assert str(e.value) == ("--tp-comm-overlap overlaps sequence parallelism's all-gathers and reduce-scatters "
                            "with the GEMMs: it needs --tp 2 or more and --sequence-parallel")


def test_splits_without_sequence_parallel_shards_or_below_one_are_refused_in_one_line():
    from megalite.config import model_config

    with pytest.raises(UsageError) as e:
        model_config(parse(["--tp", "2", "--tp-comm-overlap-splits", "2"]))
    assert str(e.value) == ("--tp-comm-overlap-splits cuts each sequence shard's GEMMs and transfers into pieces: "
                            "it needs --tp 2 or more and --sequence-parallel, and a value >= 1")
    with pytest.raises(UsageError, match="^--tp-comm-overlap-splits must be an integer >= 1, got 0$"):
        model_config(parse(["--tp", "2", "--sequence-parallel", "--tp-comm-overlap-splits", "0"]))
    with pytest.raises(ValueError, match="tp_comm_overlap_splits .* needs sequence_parallel=True"):
        parallel.ColumnParallelLinear(8, 8, tp_comm_overlap_splits=2, device="cpu")


def test_pieces_are_near_equal_runs_of_a_shards_rows():
    assert tp_overlap.piece_cuts(8, 3) == [slice(0, 2), slice(2, 5), slice(5, 8)]
    assert tp_overlap.piece_cuts(2, 4) == [slice(0, 1), slice(1, 2)]  # never an empty piece
    assert tp_overlap.piece_cuts(5, 1) == [slice(0, 5)]


def test_the_layers_refuse_overlap_without_sequence_parallelism():
    with pytest.raises(ValueError, match="tp_comm_overlap .* needs sequence_parallel=True"):
        parallel.RowParallelLinear(8, 8, tp_comm_overlap=True, device="cpu")
