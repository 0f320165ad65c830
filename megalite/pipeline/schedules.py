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

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from megalite.parallel import state, weight_grad
from megalite.pipeline import p2p
from megalite.pipeline.replay import Message, exchange_plan, incoming, outgoing

ForwardStep = Callable[[torch.nn.Module, dict], torch.Tensor]


@dataclass(frozen=True)
class Op:
    kind: str  # "F", "B" or "X"
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


def program_forward_only(p: int, r: int, m: int, v: int | None = None) -> list[Op]:
    """Evaluation: every forward in the training order, no backward."""
    v = v or 1
    order = [op for op in build_program(p, r, m, v if v > 1 else None) if op.kind == "F"]
    out = [_x()]
    for op in order:
        out += [op, _x()]
    return out


SCHEDULES = ("1f1b", "interleaved", "zb-h1")  # --pipeline-schedule's choices


def build_program(p: int, r: int, m: int, v: int | None = None, kind: str = "1f1b") -> list[Op]:
    """Rank r's program for `kind` ("1f1b"; "interleaved" needs v > 1, which also picks it from
    "1f1b"; "zb-h1"; "gpipe"; "forward-only") at p stages and m micro-batches."""
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
) -> ScheduleStats:
    """Run one rank's program. `forward_step(chunk, batch)` returns the summed loss on the last
    virtual stage and the hidden states elsewhere; the loss is divided by `num_tokens` (the whole
    global batch's) and multiplied by `loss_scale` before backward, so gradients accumulate to
    those of the (scaled) global mean. `on_last_backward(chunk)` is called just before a chunk's
    last backward of the step (data-parallel reduction may overlap it). Once an activation is
    sent, its data is freed (`free_sent_outputs`): backward needs only the autograd graph behind it."""
    device = num_tokens.device
    p = state.get_pipeline_model_parallel_world_size()
    r = state.get_pipeline_model_parallel_rank()
    last_virtual = p * len(model_chunks) - 1
    stats = ScheduleStats(loss_sum=torch.zeros((), dtype=torch.float32, device=device))
    rec = _Recorder(stats, record_spans, sync_cuda=record_spans and device.type == "cuda")

    def virtual_stage(chunk):
        return chunk * p + r

    # Which messages go out and come in at each exchange point, in posting order: the same plan
    # megalite.pipeline.replay checks against NCCL's untagged, in-order matching.
    plan = {x.index: x for x in exchange_plan(program, p, r, len(model_chunks))}
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
        ranks = state.get_pipeline_model_parallel_ranks()
        sends = [p2p.Send(outbox.pop(m), ranks[m.dst % p], _TAGS[m.kind]) for m in x.sends]
        recvs = [p2p.Recv(m, ranks[m.src % p], _TAGS[m.kind]) for m in x.recvs]
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
        """What a pass receives, once its batch is in."""
        posted = received.pop(message)
        if posted in in_flight:
            with rec.span("wait for a receive", "p2p"):
                posted.wait()
            in_flight.remove(posted)
        return posted.buffers[message]

    with weight_grad.split_ops(split):  # recomputations inside B rebuild the same split ops
        for i, op in enumerate(program):
            if op.kind == "X":
                exchange_at(i)
                continue
            key = (op.chunk, op.micro_batch)
            vs = virtual_stage(op.chunk)
            state.set_virtual_pipeline_model_parallel_rank(op.chunk)
            need = incoming(op.kind, op.chunk, op.micro_batch, p, r, len(model_chunks))
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
                        outbox[outgoing("F", op.chunk, op.micro_batch, p, r, len(model_chunks))] = out.detach()
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
                        outbox[outgoing("B", op.chunk, op.micro_batch, p, r, len(model_chunks))] = x.grad
                    del x, out, grad, got  # spent: free this micro-batch's activations now, not at the next pass
            else:  # "W": the weight gradients this (chunk, micro-batch)'s B left
                with rec.span(f"W c{op.chunk} mb{op.micro_batch}", "weight-grad"):
                    if last_grad_op.get(op.chunk) == i and on_last_backward is not None:
                        on_last_backward(op.chunk)
                    weight_work.pop(key).run()
    exchange_at(len(program))  # sends after the last exchange point (hand-written programs)
    wait_all()
    if stash or received or outbox or weight_work:
        raise RuntimeError(f"schedule left work behind: {sorted(stash)} {list(received)} {list(outbox)} "
                           f"{sorted(weight_work)}")
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
    (p-1) max(F+B-W, F, B), as the simulator plays it."""
    if p == 1:
        return 0.0
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
    v = v or 1
    programs = [[op for op in build_program(p, r, m, v if v > 1 else None, kind) if op.kind != "X"]
                for r in range(p)]
    split = any(op.kind == "W" for prog in programs for op in prog)
    cost = {"F": forward_time, "B": backward_time if split else backward_time + weight_time, "W": weight_time}
    done: dict[tuple, int] = {}  # (kind, virtual stage, micro-batch) -> finish time
    clock, pos = [0] * p, [0] * p
    rows = [[] for _ in range(p)]
    while any(pos[r] < len(programs[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if pos[r] == len(programs[r]):
                continue
            op = programs[r][pos[r]]
            vs = op.chunk * p + r
            if op.kind == "F":
                dep = ("F", vs - 1, op.micro_batch) if vs > 0 else None
            elif op.kind == "B":
                dep = ("B", vs + 1, op.micro_batch) if vs < p * v - 1 else ("F", vs, op.micro_batch)
            else:
                dep = ("B", vs, op.micro_batch)
            if dep is not None and dep not in done:
                continue
            start = max(clock[r], done[dep] if dep else 0)
            letter = "abcdefghij"[op.micro_batch % 10]
            mark = {"F": str(op.micro_batch % 10), "B": letter, "W": letter.upper()}[op.kind]
            rows[r] += ["."] * (start - clock[r]) + [mark] * cost[op.kind]
            clock[r] = start + cost[op.kind]
            done[(op.kind, vs, op.micro_batch)] = clock[r]
            pos[r] += 1
            progressed = True
        if not progressed:
            raise RuntimeError("schedule programs deadlock")
    end = max(clock)
    for r in range(p):
        rows[r] += ["."] * (end - clock[r])
    idle_time = [row.count(".") for row in rows]
    return Timeline(rows, sum(idle_time) / (p * end), end, idle_time)


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
    ap.add_argument("--vpp", type=int, default=None, help="model chunks per rank (interleaved)")
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
        v = a.vpp or 1  # the formulas take a whole stage's passes: v chunks' each
        costs = (a.f * v, a.b * v, a.w * v)
        frac = bubble_fraction(a.kind, a.pp, a.micro_batches, *costs, a.vpp)
        line += f"; formula {100 * frac:.1f}% ({bubble_time(a.kind, a.pp, a.micro_batches, *costs, a.vpp):g})"
    print(line)
