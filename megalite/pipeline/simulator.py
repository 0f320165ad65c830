"""The simulator: every rank's schedule program played on an ideal machine (free communication,
fixed pass costs) for its timeline and idle time, next to the bubble formulas it checks;
`main` is `python -m megalite.pipeline`."""
from __future__ import annotations

from dataclasses import dataclass

from megalite.pipeline.partition import V_SCHEDULES, stage_rank, virtual_stage
from megalite.pipeline.programs import SCHEDULES, build_program, is_v_shaped


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


def _play(programs, p: int, v_shape: bool, f, b, w, transfer: float = 0, posted: dict | None = None):
    """Run the programs on the ideal machine: each rank's row of cells (see `simulate`; whole time
    units only) and the time it reaches each position of its program (and its end). An overlapped
    pair ("O", then an F and a B with its W) starts once both passes' inputs are in and ends
    together, after F + B + W (DualPipe's F&B, here not overlapped). A message between two ranks
    takes `transfer` on its sender's link, which carries one message at a time in the order the
    sender made them: it arrives `transfer` after the pass that makes it ends or after the sender's
    message before it arrives, whichever is later (megalite.tools.plan.pipeline_play).
    f, b and w are each one cost for every virtual stage, or a sequence of one cost per virtual
    stage (the last stage also runs the output layer: the others wait for it). `posted`: where each
    message's receive is posted, {(kind, sending virtual stage, micro-batch): position of the X in
    its receiver's program}; such a message also moves only once its receiver has reached that point
    (gloo moves a message's bytes only to a posted receive, as NCCL's rendezvous does a large one's),
    so it arrives `transfer` after then at the earliest (the messages behind it on the sender's link
    are not held up by it)."""
    chunks = max(op.chunk for prog in programs for op in prog) + 1
    last = p * chunks - 1
    split = any(op.kind == "W" for prog in programs for op in prog)
    f, b, w = (list(c) if isinstance(c, (list, tuple)) else [c] * (last + 1) for c in (f, b, w))
    if not len(f) == len(b) == len(w) == last + 1:
        raise ValueError(f"pass costs for {len(f)}, {len(b)}, {len(w)} virtual stages; the programs have {last + 1}")
    stage_cost = [{"F": fs, "B": bs if split else bs + ws, "W": ws} for fs, bs, ws in zip(f, b, w)]
    cells = all(isinstance(c, int) for c in (*f, *b, *w))  # rows of cells for whole time units only
    # (kind, virtual stage, micro-batch) of each pass done -> when its output is at the pass that reads it
    arrival: dict[tuple, float] = {}
    link_free = [0] * p  # when each rank's link has sent its last message

    def consumer(op, vs: int) -> int | None:
        """The virtual stage that reads this pass's output from another one (None: none)."""
        if op.kind == "F":
            return vs + 1 if vs < last else None
        return vs - 1 if op.kind == "B" and vs > 0 else None
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
            if any(d is not None and d not in arrival for d in deps):
                continue
            arrivals = [arrival[d] if posted is None or d not in posted
                        else max(arrival[d], reach[r][posted[d]] + transfer) for d in deps if d is not None]
            begin = max([clock[r], *arrivals])
            if cells:
                rows[r] += ["."] * (begin - clock[r])
            reach[r] += [clock[r]] * lead
            cost = [stage_cost[virtual_stage(p, r, op.chunk, v_shape)][op.kind] for op in group]
            for op, c in zip(group, cost):
                letter = "abcdefghij"[op.micro_batch % 10]
                mark = {"F": str(op.micro_batch % 10), "B": letter, "W": letter.upper()}[op.kind]
                if cells:
                    rows[r] += [mark] * c
                reach[r].append(clock[r])
            clock[r] = begin + sum(cost)
            for op in group:  # in program order: the order its messages take the link
                vs = virtual_stage(p, r, op.chunk, v_shape)
                key, to = (op.kind, vs, op.micro_batch), consumer(op, vs)
                if to is None or stage_rank(p, to, v_shape) == r:
                    arrival[key] = clock[r]
                else:
                    link_free[r] = arrival[key] = max(clock[r], link_free[r]) + transfer
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
