"""Replay schedule programs' stage-to-stage messages under NCCL's matching rules.

NCCL ignores tags: the k-th send from rank a to rank b meets the k-th receive that b posts from a,
whatever each was meant to carry. A batch of p2p ops (`batch_isend_irecv`, one NCCL group) posts
its ops in order, and the rank waits for all of them before it runs anything else. So a schedule
is correct on GPUs only if, for every ordered pair of ranks, the order of sends equals the order
of receives, and the batches never wait on each other in a cycle. Gloo matches by tag and hides
mistakes; `check_nccl_order` replays every rank's exchange plan (the one `run_schedule` follows)
and raises `ScheduleError` on the first wrongly matched message or on a deadlock. `exchange_plans`
gives every rank's plan for a schedule.
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

from megalite.pipeline.partition import stage_rank, virtual_stage
from megalite.pipeline.programs import build_program, is_one_chunk_program, is_v_shaped
from megalite.pipeline.simulator import _play


class ScheduleError(RuntimeError):
    """A schedule's messages would be matched wrongly or would deadlock."""


@dataclass(frozen=True)
class Message:
    """One tensor between virtual stages: an activation ("F") from src to src+1, or its gradient
    ("B") from src to src-1. Every message has the executor's one tensor shape."""
    kind: str
    src: int  # virtual stage that sends
    dst: int  # virtual stage that receives
    micro_batch: int


@dataclass
class Exchange:
    """One exchange point of a rank's program: what it sends and receives, in posting order."""
    index: int  # position of the X op in the program (len(program) for the guard after the end)
    sends: list[Message]
    recvs: list[Message]


def incoming(kind: str, chunk: int, micro_batch: int, p: int, r: int, num_chunks: int,
             v_shape: bool = False) -> Message | None:
    """The message a pass of (chunk, micro-batch) on rank r must receive first, if any (from
    another rank, or from this rank's other chunk at the tip of a V: see `is_local`)."""
    vs = virtual_stage(p, r, chunk, v_shape)
    if kind == "F" and vs != 0:
        return Message("F", vs - 1, vs, micro_batch)
    if kind == "B" and vs != p * num_chunks - 1:
        return Message("B", vs + 1, vs, micro_batch)
    return None


def outgoing(kind: str, chunk: int, micro_batch: int, p: int, r: int, num_chunks: int,
             v_shape: bool = False) -> Message | None:
    """The message a pass of (chunk, micro-batch) on rank r produces for another stage, if any."""
    vs = virtual_stage(p, r, chunk, v_shape)
    if kind == "F" and vs != p * num_chunks - 1:
        return Message("F", vs, vs + 1, micro_batch)
    if kind == "B" and vs != 0:
        return Message("B", vs, vs - 1, micro_batch)
    return None


def is_local(message: Message, p: int, v_shape: bool = False) -> bool:
    """Whether both ends of a message are on one rank (the tip of a V): handed over, never sent."""
    return stage_rank(p, message.src, v_shape) == stage_rank(p, message.dst, v_shape)


def exchange_plan(program, p: int, r: int, num_chunks: int, v_shape: bool = False) -> list[Exchange]:
    """Every exchange point of rank r's program: it sends what the passes since the previous one
    produced (in the order produced) and receives what the passes up to the next one need (in the
    order needed). Sends left after the last exchange point get one of their own. Messages between
    two chunks of this rank are not in the plan."""
    plan: list[Exchange] = []
    pending: list[Message] = []
    for i, op in enumerate(program):
        if op.kind == "X":
            plan.append(Exchange(i, pending, []))
            pending = []
            continue
        need = incoming(op.kind, op.chunk, op.micro_batch, p, r, num_chunks, v_shape)
        if need is not None and not is_local(need, p, v_shape):
            if not plan:
                raise ScheduleError(f"schedule program receives before any exchange point: {op}")
            plan[-1].recvs.append(need)
        made = outgoing(op.kind, op.chunk, op.micro_batch, p, r, num_chunks, v_shape)
        if made is not None and not is_local(made, p, v_shape):
            pending.append(made)
    if pending:
        plan.append(Exchange(len(program), pending, []))
    return plan


def early_exchange_plans(programs, times, p: int, num_chunks: int, v_shape: bool = False,
                         lead: int = 0) -> list[list[Exchange]]:
    """Every rank's exchange plan (`exchange_plan`'s sends), with each receive posted at the first
    exchange point of the receiver that comes after the sender posts it on an ideal machine
    (`times[r][i]`: when rank r reaches position i of its program), and no later than the pass
    that reads it. A program whose passes of two kinds share a pair of ranks in another order on
    each side (the V's activations and gradients) stays right under NCCL's in-order matching: on
    each pair the receives are posted in the order of the sends, a receive moving earlier where
    one sent after it is needed first. Posting early also keeps a sender from waiting on a
    receive posted only when its pass comes. `lead`: each gradient's receive that many exchange
    points earlier still (posted before its send: gloo then moves the bytes the moment they are
    sent; the activations' receives already come a pass before they are read)."""
    plans = [exchange_plan(prog, p, r, num_chunks, v_shape) for r, prog in enumerate(programs)]
    sent_at = {m: times[r][x.index] for r, plan in enumerate(plans) for x in plan for m in x.sends}
    order: dict[tuple[int, int], list[Message]] = {}  # (from rank, to rank) -> sends, in posting order
    for r, plan in enumerate(plans):
        for x in plan:
            for m in x.sends:
                order.setdefault((r, stage_rank(p, m.dst, v_shape)), []).append(m)
    position = {m: k for msgs in order.values() for k, m in enumerate(msgs)}
    for r, plan in enumerate(plans):
        reached = [times[r][x.index] for x in plan]  # non-decreasing: the program runs in order
        at = {}
        for last, x in enumerate(plan):  # the point before the pass that reads it, or the first after its send
            for m in x.recvs:
                ahead = lead if m.kind == "B" else 0
                at[m] = max(0, min(bisect.bisect_left(reached, sent_at[m]) - ahead, last))
        for (src, dst), msgs in order.items():  # sends' order: a message is received no later than one after it
            if dst != r:
                continue
            earliest = len(plan)
            for m in reversed(msgs):
                at[m] = earliest = min(at[m], earliest)
        for x in plan:
            x.recvs = []
        for m in sorted(at, key=lambda m: (at[m], stage_rank(p, m.src, v_shape), position[m])):
            plan[at[m]].recvs.append(m)
    return plans


def check_nccl_order(plans: list[list[Exchange]], p: int, v_shape: bool = False) -> int:
    """Replay every rank's exchange plan (plans[r] for pipeline rank r) with untagged, per-pair FIFO
    matching and blocking batches. Returns the number of messages; raises ScheduleError if a
    receive would get a message meant for another, or if the ranks would wait on each other."""
    batches = [[x for x in plan if x.sends or x.recvs] for plan in plans]
    sent: dict[tuple[int, int], list[Message]] = {}  # (from rank, to rank) -> posted sends, in order
    received: dict[tuple[int, int], list[Message]] = {}
    waiting: list[list[tuple[str, tuple[int, int], int]] | None] = [None] * p  # posted, unmatched ops
    pos = [0] * p
    while True:
        progressed = False
        for r in range(p):
            if pos[r] == len(batches[r]):
                continue
            if waiting[r] is None:  # post the batch, in order: sends, then receives
                batch, waiting[r] = batches[r][pos[r]], []
                for msg in batch.sends:
                    pair = (r, stage_rank(p, msg.dst, v_shape))
                    sent.setdefault(pair, []).append(msg)
                    waiting[r].append(("send", pair, len(sent[pair]) - 1))
                for msg in batch.recvs:
                    pair = (stage_rank(p, msg.src, v_shape), r)
                    received.setdefault(pair, []).append(msg)
                    waiting[r].append(("recv", pair, len(received[pair]) - 1))
                progressed = True
            waiting[r] = [w for w in waiting[r] if not _matched(w, sent, received, r)]
            if not waiting[r]:
                waiting[r] = None
                pos[r] += 1
                progressed = True
        if all(pos[r] == len(batches[r]) for r in range(p)):
            return sum(len(v) for v in sent.values())
        if not progressed:
            stuck = [f"rank {r} at exchange point {batches[r][pos[r]].index}" for r in range(p)
                     if pos[r] < len(batches[r])]
            raise ScheduleError("pipeline exchanges deadlock under NCCL ordering: " + ", ".join(stuck))


def _matched(waiter, sent, received, rank) -> bool:
    side, pair, k = waiter
    if len(sent.get(pair, ())) <= k or len(received.get(pair, ())) <= k:
        return False
    if sent[pair][k] != received[pair][k]:
        raise ScheduleError(f"rank {pair[1]}'s receive #{k} from rank {pair[0]} expects {received[pair][k]} "
                            f"but gets {sent[pair][k]} (NCCL matches untagged p2p in posting order)")
    return True


def posts_receives_early(p: int, v: int | None, kind: str, paired: bool = False) -> bool:
    """Whether `exchange_plans` posts the program's receives early: the V programs, and 1f1b and
    zb-h1 with one chunk a rank and no pairs. gloo sends a message's bytes only once the receiver
    has posted its receive, so a receive posted where it is read puts the whole transfer on the
    receiver's path however early the sender sent it (measured across the emulated link:
    docs/slow-links.md (f), "Pipeline transfers"). Interleaved and paired programs keep theirs."""
    return is_v_shaped(kind) or is_one_chunk_program(p, kind, v, paired)


@functools.lru_cache(maxsize=16)
def exchange_plans(p: int, m: int, v: int | None = None, kind: str = "1f1b", costs: tuple = (1, 1, 1),
                   extra_warmup: int = 0) -> list:
    """Every rank's exchange plan for `kind` (what `run_schedule` posts at each exchange point and
    `megalite.pipeline.replay.check_nccl_order` checks): where `posts_receives_early`, each receive
    at the first exchange point after its send on an ideal machine (a one-chunk program's gradients
    one point earlier), in the order of the sends on its pair of ranks (`early_exchange_plans`);
    others where it is read."""
    v_shape = is_v_shaped(kind)
    chunks = 2 if v_shape else (v if v and v > 1 else 1)
    programs = [build_program(p, r, m, v, kind, costs, extra_warmup=extra_warmup) for r in range(p)]
    if not posts_receives_early(p, v, kind):
        return tuple(tuple(exchange_plan(prog, p, r, chunks)) for r, prog in enumerate(programs))
    reach = _play(programs, p, v_shape, *costs)[1]
    # One-chunk programs post each gradient's receive one exchange point before the ideal machine's
    # send, where NCCL's blocking batches allow it, else at it; the V programs at it.
    for lead in ((1, 0) if not v_shape else (0,)):
        plans = early_exchange_plans(programs, reach, p, chunks, v_shape, lead)
        try:
            check_nccl_order(plans, p, v_shape)  # every rank builds the same plans: each checks them once
        except ScheduleError:
            if lead == 0:
                raise
            continue
        return tuple(tuple(plan) for plan in plans)


def check_schedule(p: int, m: int, v: int | None = None, kind: str = "1f1b", extra_warmup: int = 0) -> int:
    """check_nccl_order for the plans `exchange_plans` gives every rank; returns the messages."""
    return check_nccl_order(exchange_plans(p, m, v, kind, extra_warmup=extra_warmup), p, is_v_shaped(kind))
