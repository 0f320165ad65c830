"""Schedule programs: the order of each rank's passes over the micro-batches of one training step.

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
- zero-bubble (ZB-H1) and the V-shaped schedules (ZB-V, DualPipeV): see their programs below;
- GPipe (all forwards, then all backwards): for comparison; keeps all m micro-batches in flight.

`executor.run_schedule` runs a program, `simulator` plays every rank's on an ideal machine and
`replay` checks their messages against NCCL's matching.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from megalite.pipeline.partition import V_SCHEDULES, stage_rank, virtual_stage


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


def _warmup(p: int, r: int, m: int, extra: int) -> int:
    """Forwards before the first backward: 1F1B's p-r-1, plus `extra` on every stage but the last
    (--pipeline-extra-warmup). The extra ones keep a stage a round trip ahead, so its next forward
    never waits for its own backward's gradient to arrive: the steady state's transfers leave the
    schedule's path at the cost of `extra` more micro-batches' activations. The last stage gains
    nothing by them: its backwards need no transfer."""
    return min(p - r - 1 + (extra if r < p - 1 else 0), m)


def program_1f1b(p: int, r: int, m: int, extra: int = 0) -> list[Op]:
    warmup = _warmup(p, r, m, extra)
    out = [_x()]
    for i in range(warmup):
        out += [Op("F", 0, i), _x()]
    for i in range(m - warmup):
        out += [Op("F", 0, warmup + i), _x(), Op("B", 0, i), _x()]
    for i in range(m - warmup, m):
        out += [Op("B", 0, i), _x()]
    return out


def program_1f1b_paired(p: int, r: int, m: int) -> list[Op]:
    """1F1B with each steady-state forward and backward an overlapped pair ("O", run on two lanes
    under --overlap-moe-expert-parallel-comm): a pair's two passes must not wait on each other, so
    each stage runs one more warm-up forward than 1F1B (p-r: the last stage's backward then reads
    the forward before it, not the one beside it), and both passes' inputs arrive at the exchange
    point before the pair. One more micro-batch's activations are held than 1F1B's; at pp 1 that is
    gradient accumulation with the next forward beside each backward."""
    warmup = min(p - r, m)
    out = [_x()]
    for i in range(warmup):
        out += [Op("F", 0, i), _x()]
    for i in range(m - warmup):
        out += [Op("O"), Op("F", 0, warmup + i), Op("B", 0, i), _x()]
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


def program_interleaved(p: int, r: int, m: int, v: int, paired: bool = False) -> list[Op]:
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

    # Warm-up: enough forwards that the first backward's gradient can come back round the ring;
    # overlapped pairs (`paired`) need one more, so that no pair's backward reads its own forward.
    warmup = total if m == p else min(total, (p - r - 1) * 2 + (v - 1) * p + int(paired))
    out = [_x()]
    for k in range(warmup):
        out += [forward(k), _x()]
    for k in range(total - warmup):
        out += [Op("O")] * paired + [forward(warmup + k), backward(k), _x()]
    for k in range(total - warmup, total):
        out += [backward(k), _x()]
    return out


def program_zb_h1(p: int, r: int, m: int, extra: int = 0) -> list[Op]:
    """ZB-H1 (Qi et al. 2023, section 2.1): 1F1B's order of forwards and input-gradient passes B,
    with each weight-gradient pass W run later: stage r holds back r of them (the last stage the
    most), so its B's start as soon as the next stage's arrive, and the W's held back fill the
    drain that 1F1B leaves idle. Every stage then has at most p micro-batches forwarded and not
    yet through W: 1F1B's first-stage peak, on every stage (with `extra` warm-up forwards, that many
    more on every stage but the last)."""
    warmup = _warmup(p, r, m, extra)
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
    stage = [tuple(virtual_stage(p, r, c, True) for c in (0, 1)) for r in range(p)]  # by rank and chunk

    def rank_best(r: int, over_cap: bool):
        """Rank r's pass that can start first: ((start, kind order, rank), rank, kind, chunk, mb)."""
        best = None
        ready = []  # (kind, chunk, mb, time its input is ready)
        for c in (1, 0):
            vs, k = stage[r][c], backwarded[r][c]
            if k < forwarded[r][c]:
                ready.append(("B", c, k, done.get(("B", vs + 1, k) if vs < last else ("F", vs, k))))
        for c in (1, 0):
            vs, k = stage[r][c], forwarded[r][c]
            if k < m and (live[r] < 2 * p or over_cap and c == 1):
                ready.append(("F", c, k, done.get(("F", vs - 1, k)) if vs else 0))
        if weights_due[r]:
            c, k = weights_due[r][0]
            ready.append(("W", c, k, done[("B", stage[r][c], k)]))
        for kind, c, k, at in ready:
            if at is not None:
                key = (max(clock[r], at), "FBW".index(kind), r)
                if best is None or key < best[0]:
                    best = (key, r, kind, c, k)
        return best

    # A placed pass changes only its own rank's candidates and those of the ranks that wait for its
    # output (the next stage's forward, the previous stage's backward): the others' are kept.
    per_rank = [rank_best(r, False) for r in range(p)]

    def earliest(over_cap: bool):
        """The pass that can start first on any rank (the lowest key; keys differ in their rank)."""
        candidates = per_rank if not over_cap else [rank_best(r, True) for r in range(p)]
        return min((b for b in candidates if b is not None), default=None)  # by key: its rank breaks ties

    for _ in range(6 * m * p):
        # At some costs every rank holds 2p chunks while the pass that would free one waits for a
        # second-chunk forward that the cap holds back: that forward then goes past it.
        best = earliest(False) or earliest(True)
        if best is None:
            raise ValueError(f"no ZB-V order for pp {p}, {m} micro-batches and pass costs {costs}: "
                             f"try --pipeline-pass-costs 1,1,1")
        (start, _, _), r, kind, c, k = best
        clock[r] = start + cost[kind]
        vs = stage[r][c]
        done[(kind, vs, k)] = clock[r]
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
        for q in {r, *(stage_rank(p, n, True) for n in (vs - 1, vs + 1) if 0 <= n <= last)}:
            per_rank[q] = rank_best(q, False)
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
    backward of the other chunk, the pair marked to run overlapped ("O": with
    --overlap-moe-expert-parallel-comm the executor runs it on two lanes, each one's all-to-alls in
    flight while the other computes; else one pass after the other); then the
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


PAIRED_SCHEDULES = ("1f1b", "interleaved", "dualpipev")  # those with overlapped pairs (--overlap-moe-expert-parallel-comm)


EXTRA_WARMUP_SCHEDULES = ("1f1b", "zb-h1")  # those --pipeline-extra-warmup applies to


def is_one_chunk_program(p: int, kind: str, v: int | None, paired: bool = False) -> bool:
    """A pipelined 1f1b or zb-h1 program with one model chunk a rank and no overlapped pairs: what
    --pipeline-extra-warmup is built for, and (with the V programs) what posts receives early
    (`replay.posts_receives_early`)."""
    return p > 1 and kind in EXTRA_WARMUP_SCHEDULES and not (v and v > 1) and not paired


def build_program(p: int, r: int, m: int, v: int | None = None, kind: str = "1f1b",
                  costs: tuple = (1, 1, 1), paired: bool = False, extra_warmup: int = 0) -> list[Op]:
    """Rank r's program for `kind` ("1f1b"; "interleaved" needs v > 1, which also picks it from
    "1f1b"; "zb-h1"; "zb-v", two chunks per rank in a V, v None or 2, ordered for a chunk's F, B
    and W `costs`; "gpipe"; "forward-only") at p stages and m micro-batches. A V schedule's
    forward-only program is `forward_only_kind`'s. `paired`: 1f1b and interleaved with their
    steady-state forwards and backwards in overlapped pairs (dualpipev has its own pairs).
    `extra_warmup`: 1f1b (one chunk a rank, unpaired) and zb-h1 with that many more warm-up
    forwards on every stage but the last (`_warmup`)."""
    if extra_warmup:
        check_extra_warmup(extra_warmup, kind, v, paired)
        if p > 1:
            return (program_zb_h1 if kind == "zb-h1" else program_1f1b)(p, r, m, extra_warmup)
    if paired and kind not in PAIRED_SCHEDULES:
        raise ValueError(f"the {kind} schedule has no overlapped forward/backward pairs: choose --pipeline-schedule "
                         f"1f1b, interleaved or dualpipev, or drop --overlap-moe-expert-parallel-comm")
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
        return program_1f1b_paired(1, 0, m) if paired else program_no_pipelining(m)
    if kind == "zb-h1":
        if v and v > 1:
            raise ValueError("the zb-h1 schedule runs one model chunk per rank: drop --vpp (or choose "
                             "--pipeline-schedule interleaved)")
        return program_zb_h1(p, r, m)
    if v and v > 1 or kind == "interleaved":
        if not (v and v > 1):
            raise ValueError("the interleaved schedule needs virtual stages: give --vpp 2 or more")
        return program_interleaved(p, r, m, v, paired)
    if paired:
        return program_1f1b_paired(p, r, m)
    return {"1f1b": program_1f1b, "gpipe": program_gpipe}[kind](p, r, m)


def check_extra_warmup(extra: int, kind: str, v: int | None, paired: bool) -> None:
    """--pipeline-extra-warmup's one-line refusal where it is not built. At most one: with two, a
    stage's batch that sends its second extra activation would wait for the next stage's batch
    that receives it, which also sends a gradient the first stage has not yet posted a receive
    for (a deadlock under NCCL's blocking batches: replay.check_nccl_order); one is enough to take
    every steady-state transfer shorter than a pass off the path."""
    if extra not in (0, 1):
        raise ValueError(f"--pipeline-extra-warmup {extra}: 0 or 1 (with 2 or more the pipeline's exchange "
                         "batches would wait on each other under NCCL's matching)")
    if extra and not is_one_chunk_program(2, kind, v, paired):  # (--pp 1 is refused by the configuration)
        raise ValueError(f"--pipeline-extra-warmup {extra}: the extra warm-up forward is built for "
                         f"--pipeline-schedule {' and '.join(EXTRA_WARMUP_SCHEDULES)} with one model chunk a rank "
                         "and without --overlap-moe-expert-parallel-comm: drop the flag or change the schedule")


def forward_only_kind(kind: str) -> str:
    """The kind of program evaluation runs for a training schedule: the same placement of chunks."""
    return "forward-only-v" if kind in V_SCHEDULES else "forward-only"


def is_v_shaped(kind: str) -> bool:
    return kind in V_SCHEDULES or kind == "forward-only-v"


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
