"""An overlapped pair (`megalite.parallel.lanes`) played with its exchanges: one micro-batch's
forward and another's backward, each a list of (compute seconds, exchange seconds[, hand over])
items: compute, then launch an exchange; hand over False: an exchange run in place, the turn kept
(`lanes.collective(hand_over=False)`, for the few bytes of the MoE counts). The rules are the
lanes': one lane computes at a time and keeps the turn until it launches an exchange, then hands
the turn over, whatever the other lane's exchange is doing; the link carries one exchange at a
time, in launch order (a CUDA device's one NCCL stream; on gloo the two lanes' exchanges fly side
by side and share the link, which keeps it as busy: the play gives the earlier exchange the whole
rate first); a lane given the turn back waits for its own exchange first. So each exchange hides
behind the other lane's next compute item only, and what sticks out of it is exposed; once one
lane is done, the other's exchanges are all exposed. The forward lane starts.

`megalite.tools.plan.exposed.ep_exposure` builds the items of a stage's MoE layers (per layer the
forward's attention and router, the counts' all-gather, the dispatch, the experts, the combine;
the backward's combine, expert backward, dispatch, attention backward).

A link may have a token bucket (`Bucket`: docs/slow-links.md's tc-tbf link); the plays then carry
each exchange on a `Link`, which gives an exchange launched after the link has idled the bytes
the bucket refilled meanwhile at full speed."""
from __future__ import annotations

from typing import NamedTuple

Items = list[tuple]  # (compute seconds, then an exchange of this many seconds (0: none)[, hand over: True])


class Bucket(NamedTuple):
    """A link's token bucket: `burst` seconds of the link's rate (its bytes cross at once when the
    bucket is full) and the `latency` every exchange starts with (an exchange's seconds are its
    latency plus its bytes at the rate). Bucket() (a real fabric): each exchange takes its seconds."""
    burst: float = 0.0
    latency: float = 0.0


class Link:
    """One link carrying exchanges one after another (each put on it no earlier than the one before
    ended). The bucket starts full, refills at the rate while no bytes flow (at most `burst`), and
    an exchange's bytes take what it holds at once: tc-tbf's rule."""

    def __init__(self, bucket: Bucket = Bucket()):
        self.burst, self.latency = bucket
        self.tokens, self.free = self.burst, 0.0

    def carry(self, start: float, seconds: float) -> float:
        """When an exchange of `seconds` put on the link at `start` is done."""
        if self.burst <= 0:
            return start + seconds
        transfer = max(0.0, seconds - self.latency)
        begin = start + seconds - transfer  # its bytes flow after the start-up
        self.tokens = min(self.burst, self.tokens + max(0.0, begin - self.free))
        at_once = min(transfer, self.tokens)
        self.tokens -= at_once
        self.free = max(self.free, begin + transfer - at_once)
        return self.free


def played_pair(forward: Items, backward: Items, wgrad: float = 0.0, bucket: Bucket = Bucket()) -> float:
    """Seconds from the pair's start until both lanes are done. `wgrad` (--delay-wgrad-compute): the
    share of each backward item's compute that is weight-gradient work lent to the waits (`_Filler`);
    `bucket`: the link's (`Link`)."""
    # a lane whose last item launches an exchange still waits for it before it ends
    lanes = {k: [(*item, True)[:3] for item in v] + ([(0.0, 0.0, True)] if v and v[-1][1] > 0 else [])
             for k, v in (("F", forward), ("B", backward))}
    pending = {"F": 0.0, "B": 0.0}  # when each lane's exchange in flight is done
    filler, link = _Filler(), Link(bucket)
    now, turn = 0.0, "F"
    while lanes["F"] or lanes["B"]:
        other = "B" if turn == "F" else "F"
        if not lanes[turn]:
            turn = other
            continue
        now = max(filler.fill(now, pending[turn]), pending[turn])  # its own exchange first
        compute, exchange, hand_over = lanes[turn].pop(0)
        if turn == "B":
            compute = filler.lend(compute, wgrad)
        now += compute
        if turn == "B" and not lanes["B"]:
            now = filler.finish(now)  # the backward's W: what no wait took
        if not hand_over:  # run in place: the lane keeps the turn (and waits for it)
            done = link.carry(max(now, pending[other]), exchange)  # (launched once the other lane's is done)
            now = max(filler.fill(now, done), done)
            continue
        launched = exchange > 0
        if launched:  # on the link once the other lane's exchange is done; the lane goes on
            pending[turn] = link.carry(max(now, pending[other]), exchange)
        # the turn passes at a launched exchange, or when the lane ends (`_Pair.end`)
        if (launched or not lanes[turn]) and lanes[other]:
            turn = other
    return max(now, pending["F"], pending["B"])


class _Filler:
    """A backward's weight-gradient work lent to the waits (megalite.parallel.weight_grad under
    --delay-wgrad-compute): `wgrad` of each backward item's compute, in two pieces (a layer's weight
    GEMMs are a few), recorded as the item runs. A lane that would wait for an exchange runs the
    pieces, in order, until it is done; a piece begun runs to its end, past it if it must. What is
    left runs when the backward ends."""

    def __init__(self):
        self.pieces: list[float] = []

    def lend(self, compute: float, wgrad: float) -> float:
        """The compute a backward item does in place; its weight-gradient share is lent."""
        if wgrad <= 0 or compute <= 0:
            return compute
        self.pieces += [compute * wgrad / 2] * 2
        return compute * (1 - wgrad)

    def fill(self, now: float, until: float) -> float:
        while now < until and self.pieces:
            now += self.pieces.pop(0)
        return now

    def finish(self, now: float) -> float:
        now += sum(self.pieces)
        self.pieces.clear()
        return now


def alone_played(items: Items, wgrad: float = 0.0, bucket: Bucket = Bucket()) -> float:
    """Seconds a pass run alone takes: each exchange waited for, meanwhile (a backward, `wgrad` > 0)
    the weight-gradient work lent so far (`_Filler`); `bucket`: the link's (`Link`)."""
    filler, link, now = _Filler(), Link(bucket), 0.0
    for compute, exchange, *hand_over in items:
        now += filler.lend(compute, wgrad)
        in_place = hand_over and not hand_over[0]  # (the counts' all-gather: waited for at once)
        done = link.carry(now, exchange) if exchange > 0 else now
        now = max(now if in_place else filler.fill(now, done), done)
    return filler.finish(now)


def pair_exposed(forward: Items, backward: Items, wgrad: float = 0.0, bucket: Bucket = Bucket()) -> float:
    """What the exchanges add to the pair: played minus the two lanes' compute."""
    return (played_pair(forward, backward, wgrad, bucket) - sum(item[0] for item in forward)
            - sum(item[0] for item in backward))


def alone_exposed(items: Items, wgrad: float = 0.0, bucket: Bucket = Bucket()) -> float:
    """A lane run alone waits for each of its exchanges: all of them exposed, but what the weight-
    gradient work lent to the waits covers (`alone_played`) and what the link's bucket carries at once."""
    if wgrad <= 0 and bucket.burst <= 0:
        return sum(item[1] for item in items)
    return alone_played(items, wgrad, bucket) - sum(item[0] for item in items)
