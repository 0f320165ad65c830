"""An overlapped pair (`megalite.parallel.lanes`) played with its exchanges: one micro-batch's
forward and another's backward, each a list of (compute seconds, exchange seconds[, hand over])
items: compute, then launch an exchange; hand over False: an exchange run in place, the turn kept
(`lanes.collective(hand_over=False)`, for the few bytes of the MoE counts). The rules are the lanes': one lane computes at a time and keeps the turn
until it launches an exchange, then hands the turn over; before launching, a lane waits for the
other lane's exchange still in flight (`_Pair.drain_other`: the link carries one at a time); a lane
given the turn back waits for its own exchange first. So each exchange hides behind the other
lane's next compute item only, and what sticks out of it is exposed; once one lane is done, the
other's exchanges are all exposed. The forward lane starts.

`megalite.tools.plan.exposed.ep_exposure` builds the items of a stage's MoE layers (per layer the
forward's attention and router, the counts' all-gather, the dispatch, the experts, the combine;
the backward's combine, expert backward, dispatch, attention backward)."""
from __future__ import annotations

Items = list[tuple]  # (compute seconds, then an exchange of this many seconds (0: none)[, hand over: True])


def played_pair(forward: Items, backward: Items) -> float:
    """Seconds from the pair's start until both lanes are done."""
    # a lane whose last item launches an exchange still waits for it before it ends
    lanes = {k: [(*item, True)[:3] for item in v] + ([(0.0, 0.0, True)] if v and v[-1][1] > 0 else [])
             for k, v in (("F", forward), ("B", backward))}
    pending = {"F": 0.0, "B": 0.0}  # when each lane's exchange in flight is done
    now, turn = 0.0, "F"
    while lanes["F"] or lanes["B"]:
        other = "B" if turn == "F" else "F"
        if not lanes[turn]:
            turn = other
            continue
        now = max(now, pending[turn])  # its own exchange first
        compute, exchange, hand_over = lanes[turn].pop(0)
        now += compute
        if exchange > 0 or not hand_over:
            now = max(now, pending[other])  # the other lane's exchange drained
        if not hand_over:  # run in place: the lane keeps the turn
            now += exchange
            continue
        launched = exchange > 0
        if launched:
            pending[turn] = now + exchange
        # the turn passes at a launched exchange, or when the lane ends (`_Pair.end`)
        if (launched or not lanes[turn]) and lanes[other]:
            turn = other
    return max(now, pending["F"], pending["B"])


def pair_exposed(forward: Items, backward: Items) -> float:
    """What the exchanges add to the pair: played minus the two lanes' compute."""
    return played_pair(forward, backward) - sum(item[0] for item in forward) - sum(item[0] for item in backward)


def alone_exposed(items: Items) -> float:
    """A lane run alone waits for each of its exchanges: all of them exposed."""
    return sum(item[1] for item in items)
