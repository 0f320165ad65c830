"""A step of a pipeline schedule played with transfers: every rank's schedule program
(`megalite.pipeline.programs.build_program`) on a machine where each pass costs its compute and a
pass that needs another rank's output (an activation forward, a gradient backward) waits `transfer`
seconds after that output is done. What the boundary exchanges add to the step is the step so
played minus the same step with free transfers: only the exchanges on the schedule's critical path
count, the others hide behind the receiver's other passes.

Sends are taken as posted without blocking the sender (megalite posts each exchange point's batch
with `batch_isend_irecv`), and a message as moving once it is sent and its receiver has posted the
receive, at the exchange point the executor's plan gives it (`receives_posted`: gloo moves bytes
only to a posted receive). One-chunk and V programs post their receives early, at the first
exchange point after the send on an ideal machine (`replay.exchange_plans`); where a transfer is
longer than that leaves it, the rest of it is on the receiver's path (1F1B at pp 2 with 2 MiB
activations across the emulated link: the last stage waited out each activation whole,
docs/slow-links.md (f), "pp's waits read per rank"). Interleaved programs post where they read. A rank's
messages leave over one link (a node's NIC; a host's egress on docs/slow-links.md's emulated link),
one at a time in the order it made them: a message made while the one before is still on the wire
waits for it. That is what a warm-up's back-to-back forwards meet when a transfer is longer than a
forward (--pipeline-extra-warmup adds one), and why the messages of a step played without the
queue arrived earlier than the real ones. The chunks that
meet at the tip of a V (zb-v, dualpipev) hand over on the same rank, at no cost. An overlapped pair
("O") runs its passes one after the other, as `megalite.pipeline.simulator` plays it."""
from __future__ import annotations

from megalite.pipeline.programs import build_program, is_v_shaped
from megalite.pipeline.replay import exchange_plans
from megalite.pipeline.simulator import _play


def receives_posted(p: int, m: int, v: int | None, kind: str, extra_warmup: int = 0) -> dict:
    """Where the executor posts each message's receive: {(kind, sending virtual stage, micro-batch):
    the position of the exchange point in the receiver's program} (its plan at the default pass
    costs, as `megalite.training.step` builds it without --pipeline-pass-costs)."""
    plans = exchange_plans(p, m, v if v and v > 1 else None, kind, extra_warmup=extra_warmup)
    return {(msg.kind, msg.src, msg.micro_batch): x.index for plan in plans for x in plan for msg in x.recvs}


def played_step(p: int, m: int, v: int | None, kind: str, f, b, w, transfer: float, extra_warmup: int = 0) -> float:
    """Seconds of one step of `kind` ("1f1b", interleaved with v > 1, "zb-h1", "zb-v", "dualpipev")
    over p ranks and m micro-batches, a chunk's forward costing f, its input-gradient pass b and its
    weight-gradient pass w (a program that does not split its backward runs b + w as one; each one
    number, or one per virtual stage), each message between two ranks arriving `transfer` seconds
    after its pass ends; `extra_warmup`: --pipeline-extra-warmup's programs."""
    programs = [build_program(p, r, m, v if v and v > 1 else None, kind, extra_warmup=extra_warmup) for r in range(p)]
    # (with free transfers a receive posted before its read holds nothing back)
    posted = receives_posted(p, m, v, kind, extra_warmup) if transfer else None
    return max(times[-1] for times in _play(programs, p, is_v_shaped(kind), f, b, w, transfer, posted)[1])


def exposed_transfers(p: int, m: int, v: int | None, kind: str, f, b, w, transfer: float,
                      extra_warmup: int = 0) -> float:
    """What the boundary transfers add to the step: played with them minus played without."""
    if p == 1:
        return 0.0
    return (played_step(p, m, v, kind, f, b, w, transfer, extra_warmup)
            - played_step(p, m, v, kind, f, b, w, 0.0, extra_warmup))
