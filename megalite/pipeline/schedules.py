"""Forward-backward schedules over the micro-batches of one training step.

A schedule is a *program* per rank: the order of its forward (F) and backward (B) passes over
(model chunk, micro-batch), with exchange points (X) between them. At an exchange point the rank
sends what the passes since the last one produced for other stages and receives what the passes
up to the next one need, in one batch. One executor runs every program:

- no pipelining (pp=1): F B F B ... -- gradient accumulation;
- 1F1B (Narayanan et al. 2021, PipeDream-Flush): stage r runs p-r-1 warm-up forwards, then
  alternates one forward and one backward, then drains the backwards. At most p micro-batches
  are in flight on the first stage, whatever the number of micro-batches m;
- interleaved 1F1B: each rank holds v model chunks (virtual stages r, r+p, r+2p, ...); forwards
  go through the chunks in groups of p micro-batches, shrinking the bubble from
  (p-1)/(m+p-1) to (p-1)/(v*m+p-1); needs m to be a multiple of p;
- GPipe (all forwards, then all backwards): for comparison; keeps all m micro-batches in flight.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from megalite.parallel import state, weight_grad
from megalite.pipeline import p2p
from megalite.pipeline.partition import V_SCHEDULES, stage_rank, virtual_stage
from megalite.pipeline.replay import (Message, check_nccl_order, early_exchange_plans, exchange_plan, incoming,
                                      is_local, outgoing)

ForwardStep = Callable[[torch.nn.Module, dict], torch.Tensor]


@dataclass(frozen=True)
class Op:
    kind: str  # "F", "B", "W", "X"; "O": the F and the B (with its W) that follow run overlapped
    chunk: int = 0
    micro_batch: int = 0


def _x() -> Op:
    return Op("X")


def program_no_pipelining(m: int) -> list[Op]:
    out = []
    for i in range(m):
        out += [Op("F", 0, i), Op("B", 0, i)]
    return out


def program_1f1b(p: int, r: int, m: int) -> list[Op]:
    warmup = min(p - r - 1, m)
    out = [_x()]
    for i in range(warmup):
        out += [Op("F", 0, i), _x()]
    for i in range(m - warmup):
        out += [Op("F", 0, warmup + i), _x(), Op("B", 0, i), _x()]
    for i in range(m - warmup, m):
        out += [Op("B", 0, i), _x()]
    return out


def program_gpipe(p: int, r: int, m: int) -> list[Op]:
    out = [_x()]
    for i in range(m):
        out += [Op("F", 0, i), _x()]
    for i in range(m):
        out += [Op("B", 0, i), _x()]
    return out


def program_interleaved(p: int, r: int, m: int, v: int) -> list[Op]:
    if m % p:
        raise ValueError(f"the interleaved schedule needs the micro-batches per step ({m}) to be a multiple of "
                         f"the pipeline size ({p})")
    total = m * v

    def forward(k):  # k-th forward on this rank: chunks advance every p micro-batches
        group, within = divmod(k, p * v)
        return Op("F", within // p, group * p + within % p)

    def backward(k):
        group, within = divmod(k, p * v)
        return Op("B", v - 1 - within // p, group * p + within % p)

    # Warm-up: enough forwards that the first backward's gradient can come back round the ring.
    warmup = total if m == p else min(total, (p - r - 1) * 2 + (v - 1) * p)
    out = [_x()]
    for k in range(warmup):
        out += [forward(k), _x()]
    for k in range(total - warmup):
        out += [forward(warmup + k), backward(k), _x()]
    for k in range(total - warmup, total):
        out += [backward(k), _x()]
    return out


def program_zb_h1(p: int, r: int, m: int) -> list[Op]:
    """ZB-H1 (Qi et al. 2023, section 2.1): 1F1B's order of forwards and input-gradient passes B,
    with each weight-gradient pass W run later: stage r holds back r of them (the last stage the
    most), so its B's start as soon as the next stage's arrive, and the W's held back fill the
    drain that 1F1B leaves idle. Every stage then has at most p micro-batches forwarded and not
    yet through W: 1F1B's first-stage peak, on every stage."""
    warmup = min(p - r - 1, m)
    held = min(r, m)  # W's this stage runs late
    out = [_x()]
    for i in range(warmup):
        out += [Op("F", 0, i), _x()]
    w_next = 0
    for i in range(m):
        if warmup + i < m:
            out += [Op("F", 0, warmup + i), _x()]
        # B's gradient goes out at once; a W runs while the next pass's input is on its way.
        out += [Op("B", 0, i), _x()]
        if i >= held:
            out.append(Op("W", 0, w_next))
            w_next += 1
    out += [Op("W", 0, k) for k in range(w_next, m)]
    return out


@functools.lru_cache(maxsize=64)
def _v_orders(p: int, m: int, costs: tuple = (1, 1, 1)) -> tuple[tuple[Op, ...], ...]:
    """Every rank's order of passes for ZB-V, by list scheduling on an ideal machine where a chunk's
    F, B and W cost `costs`: at each step the pass that can start earliest on any rank runs (ties:
    F before B before W, the V's second chunk first, the lower rank first), a W runs in the order
    of its B's, and a rank starts no forward while 2p chunks' activations are held (p micro-batches
    of a whole stage: 1F1B's first-stage peak; where that would stop every rank, a forward of the
    second chunk goes past it). At equal costs each rank then idles only p-1 chunk
    forwards, at the V's start (the last rank's first forward waits for the p-1 before it); every
    rank has the same work, so no schedule idles less. The order is fixed before the step runs, so
    costs far from those it was made for leave more idle (docs/pipeline.md)."""
    placed = [[] for _ in range(p)]
    clock = [0] * p
    done: dict[tuple, int] = {}  # (kind, virtual stage, micro-batch) -> finish time
    forwarded = [[0, 0] for _ in range(p)]  # per rank and chunk: micro-batches forwarded
    backwarded = [[0, 0] for _ in range(p)]
    weights_due: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # (chunk, mb) B'd, W not yet run
    live = [0] * p
    last = 2 * p - 1
    cost = dict(zip("FBW", costs))

    def earliest(over_cap: bool):
        """The pass that can start first: (start, kind order, rank), rank, kind, chunk, mb."""
        best = None
        for r in range(p):
            ready = []  # (kind, chunk, mb, time its input is ready)
            for c in (1, 0):
                vs, k = virtual_stage(p, r, c, True), backwarded[r][c]
                if k < forwarded[r][c]:
                    ready.append(("B", c, k, done.get(("B", vs + 1, k) if vs < last else ("F", vs, k))))
            for c in (1, 0):
                vs, k = virtual_stage(p, r, c, True), forwarded[r][c]
                if k < m and (live[r] < 2 * p or over_cap and c == 1):
                    ready.append(("F", c, k, done.get(("F", vs - 1, k)) if vs else 0))
            if weights_due[r]:
                c, k = weights_due[r][0]
                ready.append(("W", c, k, done[("B", virtual_stage(p, r, c, True), k)]))
            for kind, c, k, at in ready:
                if at is not None:
                    key = (max(clock[r], at), "FBW".index(kind), r)
                    if best is None or key < best[0]:
                        best = (key, r, kind, c, k)
        return best

    for _ in range(6 * m * p):
        # At some costs every rank holds 2p chunks while the pass that would free one waits for a
        # second-chunk forward that the cap holds back: that forward then goes past it.
        best = earliest(False) or earliest(True)
        if best is None:
            raise ValueError(f"no ZB-V order for pp {p}, {m} micro-batches and pass costs {costs}: "
                             f"try --pipeline-pass-costs 1,1,1")
        (start, _, _), r, kind, c, k = best
        clock[r] = start + cost[kind]
        done[(kind, virtual_stage(p, r, c, True), k)] = clock[r]
        placed[r].append(Op(kind, c, k))
        if kind == "F":
            forwarded[r][c] += 1
            live[r] += 1
        elif kind == "B":
            backwarded[r][c] += 1
            weights_due[r].append((c, k))
        else:
            weights_due[r].pop(0)
            live[r] -= 1
    return tuple(tuple(order) for order in placed)


def program_zb_v(p: int, r: int, m: int, costs: tuple = (1, 1, 1)) -> list[Op]:
    """ZB-V (Qi et al. 2023, section 6): two model chunks per rank placed in a V (`V_SCHEDULES`),
    each backward split into B and W, the passes in the order `_v_orders` gives for a chunk's F, B
    and W `costs`. An exchange point follows every F and B; the plan of what each receives is
    `exchange_plans`'."""
    out = [_x()]
    for op in _v_orders(p, m, tuple(costs))[r]:
        out += [op, _x()] if op.kind != "W" else [op]
    return out


def program_forward_only(p: int, r: int, m: int, v: int | None = None) -> list[Op]:
    """Evaluation: every forward in the training order, no backward."""
    v = v or 1
    order = [op for op in build_program(p, r, m, v if v > 1 else None) if op.kind == "F"]
    out = [_x()]
    for op in order:
        out += [op, _x()]
    return out


def program_dualpipev(p: int, r: int, m: int) -> list[Op]:
    """DualPipeV (DeepSeek-AI's DualPipe repository, its "cut-in-half" V of DualPipe, DeepSeek-V3
    report section 3.2.1): the V placement of ZB-V, in DualPipeV's phases. Rank r forwards
    2(p-r-1) micro-batches through chunk 0, then r+1 through both chunks; runs p-r-1 rounds of
    chunk 1's B, W and next forward; then the steady state, where each forward is paired with a
    backward of the other chunk, the pair marked to run overlapped ("O": on a GPU its all-to-alls
    hide behind the other's compute; this executor runs the pair one after the other); then the
    drain, whose later B's leave their W's to fill the end. Needs m >= 2p."""
    if m < 2 * p:
        raise ValueError(f"the dualpipev schedule needs at least 2 x pp = {2 * p} micro-batches per step (got {m}): "
                         "raise --global-batch-size")
    out = [_x()]
    forwarded, backwarded = [0, 0], [0, 0]
    deferred: list[tuple[int, int]] = []  # (chunk, mb) whose W waits

    def forward(c, then_exchange=True):
        out.append(Op("F", c, forwarded[c]))
        forwarded[c] += 1
        if then_exchange:
            out.append(_x())

    def backward(c, defer):
        k = backwarded[c]
        backwarded[c] += 1
        out.append(Op("B", c, k))
        if defer:
            deferred.append((c, k))
        else:
            out.append(Op("W", c, k))
        out.append(_x())

    def weight():
        out.append(Op("W", *deferred.pop(0)))

    def pair(forward_chunk, backward_chunk):
        out.append(Op("O"))
        forward(forward_chunk, then_exchange=False)
        backward(backward_chunk, defer=False)

    for _ in range(2 * (p - r - 1)):
        forward(0)
    for _ in range(r + 1):
        forward(0)
        forward(1)
    for _ in range(p - r - 1):
        backward(1, defer=True)
        weight()
        forward(1)
    for i in range(m - 2 * p + r + 1):
        if i == 0 and r == p - 1:  # the tip: chunk 1's backward needs the forward just handed over
            forward(0)
            backward(1, defer=False)
        else:
            pair(0, 1)
        pair(1, 0)
    for _ in range(p - r - 1):
        backward(1, defer=False)
        pair(1, 0)
    defer, half = False, (r + 1) // 2
    for i in range(r + 1):  # from the middle on, W's wait for the end (odd ranks one B earlier)
        defer = defer or (i == half and r % 2 == 1)
        backward(1, defer)
        defer = defer or (i == half and r % 2 == 0)
        backward(0, defer)
    for _ in range(p - r - 1):
        weight()
        backward(0, defer=True)
    while deferred:
        weight()
    return out


def program_forward_only_v(p: int, r: int, m: int) -> list[Op]:
    """Evaluation in a V: the forwards of ZB-V's program, in its order (so rank p-1 hands each
    chunk-0 output on to its chunk 1 soon, holding few)."""
    out = [_x()]
    for op in _v_orders(p, m)[r]:
        if op.kind == "F":
            out += [op, _x()]
    return out


SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")  # --pipeline-schedule's choices


def build_program(p: int, r: int, m: int, v: int | None = None, kind: str = "1f1b",
                  costs: tuple = (1, 1, 1)) -> list[Op]:
    """Rank r's program for `kind` ("1f1b"; "interleaved" needs v > 1, which also picks it from
    "1f1b"; "zb-h1"; "zb-v", two chunks per rank in a V, v None or 2, ordered for a chunk's F, B
    and W `costs`; "gpipe"; "forward-only") at p stages and m micro-batches. A V schedule's
    forward-only program is `forward_only_kind`'s."""
    if kind in V_SCHEDULES or kind == "forward-only-v":
        if p < 2:
            raise ValueError(f"the {kind} schedule places its two chunks per rank in a V over the pipeline: "
                             "it needs --pp 2 or more")
        if v not in (None, 2):
            raise ValueError(f"the {kind} schedule runs two model chunks per rank, but --vpp is {v}: drop --vpp")
        if kind == "dualpipev":
            return program_dualpipev(p, r, m)
        return program_zb_v(p, r, m, costs) if kind != "forward-only-v" else program_forward_only_v(p, r, m)
    if kind == "forward-only":
        return program_forward_only(p, r, m, v)
    if p == 1 and kind != "zb-h1":
        return program_no_pipelining(m)
    if kind == "zb-h1":
        if v and v > 1:
            raise ValueError("the zb-h1 schedule runs one model chunk per rank: drop --vpp (or choose "
                             "--pipeline-schedule interleaved)")
        return program_zb_h1(p, r, m)
    if v and v > 1 or kind == "interleaved":
        if not (v and v > 1):
            raise ValueError("the interleaved schedule needs virtual stages: give --vpp 2 or more")
        return program_interleaved(p, r, m, v)
    return {"1f1b": program_1f1b, "gpipe": program_gpipe}[kind](p, r, m)


def forward_only_kind(kind: str) -> str:
    """The kind of program evaluation runs for a training schedule: the same placement of chunks."""
    return "forward-only-v" if kind in V_SCHEDULES else "forward-only"


def is_v_shaped(kind: str) -> bool:
    return kind in V_SCHEDULES or kind == "forward-only-v"


@functools.lru_cache(maxsize=16)
def exchange_plans(p: int, m: int, v: int | None = None, kind: str = "1f1b", costs: tuple = (1, 1, 1)) -> list:
    """Every rank's exchange plan for `kind` (what `run_schedule` posts at each exchange point and
    `megalite.pipeline.replay.check_nccl_order` checks): V programs post each receive early, in the
    order of the sends on its pair of ranks (`early_exchange_plans`), others where it is read."""
    v_shape = is_v_shaped(kind)
    chunks = 2 if v_shape else (v if v and v > 1 else 1)
    programs = [build_program(p, r, m, v, kind, costs) for r in range(p)]
    if not v_shape:
        return tuple(tuple(exchange_plan(prog, p, r, chunks)) for r, prog in enumerate(programs))
    reach = _play(programs, p, v_shape, *costs)[1]
    plans = early_exchange_plans(programs, reach, p, chunks, v_shape)
    check_nccl_order(plans, p, v_shape)  # every rank builds the same plans: each checks them once
    return tuple(tuple(plan) for plan in plans)


def peak_in_flight(program: Sequence[Op]) -> int:
    """Most passes (of one model chunk and micro-batch) a program has forwarded and not yet
    backwarded (through W, where the program splits its backwards) at any point: how many sets of
    activations the rank holds at its peak (what run_schedule measures as
    ScheduleStats.peak_in_flight), for planning memory without running."""
    split = any(op.kind == "W" for op in program)
    live = peak = 0
    for op in program:
        if op.kind == "F":
            live += 1
            peak = max(peak, live)
        elif op.kind == ("W" if split else "B"):
            live -= 1
    return peak


@dataclass
class ScheduleStats:
    loss_sum: torch.Tensor  # summed loss over this rank's micro-batches (last stage; 0 elsewhere)
    peak_in_flight: int = 0  # micro-batches forwarded but not yet backwarded, at most
    peak_stash_bytes: int = 0  # bytes of the inputs and outputs kept for backward, at most
    busy_s: float = 0.0  # time in forward and backward passes
    wall_s: float = 0.0
    spans: list = field(default_factory=list)  # (name, category, start_s, duration_s)


_TAGS = {"F": p2p.FORWARD_TAG, "B": p2p.BACKWARD_TAG}


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

    def span(self, name: str, category: str):
        return _Span(self, name, category)


class _Span:
    def __init__(self, rec: _Recorder, name: str, category: str):
        self.rec, self.name, self.category = rec, name, category

    def __enter__(self):
        if self.rec.sync_cuda:
            torch.cuda.synchronize()
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        if self.rec.sync_cuda:
            torch.cuda.synchronize()
        dur = time.perf_counter() - self.start
        if self.category in ("forward", "backward", "weight-grad"):
            self.rec.stats.busy_s += dur
        if self.rec.record_spans:
            self.rec.stats.spans.append((self.name, self.category, self.start, dur))


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
) -> ScheduleStats:
    """Run one rank's program. `forward_step(chunk, batch)` returns the summed loss on the last
    virtual stage and the hidden states elsewhere; the loss is divided by `num_tokens` (the whole
    global batch's) and multiplied by `loss_scale` before backward, so gradients accumulate to
    those of the (scaled) global mean. `on_last_backward(chunk)` is called just before a chunk's
    last backward of the step (data-parallel reduction may overlap it). Once an activation is
    sent, its data is freed (`free_sent_outputs`): backward needs only the autograd graph behind it.
    `v_shape`: the two chunks sit in a V (`V_SCHEDULES`); `plan`: this rank's exchange plan where
    it is not `exchange_plan`'s (`exchange_plans` gives every rank's)."""
    device = num_tokens.device
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
    if plan is None:
        plan = exchange_plan(program, p, r, len(model_chunks), v_shape)
    plan = {x.index: x for x in plan}
    handed: dict[Message, torch.Tensor] = {}  # between this rank's two chunks at the tip of a V
    # A zero-bubble program splits each backward: B (input gradients) and, later, W (weights').
    split = any(op.kind == "W" for op in program)
    # Where each chunk's last gradient work of the step starts: its buckets may reduce from there.
    last_grad_op = {op.chunk: i for i, op in enumerate(program) if op.kind == ("W" if split else "B")}
    weight_work: dict[tuple, weight_grad.WeightGrads] = {}  # (chunk, mb) -> what its B deferred
    received: dict[Message, p2p.Posted] = {}  # posted receives, by message: each waited for when read
    in_flight: list[p2p.Posted] = []  # batches posted at the last exchange point, not yet waited for
    outbox: dict[Message, torch.Tensor] = {}  # produced, not yet sent
    stash: dict[tuple, tuple] = {}  # (chunk, mb) -> (input, output) kept for the backward
    start = time.perf_counter()

    def exchange_at(i):
        x = plan.get(i)
        if x is None or not (x.sends or x.recvs):
            return
        sends = [p2p.Send(outbox.pop(m), rank_of(m.dst), _TAGS[m.kind]) for m in x.sends]
        recvs = [p2p.Recv(m, rank_of(m.src), _TAGS[m.kind]) for m in x.recvs]
        with rec.span("send/recv", "p2p"):
            # Post this point's batch. A split program waits for it only where a pass reads what it
            # received, so passes that read nothing (W) run while it is on its way; the batch before
            # is waited for now, so a sent activation is held one interval longer at most. Other
            # programs wait at once, as their next pass reads it anyway.
            posted = p2p.exchange(sends, recvs, tensor_shape, dtype, device, wait=False)
            wait_all()
            if split:
                in_flight.append(posted)
            else:
                posted.wait()
            received.update({m: posted for m in posted.buffers})
        if free_sent_outputs:  # sent (the batch keeps its own reference): backward needs only the graph
            for m in x.sends:
                if m.kind == "F":
                    _free_data(stash.get((m.src // p, m.micro_batch), (None, None))[1])

    def wait_all():
        while in_flight:
            in_flight.pop().wait()

    def take(message: Message) -> torch.Tensor:
        """What a pass receives, once its batch is in (or from this rank's other chunk)."""
        if message in handed:
            return handed.pop(message)
        posted = received.pop(message)
        if posted in in_flight:
            with rec.span("wait for a receive", "p2p"):
                posted.wait()
            in_flight.remove(posted)
        return posted.buffers[message]

    def produce(message: Message, tensor: torch.Tensor) -> None:
        if is_local(message, p, v_shape):
            handed[message] = tensor
        else:
            outbox[message] = tensor

    with weight_grad.split_ops(split):  # recomputations inside B rebuild the same split ops
        for i, op in enumerate(program):
            if op.kind == "X":
                exchange_at(i)
                continue
            if op.kind == "O":  # an overlapped pair: run here one pass after the other
                continue
            key = (op.chunk, op.micro_batch)
            vs = stage_of(op.chunk)
            state.set_virtual_pipeline_model_parallel_rank(op.chunk)
            need = incoming(op.kind, op.chunk, op.micro_batch, p, r, len(model_chunks), v_shape)
            got = take(need) if need is not None else None
            if op.kind == "F":
                with rec.span(f"F c{op.chunk} mb{op.micro_batch}", "forward"):
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
                with rec.span(f"B c{op.chunk} mb{op.micro_batch}", "backward"):
                    if last_grad_op.get(op.chunk) == i and on_last_backward is not None:
                        on_last_backward(op.chunk)
                    x, out = stash.pop(key)
                    grad = got
                    if split:  # input gradients now; the weights' work waits for this pass's W
                        with weight_grad.deferred() as work:
                            out.backward(grad)
                        weight_work[key] = work
                    else:
                        out.backward(grad)
                    if vs != 0:
                        produce(outgoing("B", op.chunk, op.micro_batch, p, r, len(model_chunks), v_shape), x.grad)
                    del x, out, grad, got  # spent: free this micro-batch's activations now, not at the next pass
            else:  # "W": the weight gradients this (chunk, micro-batch)'s B left
                with rec.span(f"W c{op.chunk} mb{op.micro_batch}", "weight-grad"):
                    if last_grad_op.get(op.chunk) == i and on_last_backward is not None:
                        on_last_backward(op.chunk)
                    weight_work.pop(key).run()
    exchange_at(len(program))  # sends after the last exchange point (hand-written programs)
    wait_all()
    if stash or received or outbox or weight_work or handed:
        raise RuntimeError(f"schedule left work behind: {sorted(stash)} {list(received)} {list(outbox)} "
                           f"{sorted(weight_work)} {list(handed)}")
    state.set_virtual_pipeline_model_parallel_rank(0 if len(model_chunks) > 1 else None)
    stats.wall_s = time.perf_counter() - start
    return stats


def theoretical_bubble(p: int, m: int, v: int | None = None) -> float:
    """Idle fraction of a pipeline step: (p-1)/(m+p-1), or (p-1)/(v*m+p-1) interleaved."""
    return (p - 1) / ((v or 1) * m + p - 1)


def bubble_time(kind: str, p: int, m: int, f: float, b: float, w: float, v: int | None = None) -> float:
    """Idle time of each stage in one step (m >= p), with F, B and W the costs of a forward, an
    input-gradient and a weight-gradient pass of one stage (a whole backward is B + W): 1F1B
    (p-1)(F+B+W) (Narayanan et al. 2021); interleaved (p-1)(F+B+W)/v; ZB-H1 (p-1)(F+B-W) (Qi et
    al. 2023, section 2.1), which holds while W <= min(F, B): a larger W cannot all go into the
    drain, and the stage waits (p-1) max(F, B) for the passes it depends on, so in general
    (p-1) max(F+B-W, F, B), as the simulator plays it. ZB-V (section 6): (p-1) F/2, the V's start:
    the last rank's first forward waits for p-1 chunks' forwards (half a stage's each), and as
    every rank has the same work no schedule idles less; its program reaches this when F, B and W
    cost the same (the paper's "zero bubble" at T_F = T_B = T_W, where this start is all there is;
    the simulator plays other costs). DualPipeV (DualPipe's README): (p-1)(F&B + B' - 3W') in a
    chunk's costs, B' a whole backward (B + W), W' its weight part, F&B an overlapped forward and
    backward pair, here one after the other (F + B + W of a chunk): (p-1)(F/2 + B - W/2) of a
    stage's; the simulator plays it exactly at equal costs (the published case) and idles less
    while W <= min(F, B)."""
    if p == 1:
        return 0.0
    if kind == "zb-v":
        return (p - 1) * f / 2
    if kind == "dualpipev":
        cf, cb, cw = f / 2, b / 2, w / 2  # a chunk's: half a stage's
        return (p - 1) * ((cf + cb + cw) + (cb + cw) - 3 * cw)
    if kind == "zb-h1":
        return (p - 1) * max(f + b - w, f, b)
    if kind in ("1f1b", "interleaved"):
        return (p - 1) * (f + b + w) / (v or 1)
    raise ValueError(f"no bubble formula for the {kind!r} schedule")


def bubble_fraction(kind: str, p: int, m: int, f: float, b: float, w: float, v: int | None = None) -> float:
    """`bubble_time` over the step: idle / (each stage's m passes of F, B and W + idle)."""
    idle = bubble_time(kind, p, m, f, b, w, v)
    return idle / (m * (f + b + w) + idle)


@dataclass
class Timeline:
    rows: list[list[str]]  # one cell per time unit per rank: see `simulate`
    idle: float  # idle fraction of the whole step, all ranks
    step_time: float  # makespan in cost units
    idle_time: list[float]  # idle time of each rank


def simulate(p: int, m: int, v: int | None = None, kind: str = "1f1b", forward_time: int = 1,
             backward_time: int = 1, weight_time: int = 1) -> Timeline:
    """Play every rank's program on an ideal machine (free communication, fixed pass costs: a
    forward F, an input-gradient pass B, a weight-gradient pass W; a program that does not split
    its backwards runs B + W as one) and return its timeline: one row of cells per rank (digit:
    forward of micro-batch N, lower-case letter: its backward or B, upper-case: its W, '.': idle),
    for documentation and to check the programs against the bubble formulas."""
    costs = (forward_time, backward_time, weight_time)  # a V program is ordered for them
    programs = [build_program(p, r, m, v if v and v > 1 else None, kind, costs) for r in range(p)]
    rows, _ = _play(programs, p, is_v_shaped(kind), *costs)
    end = max(len(row) for row in rows)
    for row in rows:
        row += ["."] * (end - len(row))
    idle_time = [row.count(".") for row in rows]
    return Timeline(rows, sum(idle_time) / (p * end), end, idle_time)


def predicted_idle(p: int, m: int, kind: str, f: float, b: float, w: float, v: int | None = None,
                   ordered_for: tuple = (1, 1, 1)) -> float:
    """The idle fraction of a step on the ideal machine at pass costs F, B, W (any positive numbers:
    measured seconds), a V program ordered for `ordered_for` (as `--pipeline-pass-costs` orders
    it): the simulator's prediction for a measured run."""
    programs = [build_program(p, r, m, v, kind, ordered_for) for r in range(p)]
    _, reach = _play(programs, p, is_v_shaped(kind), f, b, w)
    end = max(times[-1] for times in reach)
    split = any(op.kind == "W" for prog in programs for op in prog)
    cost = {"F": f, "B": b if split else b + w, "W": w, "X": 0, "O": 0}
    busy = [sum(cost[op.kind] for op in prog) for prog in programs]
    return sum(end - x for x in busy) / (p * end)


def _play(programs, p: int, v_shape: bool, f: float, b: float, w: float):
    """Run the programs on the ideal machine: each rank's row of cells (see `simulate`; whole time
    units only) and the time it reaches each position of its program (and its end). An overlapped
    pair ("O", then an F and a B with its W) starts once both passes' inputs are in and ends
    together, after F + B + W (DualPipe's F&B, here not overlapped)."""
    chunks = max(op.chunk for prog in programs for op in prog) + 1
    last = p * chunks - 1
    split = any(op.kind == "W" for prog in programs for op in prog)
    cost = {"F": f, "B": b if split else b + w, "W": w}
    cells = all(isinstance(c, int) for c in (f, b, w))  # rows of cells for whole time units only
    done: dict[tuple, int] = {}  # (kind, virtual stage, micro-batch) -> finish time
    clock, pos = [0] * p, [0] * p
    rows = [[] for _ in range(p)]
    reach = [[] for _ in range(p)]

    def needs(r, op):
        vs = virtual_stage(p, r, op.chunk, v_shape)
        if op.kind == "F":
            return ("F", vs - 1, op.micro_batch) if vs > 0 else None
        if op.kind == "B":
            return ("B", vs + 1, op.micro_batch) if vs < last else ("F", vs, op.micro_batch)
        return ("B", vs, op.micro_batch)

    while any(pos[r] < len(programs[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(programs[r]) and programs[r][pos[r]].kind == "X":
                reach[r].append(clock[r])
                pos[r] += 1
            if pos[r] == len(programs[r]):
                continue
            prog = programs[r]
            if prog[pos[r]].kind == "O":  # the pair: F, B, and the B's W where it follows at once
                group = prog[pos[r] + 1:pos[r] + 4 if pos[r] + 3 < len(prog) and prog[pos[r] + 3].kind == "W"
                             else pos[r] + 3]
                lead = 1
            else:
                group, lead = [prog[pos[r]]], 0
            deps = [needs(r, op) for op in group if op.kind != "W"]
            if any(d is not None and d not in done for d in deps):
                continue
            begin = max([clock[r]] + [done[d] for d in deps if d is not None])
            if cells:
                rows[r] += ["."] * (begin - clock[r])
            reach[r] += [clock[r]] * lead
            for op in group:
                letter = "abcdefghij"[op.micro_batch % 10]
                mark = {"F": str(op.micro_batch % 10), "B": letter, "W": letter.upper()}[op.kind]
                if cells:
                    rows[r] += [mark] * cost[op.kind]
                reach[r].append(clock[r])
            clock[r] = begin + sum(cost[op.kind] for op in group)
            for op in group:
                done[(op.kind, virtual_stage(p, r, op.chunk, v_shape), op.micro_batch)] = clock[r]
            pos[r] += lead + len(group)
            progressed = True
        if not progressed and any(pos[r] < len(programs[r]) for r in range(p)):
            raise RuntimeError("schedule programs deadlock")
    for r in range(p):
        reach[r].append(clock[r])
    return rows, reach


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m megalite.pipeline",
        description="Print a pipeline schedule as a timeline on an ideal machine (digits: forward of "
                    "micro-batch N; lower-case letters: its backward, or its input-gradient pass B in a "
                    "split schedule; upper-case: its weight-gradient pass W; '.': idle) and its bubble "
                    "next to the formula's.")
    ap.add_argument("--kind", choices=list(SCHEDULES) + ["gpipe"], default="1f1b")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--vpp", type=int, default=None, help="model chunks per rank (interleaved; zb-v has 2)")
    ap.add_argument("--f", type=int, default=1, help="cost of a forward pass (time units)")
    ap.add_argument("--b", type=int, default=1, help="cost of an input-gradient pass B")
    ap.add_argument("--w", type=int, default=1, help="cost of a weight-gradient pass W")
    a = ap.parse_args()
    try:
        t = simulate(a.pp, a.micro_batches, a.vpp, a.kind, a.f, a.b, a.w)
    except ValueError as e:
        ap.error(str(e))
    for r, row in enumerate(t.rows):
        print(f"stage {r}: {''.join(row)}")
    line = f"bubble {100 * t.idle:.1f}% ({t.idle_time[0]} idle units per stage of {t.step_time})"
    if a.kind != "gpipe":
        v = 2 if a.kind in V_SCHEDULES else a.vpp or 1  # the formulas take a whole stage's passes: v chunks' each
        costs = (a.f * v, a.b * v, a.w * v)
        frac = bubble_fraction(a.kind, a.pp, a.micro_batches, *costs, a.vpp)
        line += f"; formula {100 * frac:.1f}% ({bubble_time(a.kind, a.pp, a.micro_batches, *costs, a.vpp):g})"
    print(line)
