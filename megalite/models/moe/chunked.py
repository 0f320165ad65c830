"""The all-to-all dispatcher's exchanges in chunks (`--moe-dispatch-chunks N`): a rank's local experts
in N groups, each group's rows sent, computed and sent back on their own, so that one group's experts
compute while the next group's rows are on the link, and its outputs travel back while the next
group computes. Backward runs the same pipeline the other way round.

The numbers are the unchunked dispatcher's, bit for bit: an expert's rows are the same rows in the
same order, its GEMMs the same GEMMs (a group's experts are a slice of the grouped weights), the
rows leave and come home through permutations (each row once: exact), and the weighted sum per
token runs once over every row in the unchunked order.

The exchanges are posted to the lane's queue (`lanes.post`: one on the link at a time, in order) by
four autograd functions that share one `_Chunks`:
- `_Dispatch` posts every group's rows forward; backward it waits for the groups' row gradients
  (posted by `_Arrive`) and joins them.
- `_Arrive` waits for a group's rows before its experts; backward it posts the group's row gradients
  home as soon as the experts' backward has made them.
- `_Leave` posts a group's outputs home as soon as its experts are done; backward it waits for the
  group's output gradients (posted by `_Return`).
- `_Return` waits for every group's outputs and joins them; backward it posts every group's output
  gradients, in the order autograd runs the groups' backwards (the last group first).
Each backward returns what autograd expects of it (a tensor of its output's shape); the gradients
themselves travel through the `_Chunks`, so a function never reads a buffer before its wait.
"""
from __future__ import annotations

import torch

from megalite.parallel.mappings import post_rows


def expert_groups(local: int, chunks: int) -> list[tuple[int, int]]:
    """[lo, hi) local experts of each of `chunks` groups, as even as integers allow."""
    bounds = [round(i * local / chunks) for i in range(chunks + 1)]
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


class _Chunks:
    """One MoE layer call's groups: the rows each sends (`send[g][r]`: to EP rank r) and receives
    (`recv[g][r]`), and the exchanges in flight."""

    def __init__(self, group, send: list[list[int]], recv: list[list[int]]):
        self.group, self.send, self.recv = group, send, recv
        n = len(send)
        self.rows_in = [None] * n  # forward: the posted rows of each group
        self.outputs_home = [None] * n  # forward: the posted outputs
        self.grads_home = [None] * n  # backward: (buffer, posted) row gradients on their way home
        self.grads_out = [None] * n  # backward: (buffer, posted) output gradients on their way out


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, chunks: _Chunks):
        ctx.chunks = chunks
        out = []
        for g, piece in enumerate(rows.split([sum(s) for s in chunks.send])):
            buffer, chunks.rows_in[g] = post_rows(piece, chunks.group, chunks.recv[g], chunks.send[g])
            out.append(buffer)
        return tuple(out)

    @staticmethod
    def backward(ctx, *_):
        chunks = ctx.chunks
        if any(x is None for x in chunks.grads_home):
            raise RuntimeError("a group's experts ran no backward: every group must, on every rank")
        for _, posted in chunks.grads_home:
            posted.wait()
        grad = torch.cat([buffer for buffer, _ in chunks.grads_home])
        chunks.grads_home = [None] * len(chunks.send)
        return grad, None


class _Arrive(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, chunks: _Chunks, g: int):
        ctx.chunks, ctx.g = chunks, g
        chunks.rows_in[g].wait()
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):
        chunks, g = ctx.chunks, ctx.g
        chunks.grads_home[g] = post_rows(grad, chunks.group, chunks.send[g], chunks.recv[g])
        return grad, None, None  # (of the right shape; _Dispatch takes the posted gradient)


class _Leave(torch.autograd.Function):
    @staticmethod
    def forward(ctx, outputs, chunks: _Chunks, g: int):
        ctx.chunks, ctx.g = chunks, g
        buffer, chunks.outputs_home[g] = post_rows(outputs, chunks.group, chunks.send[g], chunks.recv[g])
        return buffer

    @staticmethod
    def backward(ctx, _):
        chunks, g = ctx.chunks, ctx.g
        buffer, posted = chunks.grads_out[g]
        posted.wait()
        chunks.grads_out[g] = None
        return buffer, None, None


class _Return(torch.autograd.Function):
    @staticmethod
    def forward(ctx, chunks: _Chunks, *outputs):
        ctx.chunks = chunks
        for posted in chunks.outputs_home:
            posted.wait()
        return torch.cat(outputs)

    @staticmethod
    def backward(ctx, grad):
        chunks = ctx.chunks
        pieces = grad.split([sum(s) for s in chunks.send])
        # autograd runs the group built last first (the highest sequence number): post in that order
        for g in reversed(range(len(pieces))):
            chunks.grads_out[g] = post_rows(pieces[g], chunks.group, chunks.recv[g], chunks.send[g])
        return (None, *pieces)  # (of the right shapes; each _Leave takes its posted gradient)


def dispatch_in_chunks(rows: torch.Tensor, group, send: list[list[int]], recv: list[list[int]],
                       compute) -> torch.Tensor:
    """rows [sum of send, hidden], grouped by chunk then destination -> the experts' outputs in the
    same order. compute(g, received rows of group g) -> outputs for those rows."""
    chunks = _Chunks(group, send, recv)
    arriving = _Dispatch.apply(rows, chunks)
    leaving = []
    for g, buffer in enumerate(arriving):
        outputs = compute(g, _Arrive.apply(buffer, chunks, g))
        leaving.append(_Leave.apply(outputs, chunks, g))
    return _Return.apply(chunks, *leaving)
