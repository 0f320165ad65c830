"""Stage-to-stage transfers of activations (forward) and their gradients (backward).

Shapes are known in advance ([seq (/tp with sequence parallelism), micro-batch, hidden]), so no
shape handshake precedes a transfer. All sends and receives of one exchange point go out as one
batch (`batch_isend_irecv`): under NCCL a lone send to a neighbour that is itself sending to us
would wait forever; batched, both progress. Forward and backward messages carry different tags so
that gloo never confuses them when two stages exchange both kinds (pp=2 with virtual stages). NCCL
ignores tags and matches each pair of ranks' sends and receives in posting order: the schedules
post in an order that is right under that rule too, which `megalite.pipeline.replay` checks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite import faults
from megalite.parallel import state, traffic

FORWARD_TAG, BACKWARD_TAG = 0, 1


@dataclass
class Send:
    tensor: torch.Tensor
    peer: int  # global rank
    tag: int


@dataclass
class Recv:
    key: tuple  # what the received tensor is, for the caller
    peer: int
    tag: int


class Posted:
    """One exchange point's batch, in flight: its received tensors (by key) are valid after
    `wait_received` (or `wait`), and its sent tensors are kept alive until `wait_sent` (or `wait`).
    Where the backend gives each op its own request (gloo) the two are waited for apart, so the
    sends drain while the rank computes; a batch completed as one (NCCL's group) is waited for whole."""

    def __init__(self, works, buffers: dict[tuple, torch.Tensor], sent: list[torch.Tensor]):
        self.buffers, self.sent = buffers, sent
        self.whole = len(works) != len(sent) + len(buffers)
        self.recv_works = works if self.whole else works[:len(buffers)]  # (posted first: `exchange`)
        self.send_works = [] if self.whole else works[len(buffers):]
        self.received = not buffers

    def wait_received(self) -> None:
        if self.received:
            return
        if self.whole:
            self.wait()
            return
        for work in self.recv_works:
            work.wait()
        self.recv_works, self.received = [], True

    def wait_sent(self) -> None:
        if self.whole:
            self.wait()
            return
        for work in self.send_works:
            work.wait()
        self.send_works, self.sent = [], []

    def wait(self) -> None:
        for work in (*self.recv_works, *self.send_works):
            work.wait()
        self.recv_works, self.send_works, self.sent, self.received = [], [], [], True


def exchange(sends: list[Send], recvs: list[Recv], shape, dtype, device, wait: bool = True):
    """Post every send and receive together as one batch. With `wait`, wait for all and return the
    received tensors by key; else return the batch in flight (`Posted`): the caller waits for it
    before reading what it received, and may compute meanwhile (the W passes of a zero-bubble
    schedule run while the gradient they follow is on its way)."""
    if not sends and not recvs:
        return {} if wait else Posted([], {}, [])
    faults.point("p2p")
    group = state.get_pipeline_model_parallel_group()
    buffers = {r.key: torch.empty(shape, dtype=dtype, device=device) for r in recvs}
    # Aliases of their own (detach: the same storage, another tensor): the executor frees a sent
    # output's data at once (`executor._free_data` swaps the tensor's storage), and the alias keeps
    # the bytes a send in flight reads alive until the batch's sends are waited for.
    sent = [s.tensor.detach().contiguous() for s in sends]
    # The receives first, then the sends (`Posted.wait_received` tells them apart by position): gloo
    # sends a posted receive's "ready" notice on the connection the data takes, so a receive posted
    # after a send waits behind that send's bytes, and the peer's send behind it: both directions
    # one after the other (parallel.collectives says more)
    ops = [dist.P2POp(dist.irecv, buffers[r.key], r.peer, group, r.tag) for r in recvs]
    ops += [dist.P2POp(dist.isend, t, s.peer, group, s.tag) for t, s in zip(sent, sends)]
    for s in sends:
        traffic.send("pp", s.tensor.nbytes)
    posted = Posted(dist.batch_isend_irecv(ops), buffers, sent)
    if not wait:
        return posted
    posted.wait()
    return buffers
