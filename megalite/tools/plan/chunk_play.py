"""A pass run alone with `--moe-dispatch-chunks N` (megalite.models.moe.chunked), played with its
exchanges: per MoE layer the local experts in N groups, each group's exchanges posted to the
lane's queue (`lanes.post`: one on the link at a time, in order, each launched when the one before
it has been waited for).

Forward, per layer: the attention and router; the counts' all-gather in place; every group's rows
posted; then per group, its rows waited for, its experts, its outputs posted; then every output
waited for. Backward: every group's output gradients posted (the last group first); per group,
last first, its gradients waited for, its experts' backward, its row gradients posted; every row
gradient waited for; then the attention's backward. A group's exchange carries 1/N of the rows
and pays the whole latency. With N = 1 this is `pair_play.alone_exposed`: every exchange exposed.

Ops: ("compute", s), ("post", name, s), ("wait", name), ("in place", s)."""
from __future__ import annotations


def played_alone(ops: list[tuple]) -> float:
    """Seconds from the pass's start to its end."""
    now = link = 0.0
    queue: list[list] = []  # [name, seconds, done at (None: not launched)] in post order
    retired: set[str] = set()

    def launch(item):
        nonlocal link
        item[2] = link = max(now, link) + item[1]

    for op in ops:
        if op[0] == "compute":
            now += op[1]
        elif op[0] == "in place":
            now = link = max(now, link) + op[1]
        elif op[0] == "post":
            queue.append([op[1], op[2], None])
            if len(queue) == 1:
                launch(queue[0])
        else:  # wait: for it and everything posted before it, launching each next as one is done
            while op[1] not in retired:
                head = queue.pop(0)
                now = max(now, head[2])
                retired.add(head[0])
                if queue:
                    launch(queue[0])
    return max(now, link)


def pass_ops(e, groups: int, kind: str) -> list[tuple]:
    """One pass's ops (`kind` "F" or "B") from `exposed.ep_parts` `e`, its layers in `groups` groups."""
    share = e.half_f if kind == "F" else e.half_b  # exchanges each way a layer, each cut into the groups
    part = share * (e.lat + (e.x - e.lat) / groups)
    ops: list[tuple] = []
    for layer in range(e.layers):
        rows = [f"{kind}{layer} rows {g}" for g in range(groups)]
        outputs = [f"{kind}{layer} outputs {g}" for g in range(groups)]
        if kind == "F":
            ops.append(("compute", e.pre_f))
            ops += [("in place", e.lat)] if e.counts else []
            ops += [("post", name, part) for name in rows]
            for g in range(groups):
                ops += [("wait", rows[g]), ("compute", e.e_f / groups), ("post", outputs[g], part)]
            ops.append(("wait", outputs[-1]))
        else:  # the gradients: outputs' out, rows' home
            ops += [("in place", e.lat)] * max(0, e.counts - 1)  # the recomputed forward's counts
            ops += [("post", outputs[g], part) for g in reversed(range(groups))]
            for g in reversed(range(groups)):
                ops += [("wait", outputs[g]), ("compute", e.e_b / groups), ("post", rows[g], part)]
            ops += [("wait", rows[0]), ("compute", e.pre_b)]
    return ops


def chunked_alone_exposed(e, groups: int, kind: str) -> float:
    """What a pass alone waits for beyond its compute."""
    ops = pass_ops(e, groups, kind)
    return played_alone(ops) - sum(op[1] for op in ops if op[0] == "compute")
