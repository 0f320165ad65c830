"""The single-tensor all-gather and reduce-scatter every megalite module issues (sequence parallelism,
the EP all-gather dispatcher, ZeRO's buckets and gathers), one place that knows the backends.

gloo has no reduce-scatter of its own: torch's gloo process group all-reduces the whole input and
keeps this rank's chunk, so every rank sends 2 (n - 1) / n of the input instead of (n - 1) / n.
Measured here (2 namespaces over a 300 Mbit/s tbf link, 2026-12-02): a reduce-scatter of 4 MiB took
120 ms, the time of a 4 MiB all-reduce (117 ms), where its 2 MiB need 56 ms. On gloo megalite sends
each rank's chunk to its owner (exactly (n - 1) / n of the input on the wire) and sums the n chunks
that arrive in a ring's order: from the rank before the owner backwards round the ring, the
owner's own chunk last. That is the order gloo's ring adds a chunk in, and the order of
--tp-comm-overlap's ring (parallel.tp_overlap), so the two paths stay bitwise at any tp and any shard
size, and a bucket's sums do not depend on where gloo's segments fall.
NCCL (and anything else) keeps its own reduce-scatter, as does a collective traced by torch.compile.
The all-gather on gloo is point-to-point too (`all_gather_single`), for the order below.

The chunks travel as point-to-point messages, every receive posted before any send. gloo sends a
message only once the peer has said its receive is posted, and says so on the same connection as its
data: a receive posted after a send can wait behind that send's bytes, and the peer's send behind it,
so the two directions go one after the other. Measured across the 300 Mbit/s link (2026-12-02): a
4 MiB exchange each way, send first, took up to 233-246 ms in 20 calls, twice the 116 ms its bytes
need; receive first, at most 134-150 ms.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# torch >= 2.12 renamed the single-tensor collectives; keep working on older releases.
_native_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_native_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _sum_in_ring_order(chunks: torch.Tensor, owner: int, out: torch.Tensor) -> None:
    """out = chunks[owner] + (... + (chunks[owner - 2] + chunks[owner - 1])): the order a ring adds them."""
    n, flat = chunks.shape[0], out.view(-1)
    if n == 1:
        flat.copy_(chunks[0])
        return
    running = chunks[(owner - 1) % n].clone()
    for k in range(2, n):
        running.add_(chunks[(owner - k) % n])
    torch.add(chunks[owner], running, out=flat)


class _SumOnWait:
    """The chunks' messages in flight; waiting for them also sums the chunks into `out` (once)."""

    def __init__(self, works: list, chunks: torch.Tensor, owner: int, out: torch.Tensor):
        self.works, self.chunks, self.owner, self.out = works, chunks, owner, out

    def wait(self, timeout=None) -> bool:
        if self.works is not None:
            for work in self.works:
                work.wait()
            _sum_in_ring_order(self.chunks, self.owner, self.out)
            self.works, self.chunks = None, None
        return True

    def is_completed(self) -> bool:
        """Whether every message is in (the sum is still `wait`'s to do)."""
        return self.works is None or all(work.is_completed() for work in self.works)


def exchange_receives_first(recvs: list[tuple[torch.Tensor, int]], sends: list[tuple[torch.Tensor, int]],
                            group) -> list:
    """Post every receive (into tensor, from group rank), then every send (tensor, to group rank), as
    one batch; the requests, receives first. The order is why (module docstring)."""
    ops = [dist.P2POp(dist.irecv, t, group=group, group_peer=peer) for t, peer in recvs]
    ops += [dist.P2POp(dist.isend, t, group=group, group_peer=peer) for t, peer in sends]
    return dist.batch_isend_irecv(ops) if ops else []


def _on_gloo(group) -> bool:
    try:
        return dist.get_backend(group) == "gloo"
    except (RuntimeError, ValueError):  # not a process group torch knows (a test's stand-in)
        return False


class _AllDone:
    """Point-to-point requests in flight, waited for as one collective's work. gloo's requests have
    no future: `on_done(fn)` calls fn once they are seen done, by `poll()` (a timeline polls at each
    unit's use) or at the latest by `wait()`; at once if they already were."""

    def __init__(self, works: list):
        self.works, self.callbacks, self.done = works, [], False

    def on_done(self, fn) -> None:
        if self.done:
            fn()
        else:
            self.callbacks.append(fn)

    def _finish(self) -> None:
        self.done, self.works = True, []
        for fn in self.callbacks:
            fn()
        self.callbacks = []

    def poll(self) -> bool:
        """Whether every request is done (calling the callbacks the first time it is), without waiting."""
        if not self.done and all(work.is_completed() for work in self.works):
            self._finish()
        return self.done

    def wait(self, timeout=None) -> bool:
        for work in self.works:
            work.wait()
        if not self.done:
            self._finish()
        return True

    is_completed = poll


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """`out` = every rank's `inp` of `group`, in rank order (torch.distributed's signature); on gloo
    this rank's input sent to each peer and each peer's received into its place, receives first.
    gloo's own all-gather posts its sends first, so its two directions can go one after the other
    (module docstring): across the 300 Mbit/s link, 4 MiB a rank took a median of 175.6 ms with
    gloo's, 118.7 ms with this, 117 at the link's rate (scripts/gloo_exchanges.py, 2026-12-03,
    docs/communication.md). A copy, so bitwise either way."""
    if torch.compiler.is_compiling() or not _on_gloo(group) or not out.is_contiguous() or out.numel() == 0:
        return _native_all_gather(out, inp, group=group, async_op=async_op)
    if out.dtype != inp.dtype:
        raise ValueError(f"all_gather_single: the output is {out.dtype}, the input {inp.dtype}: give both one dtype")
    n = dist.get_world_size(group)
    if out.numel() != n * inp.numel():
        raise ValueError(f"all_gather_single: the output holds {out.numel()} elements, not {n} x the "
                         f"input's {inp.numel()}")
    me, places = dist.get_rank(group), out.view(n, -1)
    mine = inp.contiguous().view(-1)
    places[me].copy_(mine)
    peers = [r for r in range(n) if r != me]
    pending = _AllDone(exchange_receives_first([(places[r], r) for r in peers], [(mine, r) for r in peers], group))
    if async_op:
        return pending
    pending.wait()
    return None


def reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, group=None, op=dist.ReduceOp.SUM,
                          async_op: bool = False):
    """`out` = this rank's 1/n of `inp` summed over `group` (torch.distributed's signature); on gloo
    each chunk sent to its owner, receives first, and summed there in a ring's order (the module
    docstring says why)."""
    if op != dist.ReduceOp.SUM or torch.compiler.is_compiling() or not _on_gloo(group) \
            or not out.is_contiguous():
        return _native_reduce_scatter(out, inp, group=group, op=op, async_op=async_op)
    n = dist.get_world_size(group)
    if inp.numel() != n * out.numel():
        raise ValueError(f"reduce_scatter_single: the input holds {inp.numel()} elements, not {n} x the "
                         f"output's {out.numel()}")
    me, whole = dist.get_rank(group), inp.contiguous().view(n, -1)
    chunks = inp.new_empty((n, out.numel()))
    chunks[me].copy_(whole[me])
    peers = [r for r in range(n) if r != me]
    works = exchange_receives_first([(chunks[r], r) for r in peers], [(whole[r], r) for r in peers], group)
    pending = _SumOnWait(works, chunks, me, out)
    if async_op:
        return pending
    pending.wait()
    return None

