"""megalite.parallel.collectives: on gloo a reduce-scatter sends each chunk to its owner, every receive
posted before any send, and sums the chunks in a ring's order (the owner's chunk last), so it sends
(n - 1) / n of the input (gloo's own all-reduces all of it) and adds as --tp-comm-overlap's ring does,
whatever the bucket around it. An all-gather sends this rank's input to each peer, receives first."""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from megalite.parallel import collectives
from megalite.testing import run_ranks


@contextmanager
def posts_logged(native_name: str):
    """Inside: each batch of point-to-point ops megalite posts is logged as [(kind, peer), ...] in
    posting order, and each fallback to gloo's own collective `native_name` as "native"; yields
    (the log, the real native collective)."""
    calls, real_batch, real_native = [], dist.batch_isend_irecv, getattr(collectives, native_name)

    def batch(ops):
        calls.append([("recv" if op.op is dist.irecv else "send", op.peer) for op in ops])
        return real_batch(ops)
    dist.batch_isend_irecv = batch
    setattr(collectives, native_name, lambda *a, **k: calls.append("native") or real_native(*a, **k))
    try:
        yield calls, real_native
    finally:
        dist.batch_isend_irecv = real_batch
        setattr(collectives, native_name, real_native)


def reduce_scatter_cases(rank, world):
    with posts_logged("_native_reduce_scatter") as (calls, _):
        torch.manual_seed(rank)
        inp = torch.randn(world * 6, 3)
        gathered = [torch.empty_like(inp) for _ in range(world)]
        dist.all_gather(gathered, inp)
        out = torch.empty(6, 3)
        collectives.reduce_scatter_single(out, inp)  # synchronous
        # asynchronous, the output a view of the input (as ZeRO's buckets do)
        bucket = inp.reshape(-1).clone()
        shard = bucket[rank * 18:(rank + 1) * 18]
        work = collectives.reduce_scatter_single(shard, bucket, async_op=True)
        before_wait = shard.clone()
        work.wait()
        work.wait()  # a second wait sums nothing twice
        # a bf16 reduce-scatter and one with another op go their own ways
        half = torch.empty(6, 3, dtype=torch.bfloat16)
        collectives.reduce_scatter_single(half, inp.to(torch.bfloat16))
        n_before = len(calls)
        maxed = torch.empty(6, 3)
        collectives.reduce_scatter_single(maxed, inp, op=dist.ReduceOp.MAX)
        return dict(out=out, shard=shard, before_wait=before_wait, gathered=gathered, half=half, maxed=maxed,
                    calls=calls[:n_before], op_call=calls[n_before:])


def test_gloo_reduce_scatter_sends_each_chunk_to_its_owner_receives_first_and_sums_in_ring_order():
    world = 3
    results = run_ranks(reduce_scatter_cases, world)
    inputs = results[0]["gathered"]
    orders_differ = False
    for rank, got in enumerate(results):
        part = lambda r, dtype=torch.float32: inputs[r % world][rank * 6:(rank + 1) * 6].to(dtype)  # noqa: E731
        expected = part(rank - 1).clone()  # from the rank before the owner backwards, the owner last: bitwise
        for k in range(2, world):
            expected += part(rank - k)
        expected = part(rank) + expected
        orders_differ |= not torch.equal(part(0) + part(1) + part(2), expected)  # so the test tells them apart
        assert torch.equal(got["out"], expected)
        assert torch.equal(got["shard"].view(6, 3), expected)
        assert torch.equal(got["before_wait"].view(6, 3), inputs[rank][rank * 6:(rank + 1) * 6])  # summed on wait
        half_expected = part(rank - 1, torch.bfloat16).clone()
        for k in range(2, world):
            half_expected += part(rank - k, torch.bfloat16)
        half_expected = part(rank, torch.bfloat16) + half_expected
        assert torch.equal(got["half"], half_expected)
        peers = [r for r in range(world) if r != rank]
        # every chunk but its own to each peer, every receive posted before any send
        assert got["calls"] == [[("recv", r) for r in peers] + [("send", r) for r in peers]] * 3
        assert got["op_call"] == ["native"]
        assert torch.equal(got["maxed"], torch.stack(inputs)[:, rank * 6:(rank + 1) * 6].amax(0))
    assert orders_differ


def wrong_sizes(rank, world):
    try:
        collectives.reduce_scatter_single(torch.empty(5), torch.empty(world * 6))
    except ValueError as e:
        return str(e)
    return None


def test_a_reduce_scatter_whose_output_is_not_one_nth_of_the_input_is_refused():
    for message in run_ranks(wrong_sizes, 2):
        assert "12 elements, not 2 x the output's 5" in message


def ring_and_plain(rank, world):
    from megalite.parallel import tp_overlap

    got = {}
    for rows, width in ((3, 5), (1, 7), (8, 4)):  # shards of 15 and 7 floats too: not gloo-segment sized
        torch.manual_seed(100 + rank)
        partial = torch.randn(world * rows, width)
        got[(rows, width)] = [tp_overlap.reduce_scatter_rows(partial.clone(), dist.group.WORLD, overlap, lambda d: None)
                              for overlap in (False, True)]
    return got


def test_the_tp_overlap_ring_and_the_gloo_reduce_scatter_add_alike_at_tp_4_whatever_the_shard_size():
    for got in run_ranks(ring_and_plain, 4):
        for shape, (plain, ring) in got.items():
            assert torch.equal(plain, ring), shape


def exchanges_in_posting_order(rank, world):
    from megalite import parallel
    from megalite.parallel import context_parallel, tp_overlap
    from megalite.pipeline import p2p

    batches, real = [], dist.batch_isend_irecv

    def batch(ops):
        batches.append(["recv" if op.op is dist.irecv else "send" for op in ops])
        return real(ops)
    dist.batch_isend_irecv = batch
    try:
        parallel.initialize_model_parallel(1, 2)  # pp 2: the two ranks are neighbouring stages
        peer = 1 - rank
        x = torch.full((3,), float(rank))
        posted = p2p.exchange([p2p.Send(x, peer, 0)], [p2p.Recv("a", peer, 0)], (3,), torch.float32, "cpu", wait=False)
        posted.wait_received()
        pp_got = posted.buffers["a"].clone()
        posted.wait()
        ring = torch.empty(3)
        for w in context_parallel._start_exchange(x, ring, peer, peer, dist.group.WORLD, 7):
            w.wait()
        sp = torch.empty(3)
        for w in tp_overlap._exchange(x, peer, sp, peer, dist.group.WORLD):
            w.wait()
        parallel.destroy_model_parallel()
        return batches, pp_got, ring, sp
    finally:
        dist.batch_isend_irecv = real


def test_pipeline_cp_ring_and_tp_ring_exchanges_post_their_receives_before_their_sends():
    for rank, (batches, pp_got, ring, sp) in enumerate(run_ranks(exchanges_in_posting_order, 2)):
        assert batches == [["recv", "send"]] * 3, batches  # gloo: a receive behind a send waits for its bytes
        for got in (pp_got, ring, sp):
            assert torch.equal(got, torch.full((3,), float(1 - rank)))



def all_gather_cases(rank, world):
    with posts_logged("_native_all_gather") as (calls, real_native):
        torch.manual_seed(rank)
        inp = torch.randn(4, 3)
        native = torch.empty(world * 4, 3)
        real_native(native, inp)
        out = torch.empty(world * 4, 3)
        collectives.all_gather_single(out, inp)  # synchronous
        # asynchronous, in place: the input is this rank's slice of the output (ZeRO's buckets), bytes (FP8)
        whole = torch.zeros(world * 5, dtype=torch.uint8)
        whole[rank * 5:(rank + 1) * 5] = rank + 1
        work = collectives.all_gather_single(whole, whole[rank * 5:(rank + 1) * 5], async_op=True)
        done = []
        work.on_done(lambda: done.append(True))
        work.wait()
        work.wait()  # the callback runs once
        work.on_done(lambda: done.append("late"))  # registered after the wait: at once
        polled = work.poll()
        try:
            collectives.all_gather_single(torch.empty(world * 4, 3, dtype=torch.float64), inp)
            mixed = None
        except ValueError as e:
            mixed = str(e)
        n_before = len(calls)
        strided = torch.empty(3, world * 4).t()  # not contiguous: gloo's own
        collectives.all_gather_single(strided, inp)
        return dict(native=native, out=out, whole=whole, done=done, polled=polled, mixed=mixed, strided=strided.clone(),
                    calls=calls[:n_before], strided_call=calls[n_before:])


def test_gloo_all_gather_sends_its_input_to_each_peer_receives_first_and_equals_gloos_own():
    world = 3
    for rank, got in enumerate(run_ranks(all_gather_cases, world)):
        assert torch.equal(got["out"], got["native"])
        assert torch.equal(got["whole"], torch.arange(1, world + 1, dtype=torch.uint8).repeat_interleave(5))
        assert got["done"] == [True, "late"] and got["polled"]
        assert "the output is torch.float64, the input torch.float32" in got["mixed"]
        assert torch.equal(got["strided"], got["native"])
        peers = [r for r in range(world) if r != rank]
        assert got["calls"] == [[("recv", r) for r in peers] + [("send", r) for r in peers]] * 2
        assert got["strided_call"] == ["native"]
