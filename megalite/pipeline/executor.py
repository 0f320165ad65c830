"""The executor: `run_schedule` runs one rank's schedule program (`programs`), posting at each
exchange point the sends and receives of the rank's exchange plan (`replay`)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from megalite.parallel import lanes, state, weight_grad
from megalite.pipeline import p2p
from megalite.pipeline.partition import stage_rank, virtual_stage
from megalite.pipeline.programs import Op
from megalite.pipeline.replay import Message, exchange_plan, incoming, is_local, outgoing

ForwardStep = Callable[[torch.nn.Module, dict], torch.Tensor]


@dataclass
class ScheduleStats:
    loss_sum: torch.Tensor  # summed loss over this rank's micro-batches (last stage; 0 elsewhere)
    peak_in_flight: int = 0  # micro-batches forwarded but not yet backwarded, at most
    peak_stash_bytes: int = 0  # bytes of the inputs and outputs kept for backward, at most
    busy_s: float = 0.0  # time in forward and backward passes
    wall_s: float = 0.0
    spans: list = field(default_factory=list)  # (name, category, start_s, duration_s)


_TAGS = {"F": p2p.FORWARD_TAG, "B": p2p.BACKWARD_TAG}
SENDS_IN_FLIGHT = 2  # exchange points' batches whose sends may still drain when the next is posted


class _Receives:
    """A posted batch's receives, as one request to wait for."""

    def __init__(self, posted: p2p.Posted):
        self.posted = posted

    def wait(self) -> None:
        self.posted.wait_received()

    def is_completed(self) -> bool:
        posted = self.posted
        return posted.received or all(work.is_completed() for work in posted.recv_works)


def _free_data(out: torch.Tensor | None) -> None:
    """Release an output's storage but keep its autograd graph and shape: a 1-element tensor
    expanded to the shape stands in (backward checks the gradient's shape against it, reads no
    data). Views are left alone: their memory belongs to their base."""
    if out is None or out._base is not None or out.numel() <= 1:
        return
    out.data = torch.empty(1, dtype=out.dtype, device=out.device).expand(out.shape)


def _held_bytes(stash: dict) -> int:
    """Bytes of the distinct storages behind the tensors in the stash."""
    storages = {}
    for pair in stash.values():
        for t in pair:
            if t is not None:
                s = t.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


class _Recorder:
    def __init__(self, stats: ScheduleStats, record_spans: bool, sync_cuda: bool):
        self.stats, self.record_spans, self.sync_cuda = stats, record_spans, sync_cuda

    def span(self, name: str, category: str, row: int | None = None):
        return _Span(self, name, category, row)


class _Span:
    def __init__(self, rec: _Recorder, name: str, category: str, row: int | None = None):
        self.rec, self.name, self.category, self.row = rec, name, category, row

    def __enter__(self):
        if self.rec.sync_cuda:
            torch.cuda.synchronize()
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        if self.rec.sync_cuda:
            torch.cuda.synchronize()
        dur = time.perf_counter() - self.start
        if self.category in ("forward", "backward", "weight-grad") and lanes.lane() is None:
            self.rec.stats.busy_s += dur  # (an overlapped pair counts once, as a whole)
        if self.rec.record_spans:
            span = (self.name, self.category, self.start, dur)
            self.rec.stats.spans.append(span if self.row is None else span + (self.row,))


def run_schedule(
    program: Sequence[Op],
    model_chunks: Sequence[torch.nn.Module],
    micro_batches: Sequence[dict],
    forward_step: ForwardStep,
    num_tokens: torch.Tensor,
    tensor_shape,
    dtype: torch.dtype,
    record_spans: bool = False,
    loss_scale: float = 1.0,
    on_last_backward: Callable[[int], None] | None = None,
    free_sent_outputs: bool = True,
    v_shape: bool = False,
    plan: Sequence | None = None,
    overlap_pairs: bool = False,
    delay_wgrad: bool = False,
) -> ScheduleStats:
    """Run one rank's program. `forward_step(chunk, batch)` returns the summed loss on the last
    virtual stage and the hidden states elsewhere; the loss is divided by `num_tokens` (the whole
    global batch's) and multiplied by `loss_scale` before backward, so gradients accumulate to
    those of the (scaled) global mean. `on_last_backward(chunk)` is called just before a chunk's
    last backward of the step (data-parallel reduction may overlap it). Once an activation is
    sent, its data is freed (`free_sent_outputs`): backward needs only the autograd graph behind it.
    `v_shape`: the two chunks sit in a V (`V_SCHEDULES`); `plan`: this rank's exchange plan where
    it is not `exchange_plan`'s (`exchange_plans` gives every rank's). `overlap_pairs`: the passes of
    each overlapped pair ("O") run on two lanes (megalite.parallel.lanes), each one's collectives in
    flight while the other computes; else one after the other. `delay_wgrad` (--delay-wgrad-compute):
    a backward records its weight-gradient work (megalite.parallel.weight_grad) and lends it to the
    waits for exchanges that follow, and runs what is left when the backward ends (or at its W) -
    except a chunk's last backward while its gradients reduce as they come (`on_last_backward`),
    whose buckets must see every gradient in it."""
    device = num_tokens.device
    lanes.drop_posts()  # (what a pass that raised left posted is never launched)
    weight_grad.forget_fill()  # (nor is the weight-gradient work it lent run)
    p = state.get_pipeline_model_parallel_world_size()
    r = state.get_pipeline_model_parallel_rank()
    last_virtual = p * len(model_chunks) - 1
    stats = ScheduleStats(loss_sum=torch.zeros((), dtype=torch.float32, device=device))
    rec = _Recorder(stats, record_spans, sync_cuda=record_spans and device.type == "cuda")

    def stage_of(chunk):
        return virtual_stage(p, r, chunk, v_shape)

    def rank_of(stage):
        return state.get_pipeline_model_parallel_ranks()[stage_rank(p, stage, v_shape)]

    # Which messages go out and come in at each exchange point, in posting order: the same plan
    # megalite.pipeline.replay checks against NCCL's untagged, in-order matching.
    early = plan is not None  # receives posted before the exchange point that reads them
    if plan is None:
        plan = exchange_plan(program, p, r, len(model_chunks), v_shape)
    plan = {x.index: x for x in plan}
    handed: dict[Message, torch.Tensor] = {}  # between this rank's two chunks at the tip of a V
    # A zero-bubble program splits each backward: B (input gradients) and, later, W (weights').
    split = any(op.kind == "W" for op in program)
    # Where each chunk's last gradient work of the step starts: its buckets may reduce from there.
    last_grad_op = {op.chunk: i for i, op in enumerate(program) if op.kind == ("W" if split else "B")}
    # --delay-wgrad-compute: the backwards whose buckets reduce as their gradients come run whole
    syncing = {(program[i].chunk, program[i].micro_batch) for i in last_grad_op.values()} \
        if on_last_backward else set()
    weight_work: dict[tuple, weight_grad.WeightGrads] = {}  # (chunk, mb) -> what its B deferred
    received: dict[Message, p2p.Posted] = {}  # posted receives, by message: each waited for when read
    in_flight: list[p2p.Posted] = []  # the batches posted at the last exchange points, their sends not yet waited for
    outbox: dict[Message, torch.Tensor] = {}  # produced, not yet sent
    stash: dict[tuple, tuple] = {}  # (chunk, mb) -> (input, output) kept for the backward
    start = time.perf_counter()

    def exchange_at(i):
        x = plan.get(i)
        if x is None or not (x.sends or x.recvs):
            return
        sends = [p2p.Send(outbox.pop(m), rank_of(m.dst), _TAGS[m.kind]) for m in x.sends]
        recvs = [p2p.Recv(m, rank_of(m.src), _TAGS[m.kind]) for m in x.recvs]
        # Post this point's batch. Its sends drain while the next passes compute: those of the
        # batches before the last SENDS_IN_FLIGHT are waited for now, so a sent activation is held
        # that many intervals longer at most (a transfer may take longer than one pass across a
        # slow link). A split program, or one whose plan posts receives early, waits for its
        # receives only where a pass reads them, so the passes before run while they are on their
        # way; other programs wait for them at once, as their next pass reads them anyway. The
        # posting and the waits are drawn apart ("p2p", "p2p-wait"), as every dimension's waits are.
        with rec.span("send/recv", "p2p"):
            posted = p2p.exchange(sends, recvs, tensor_shape, dtype, device, wait=False)
        if len(in_flight) >= SENDS_IN_FLIGHT:
            with rec.span("wait for a send", "p2p-wait"):
                while len(in_flight) >= SENDS_IN_FLIGHT:
                    in_flight.pop(0).wait_sent()
        if not (split or early or posted.received):
            with rec.span("wait for a receive", "p2p-wait"):
                posted.wait_received()
        in_flight.append(posted)
        received.update({m: posted for m in posted.buffers})
        if free_sent_outputs:  # sent (the batch keeps its own reference): backward needs only the graph
            for m in x.sends:
                if m.kind == "F":
                    _free_data(stash.get((m.src // p, m.micro_batch), (None, None))[1])

    def wait_all():
        if in_flight:
            with rec.span("wait for a send", "p2p-wait"):
                while in_flight:
                    in_flight.pop().wait()

    def take(message: Message) -> torch.Tensor:
        """What a pass receives, once its batch is in (or from this rank's other chunk)."""
        if message in handed:
            return handed.pop(message)
        posted = received.pop(message)
        if not posted.received:  # (in an overlapped pair, the other lane computes meanwhile)
            with rec.span("wait for a receive", "p2p-wait"):
                lanes.wait(_Receives(posted), "pp")
        return posted.buffers.pop(message)  # (the batch, still draining its sends, keeps no reference)

    def produce(message: Message, tensor: torch.Tensor) -> None:
        if is_local(message, p, v_shape):
            handed[message] = tensor
        else:
            outbox[message] = tensor

    def run_pass(i: int, op: Op) -> None:
        key = (op.chunk, op.micro_batch)
        vs = stage_of(op.chunk)
        state.set_virtual_pipeline_model_parallel_rank(op.chunk)
        need = incoming(op.kind, op.chunk, op.micro_batch, p, r, len(model_chunks), v_shape)
        got = take(need) if need is not None else None
        row = 3 if lanes.lane() == "F" else None  # the forward lane of an overlapped pair: a row of its own
        if op.kind == "F":
            with rec.span(f"F c{op.chunk} mb{op.micro_batch}", "forward", row):
                x = got
                if x is not None:
                    if torch.is_grad_enabled():
                        x.requires_grad_()
                model = model_chunks[op.chunk]
                if hasattr(model, "set_input_tensor"):
                    model.set_input_tensor(x)
                out = forward_step(model, micro_batches[op.micro_batch])
                if vs == last_virtual:
                    stats.loss_sum += out.detach().float()
                    out = out / num_tokens
                    if loss_scale != 1.0:
                        out = out * loss_scale
                else:
                    produce(outgoing("F", op.chunk, op.micro_batch, p, r, len(model_chunks), v_shape), out.detach())
                if torch.is_grad_enabled():  # forward-only (evaluation) keeps nothing for backward
                    stash[key] = (x, out)
                stats.peak_in_flight = max(stats.peak_in_flight, len(stash.keys() | weight_work.keys()))
                stats.peak_stash_bytes = max(stats.peak_stash_bytes, _held_bytes(stash))
        elif op.kind == "B":
            with rec.span(f"B c{op.chunk} mb{op.micro_batch}", "backward", row):
                if last_grad_op.get(op.chunk) == i and on_last_backward is not None:
                    on_last_backward(op.chunk)
                x, out = stash.pop(key)
                grad = got
                # --delay-wgrad-compute lends the weights' work to the waits for exchanges (with no
                # older work still waiting: each parameter's gradients accumulate in micro-batch order)
                fill = delay_wgrad and key not in syncing and not weight_work
                if split or fill:  # input gradients now; the weights' work waits for this pass's W
                    with weight_grad.deferred(model_chunks[op.chunk] if delay_wgrad else None, fill) as work:
                        out.backward(grad)
                    if split:
                        weight_work[key] = work
                    else:
                        work.run()
                else:
                    out.backward(grad)
                if vs != 0:
                    produce(outgoing("B", op.chunk, op.micro_batch, p, r, len(model_chunks), v_shape), x.grad)
                del x, out, grad, got  # spent: free this micro-batch's activations now, not at the next pass
        else:  # "W": the weight gradients this (chunk, micro-batch)'s B left
            with rec.span(f"W c{op.chunk} mb{op.micro_batch}", "weight-grad", row):
                if last_grad_op.get(op.chunk) == i and on_last_backward is not None:
                    on_last_backward(op.chunk)
                weight_work.pop(key).run()

    with weight_grad.split_ops(split or delay_wgrad, cheap=split), lanes.recording(stats.spans if record_spans else None):
        i = 0
        while i < len(program):
            op = program[i]
            if op.kind == "X":
                exchange_at(i)
            elif op.kind == "O" and overlap_pairs:  # F and B (with its W) on two lanes, handing over at each collective
                f, b = i + 1, i + 2
                w = b + 1 if b + 1 < len(program) and program[b + 1].kind == "W" else b
                if program[f].kind != "F" or program[b].kind != "B":
                    raise RuntimeError(f"an overlapped pair is a forward then a backward: {program[f:w + 1]}")
                began = time.perf_counter()
                lanes.run_pair(lambda: run_pass(f, program[f]),
                               lambda: [run_pass(k, program[k]) for k in range(b, w + 1)])
                stats.busy_s += time.perf_counter() - began
                i = w
            elif op.kind != "O":  # (an overlapped pair without overlap_pairs: its passes one after the other)
                run_pass(i, op)
            i += 1
    exchange_at(len(program))  # sends after the last exchange point (hand-written programs)
    wait_all()
    if stash or received or outbox or weight_work or handed:
        raise RuntimeError(f"schedule left work behind: {sorted(stash)} {list(received)} {list(outbox)} "
                           f"{sorted(weight_work)} {list(handed)}")
    state.set_virtual_pipeline_model_parallel_rank(0 if len(model_chunks) > 1 else None)
    stats.wall_s = time.perf_counter() - start
    return stats
