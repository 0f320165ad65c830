"""The GEMMs of sequence-parallel linear layers, one sequence shard at a time, and (--tp-comm-overlap)
their collectives pipelined with them.

With sequence parallelism a column-parallel linear all-gathers its input along the sequence before
its GEMM and a row-parallel linear reduce-scatters its output after its GEMM; the backwards run the
conjugates (GEMM then reduce-scatter for the column layer's input gradient, all-gather then GEMM for
the row layer's). Each GEMM here runs as one GEMM per sequence shard (the rows one TP rank holds),
so each shard's communication can run while another shard is multiplied. With `overlap` the
collectives are rings of point-to-point sends over the TP group (batched isend/irecv: gloo runs
them on its own threads, NCCL on its own stream) and a rank multiplies the shard it holds while it
passes a shard on to its neighbour: every step's transfer hides behind a GEMM.

- all-gather + GEMM (`gather_rows`): at step i a rank multiplies the shard it received at step i-1
  (its own first) while sending that shard on to the next rank and receiving the next one.
- GEMM + reduce-scatter (`reduce_scatter_rows`): a shard's partial sums travel from the rank before
  its owner backwards round the ring to the owner; each rank adds its own partial, multiplied while
  the previous step's sum was in flight. In a column layer's backward the weight's gradient GEMM,
  which needs neither, runs while the last sum travels (else that sum had only one shard's GEMM).
- pieces (`--tp-comm-overlap-splits k`): each shard's rows in k pieces, each its own GEMM and its
  own transfer; a piece is passed on (or its running sum sent) as soon as it is there, so the GEMMs
  of a shard run beside the tail of that shard's own transfer instead of after all of it. At tp 2 a
  shard transfer T behind a shard GEMM G leaves T + G/k - 2G on the path instead of T - G.

Numbers. A GEMM over some rows is not bitwise those rows of the GEMM over all rows: BLAS libraries
pick kernels by shape (torch 2.13's MKL on a CPU, fp32: every 1-row shard, about half the shapes
tried with 2- to 12-row shards, some with 128-row ones; cuBLAS chooses by shape too). So with
sequence parallelism both paths, overlapped or not, run the same per-piece GEMMs on the same
operands at the same offsets (the pieces are the layer's, not the overlap's), and the weight
gradient stays one GEMM over the whole sequence. The gathers move bits; the ring adds a shard's
partials from the rank before the owner backwards to the owner, the order
megalite's gloo reduce-scatter adds in (parallel.collectives): bitwise at any tp on gloo, and at tp 2
on any backend (two terms commute). Bytes are counted as the plain collectives count them ("sp").
"""
from __future__ import annotations

from typing import Callable

import torch

from megalite.parallel import grad_accumulation, lanes, weight_grad
from megalite.parallel.collectives import exchange_receives_first
from megalite.parallel.mappings import (
    _check_sequence_splits,
    _group,
    _rank,
    _size,
    all_gather_single,
    count_sequence_collective,
    reduce_scatter_single,
)


def _exchange(send: torch.Tensor, to: int, recv: torch.Tensor, source: int, group) -> list:
    """Post a receive into `recv` from group rank `source` and a send of `send` to `to`, as one batch
    (NCCL needs the pair batched where every rank sends and receives at once), the receive first."""
    return exchange_receives_first([(recv, source)], [(send, to)], group)


def _wait(works: list) -> None:
    lanes.wait_all(works, "sp")


def piece_cuts(rows: int, pieces: int) -> list[slice]:
    """A shard's `rows` in `pieces` consecutive runs of near-equal size (as many as there are rows at
    most): the unit one GEMM multiplies and one transfer carries (`--tp-comm-overlap-splits`)."""
    k = max(1, min(pieces, rows))
    edges = [rows * i // k for i in range(k + 1)]
    return [slice(edges[i], edges[i + 1]) for i in range(k)]


def _rows_of(shard: int, rows: int, cut: slice) -> slice:
    return slice(shard * rows + cut.start, shard * rows + cut.stop)


def gather_rows(local: torch.Tensor, full: torch.Tensor, group, overlap: bool,
                use: Callable[[slice], None] | None = None, pieces: int = 1) -> torch.Tensor:
    """Fill `full` with every rank's `local` rows (contiguous; rank order) and call `use(r)` on each
    piece of rows r of each shard (`pieces` a shard) once it is there: after one all-gather, or
    (`overlap`) while the ring brings the next pieces, each piece passed on as soon as it arrives."""
    n, me, g = _size(group), _rank(group), _group(group)
    rows = local.shape[0]
    cuts = piece_cuts(rows, pieces)
    count_sequence_collective(group, full.nbytes)
    if not overlap or n == 1:
        lanes.collective(all_gather_single, full, local, group=g, kind="sp")
        for j in range(n if use is not None else 0):
            for cut in cuts:
                use(_rows_of(j, rows, cut))
        return full
    piece = lambda j, cut: full[_rows_of(j, rows, cut)]  # noqa: E731
    full[_rows_of(me, rows, slice(0, rows))].copy_(local)
    arriving: dict = {}  # (shard, piece) -> the exchange that receives it

    def pass_on(j: int, p: int, cut: slice) -> None:  # piece p of shard j on, shard j-1's in
        left = (j - 1) % n
        arriving[(left, p)] = _exchange(piece(j, cut), (me + 1) % n, piece(left, cut), (me - 1) % n, g)
    # Its own shard's pieces all go out before its GEMMs: each post between two GEMMs costs a switch
    # to the communication thread on a CPU (measured: 4 pieces of 256 rows, 31-33 ms a gather posted
    # one by one between the GEMMs, 27-28 ms posted first, 27.5 ms with no overlap at all)
    for p, cut in enumerate(cuts):
        pass_on(me, p, cut)
    for i in range(n):
        j = (me - i) % n  # the shard this rank holds at step i: its own, then its left neighbour's, ...
        for p, cut in enumerate(cuts):
            if i:
                _wait(arriving.pop((j, p)))
                if i < n - 1:
                    pass_on(j, p, cut)
            if use is not None:
                use(_rows_of(j, rows, cut))
    return full


def reduce_scatter_rows(partial: torch.Tensor, group, overlap: bool, make: Callable[[slice], None],
                        meanwhile: Callable[[], None] | None = None, pieces: int = 1) -> torch.Tensor:
    """This rank's shard of the sum over the group of every rank's `partial` (n shards of rows, rank
    order), which `make(r)` fills piece by piece (rows r; `pieces` a shard): all first, then one
    reduce-scatter, or (`overlap`) each piece made while earlier pieces' running sums are in flight.
    `meanwhile()`, work that needs neither, runs while the last running sums travel (after the
    reduce-scatter without overlap)."""
    n, me, g = _size(group), _rank(group), _group(group)
    rows = partial.shape[0] // n
    cuts = piece_cuts(rows, pieces)
    count_sequence_collective(group, partial.nbytes)
    if not overlap or n == 1:
        for d in range(n):
            for cut in cuts:
                make(_rows_of(d, rows, cut))
        out = partial.new_empty((rows, *partial.shape[1:]))
        lanes.collective(reduce_scatter_single, out, partial, group=g, kind="sp")
        if meanwhile is not None:
            meanwhile()
        return out
    piece = lambda d, cut: partial[_rows_of(d, rows, cut)]  # noqa: E731
    received = partial.new_empty((rows, *partial.shape[1:]))
    in_flight: dict = {}  # piece -> the exchange carrying its running sum (and receiving the next one's)
    for i in range(n - 1):
        d = (me + 1 + i) % n  # the shard whose running sums pass this rank at step i
        for p, cut in enumerate(cuts):
            make(_rows_of(d, rows, cut))
            if i:
                _wait(in_flight.pop(p))
                piece(d, cut).add_(received[cut])
            in_flight[p] = _exchange(piece(d, cut), (me - 1) % n, received[cut], (me + 1) % n, g)
    for cut in cuts:  # its own shard last: the sums arrive complete but for this rank's part
        make(_rows_of(me, rows, cut))
    if meanwhile is not None:
        meanwhile()
    for p in range(len(cuts)):
        _wait(in_flight.pop(p))
    return partial[_rows_of(me, rows, slice(0, rows))] + received  # new: must not keep the partial alive


def _grads_of_weight(ctx, dy: torch.Tensor, x: torch.Tensor):
    """dW = dy^T x over every row (one GEMM, as ever) and db = dy's column sums: handed to a
    zero-bubble W pass, written into the gradient buffer, or returned, as grad_accumulation.linear
    would have them (its fused backward and weight_grad's split one compute the same GEMMs)."""
    need_w, need_b = ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
    used_w, used_b = ctx.used
    ctx.used = None
    if ctx.split:
        return (weight_grad.give(used_w, need_w, lambda: dy.t().mm(x), (dy,)),
                weight_grad.give_cheap(used_b, need_b, lambda: dy.sum(0), (dy,)))
    if ctx.buffer is not None:
        dw = ctx.buffer.add_weight_grad(used_w, dy, x)
    else:
        dw = dy.t().mm(x) if need_w else None
    return dw, dy.sum(0) if need_b else None


def _rows_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias=None):
    """The GEMM of some rows r: out[r] = a[r] @ b (+ bias), written in place."""
    def gemm(r: slice) -> None:
        if bias is None:
            torch.mm(a[r], b, out=out[r])
        else:
            torch.addmm(bias, a[r], b, out=out[r])
    return gemm


def _keep(ctx, weight, bias, group, overlap: bool, pieces: int, buffer, split: bool) -> None:
    ctx.set_materialize_grads(False)  # no gradient (alike on every TP rank): no collective
    ctx.group, ctx.overlap, ctx.pieces, ctx.buffer, ctx.split = group, overlap, pieces, buffer, split
    ctx.used, ctx.has_bias = (weight, bias), bias is not None


# Both Functions take and return 2-D tensors (rows = sequence x batch): the caller's views are made
# outside, so a caller may modify an output in place (autograd forbids it on a view made inside).
class _GatherLinear(torch.autograd.Function):
    """y = all-gather(x) W^T + b along the rows; backward: the input gradient's per-piece GEMMs
    reduce-scattered, the weight's from the gathered input (saved, as F.linear saves it)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, overlap, pieces, buffer, split):
        _keep(ctx, weight, bias, group, overlap, pieces, buffer, split)
        x = x.contiguous()
        full = x.new_empty((_size(group) * x.shape[0], x.shape[1]))
        y = x.new_empty((full.shape[0], weight.shape[0]))
        gather_rows(x, full, group, overlap, _rows_gemm(full, weight.t(), y, bias), pieces)
        ctx.save_for_backward(full, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        if dy is None:
            ctx.used = None
            return (None,) * 8
        full, weight = ctx.saved_tensors
        dx, grads = None, []

        def weight_grads():  # needs neither dx nor its reduce-scatter: runs while the last sums travel
            grads.extend(_grads_of_weight(ctx, dy, full))
        if ctx.needs_input_grad[0]:
            partial = dy.new_empty((full.shape[0], weight.shape[1]))
            dx = reduce_scatter_rows(partial, ctx.group, ctx.overlap, _rows_gemm(dy, weight, partial),
                                     weight_grads, ctx.pieces)
        else:
            weight_grads()
        dw, db = grads
        return dx, dw, db, None, None, None, None, None


class _LinearReduceScatter(torch.autograd.Function):
    """y = reduce-scatter(x W^T) along the rows (partial sums over TP); backward: the output
    gradient all-gathered, the input gradient's GEMMs per piece, the weight's over every row."""

    @staticmethod
    def forward(ctx, x, weight, group, overlap, pieces, buffer, split):
        _keep(ctx, weight, None, group, overlap, pieces, buffer, split)
        partial = x.new_empty((x.shape[0], weight.shape[0]))
        out = reduce_scatter_rows(partial, group, overlap, _rows_gemm(x, weight.t(), partial), pieces=pieces)
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, dy):
        if dy is None:
            ctx.used = None
            return (None,) * 7
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        full = dy.new_empty((x.shape[0], dy.shape[1]))
        dx = x.new_empty(x.shape) if ctx.needs_input_grad[0] else None
        gather_rows(dy, full, ctx.group, ctx.overlap, None if dx is None else _rows_gemm(full, weight, dx),
                    ctx.pieces)
        dw, _ = _grads_of_weight(ctx, full, x)
        return dx, dw, None, None, None, None, None


def _gradient_route(weight: torch.Tensor):
    """(buffer, split) as grad_accumulation.linear(into_main_grad=True) decides them: a zero-bubble
    schedule's split ops, else the gradient buffer the weight's GEMM writes into, if any."""
    if weight_grad.splitting():
        return None, True
    return grad_accumulation._buffer_of(weight), False


def gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, overlap: bool,
                  group=None, pieces: int = 1) -> torch.Tensor:
    """A column-parallel linear under sequence parallelism: x [s / tp, ..., in] (this rank's part of
    the sequence) -> [s, ..., out / tp]; the all-gather pipelined with the GEMMs when `overlap`, each
    shard's rows multiplied (and, overlapped, sent) in `pieces` pieces."""
    y = _GatherLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias, group, overlap, pieces,
                            *_gradient_route(weight))
    return y.view(_size(group) * x.shape[0], *x.shape[1:-1], weight.shape[0])


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, overlap: bool, group=None,
                          pieces: int = 1) -> torch.Tensor:
    """A row-parallel linear's GEMM and reduce-scatter under sequence parallelism: x [s, ..., in / tp]
    -> [s / tp, ..., out] (no bias: it is added once, after the sum); pipelined when `overlap`, in
    `pieces` pieces a shard."""
    n = _check_sequence_splits(x, group)
    y = _LinearReduceScatter.apply(x.reshape(-1, x.shape[-1]), weight, group, overlap, pieces,
                                   *_gradient_route(weight))
    return y.view(x.shape[0] // n, *x.shape[1:-1], weight.shape[0])
