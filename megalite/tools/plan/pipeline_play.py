"""A step of a pipeline schedule played with transfers: every rank's schedule program
(`megalite.pipeline.programs.build_program`) on a machine where each pass costs its compute and a
pass that needs another rank's output (an activation forward, a gradient backward) waits `transfer`
seconds after that output is done. What the boundary exchanges add to the step is the step so
played minus the same step with free transfers: only the exchanges on the schedule's critical path
count, the others hide behind the receiver's other passes.

Sends are taken as posted without blocking the sender (megalite posts each exchange point's batch
with `batch_isend_irecv`), and two messages never queue behind each other on one link (in 1F1B a
rank's sends alternate between its two neighbours, and at pp 2 go one way only). The chunks that
meet at the tip of a V (zb-v, dualpipev) hand over on the same rank, at no cost. An overlapped pair
("O") runs its passes one after the other, as `megalite.pipeline.simulator` plays it."""
from __future__ import annotations

from megalite.pipeline.partition import virtual_stage
from megalite.pipeline.programs import build_program, is_v_shaped


def played_step(p: int, m: int, v: int | None, kind: str, f: float, b: float, w: float, transfer: float) -> float:
    """Seconds of one step of `kind` ("1f1b", interleaved with v > 1, "zb-h1", "zb-v", "dualpipev")
    over p ranks and m micro-batches, a chunk's forward costing f, its input-gradient pass b and its
    weight-gradient pass w (a program that does not split its backward runs b + w as one), each
    message between two ranks arriving `transfer` seconds after its pass ends."""
    v_shape = is_v_shaped(kind)
    programs = [build_program(p, r, m, v if v and v > 1 else None, kind) for r in range(p)]
    chunks = max(op.chunk for prog in programs for op in prog) + 1
    last = p * chunks - 1
    split = any(op.kind == "W" for prog in programs for op in prog)
    cost = {"F": f, "B": b if split else b + w, "W": w}
    done: dict[tuple, tuple[float, int]] = {}  # (kind, virtual stage, micro-batch) -> (finish, rank)
    clock, pos = [0.0] * p, [0] * p

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
            prog = programs[r]
            while pos[r] < len(prog) and prog[pos[r]].kind == "X":
                pos[r] += 1
            if pos[r] == len(prog):
                continue
            if prog[pos[r]].kind == "O":  # the pair: F, B, and the B's W where it follows at once
                end = pos[r] + 4 if pos[r] + 3 < len(prog) and prog[pos[r] + 3].kind == "W" else pos[r] + 3
                group, lead = prog[pos[r] + 1:end], 1
            else:
                group, lead = [prog[pos[r]]], 0
            deps = [d for d in (needs(r, op) for op in group if op.kind != "W") if d is not None]
            if any(d not in done for d in deps):
                continue
            ready = [done[d][0] + (transfer if done[d][1] != r else 0.0) for d in deps]
            clock[r] = max([clock[r], *ready]) + sum(cost[op.kind] for op in group)
            for op in group:
                done[(op.kind, virtual_stage(p, r, op.chunk, v_shape), op.micro_batch)] = (clock[r], r)
            pos[r] += lead + len(group)
            progressed = True
        if not progressed and any(pos[r] < len(programs[r]) for r in range(p)):
            raise RuntimeError("schedule programs deadlock")
    return max(clock)


def exposed_transfers(p: int, m: int, v: int | None, kind: str, f: float, b: float, w: float,
                      transfer: float) -> float:
    """What the boundary transfers add to the step: played with them minus played without."""
    if p == 1:
        return 0.0
    return played_step(p, m, v, kind, f, b, w, transfer) - played_step(p, m, v, kind, f, b, w, 0.0)
