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


def exchange(sends: list[Send], recvs: list[Recv], shape, dtype, device) -> dict[tuple, torch.Tensor]:
    """Post every send and receive together, wait for all; return the received tensors by key."""
    if not sends and not recvs:
        return {}
    faults.point("p2p")
    group = state.get_pipeline_model_parallel_group()
    buffers = {r.key: torch.empty(shape, dtype=dtype, device=device) for r in recvs}
    ops = [dist.P2POp(dist.isend, s.tensor.contiguous(), s.peer, group, s.tag) for s in sends]
    for s in sends:
        traffic.send("pp", s.tensor.nbytes)
    ops += [dist.P2POp(dist.irecv, buffers[r.key], r.peer, group, r.tag) for r in recvs]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return buffers
