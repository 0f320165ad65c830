"""The gradient buffer's layout as a pure function (`plan_layout`): which parameters share a
bucket, in what order, and where each starts. `megalite.optim.buffers` lays its buffers out by it;
the planner (megalite.tools.plan) calls it too, so its byte counts and overlap model see the same
buckets.

Bucket sizes ramp up: the first bucket backward fills holds about `first_bucket_target(bucket_numel)`
elements (at most FIRST_BUCKET_NUMEL, a quarter of `bucket_numel`), each next one twice the one
before, until `bucket_numel`. Why (docs/optimizer.md, "Bucket sizes"): bucket k's reduction can
start only once backward has produced all of it, so the link idles until the first bucket is full;
a small first bucket starts it early. Each collective also pays a start-up cost (microseconds on
NVLink or InfiniBand, 3-4 ms on the emulated slow link of docs/slow-links.md), so tiny buckets
throughout would waste it: doubling reaches `bucket_numel` after log2(bucket_numel / first)
buckets, a few extra collectives in all. PyTorch's DDP caps its first bucket (1 MiB) for the same
reason.
"""
from __future__ import annotations

from dataclasses import dataclass

ALIGN_NUMEL = 64  # every parameter, bucket and DP shard starts at a multiple of this many elements

# The first bucket's cap: 1 MiB of fp32 gradients, PyTorch DDP's first-bucket size. The optimum of
# the model above is about the elements backward produces in two start-up costs (halving the first
# bucket gains half its fill time, costs one more collective): ~10^5-10^6 on GPUs, where a rank's
# backward produces some 10^9-10^10 gradient elements a second and a collective starts in ~50 us.
FIRST_BUCKET_NUMEL = 1 << 18
RAMP_FACTOR = 2  # each bucket's target is this times the previous one's, up to bucket_numel


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class BucketLayout:
    """One planned bucket: `members` index the parameter list given to `plan_layout`, `ranges`
    are their (lo, hi) element ranges in the buffer, [start, end) the bucket's padded extent."""
    members: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    start: int
    end: int
    deferred: bool

    @property
    def real_numel(self) -> int:
        return sum(hi - lo for lo, hi in self.ranges)

    def owned_numel(self, dp_size: int, dp_rank: int) -> int:
        """Parameter elements (padding excluded) in DP rank `dp_rank`'s shard of this bucket."""
        shard = (self.end - self.start) // dp_size
        own_lo = self.start + dp_rank * shard
        own_hi = own_lo + shard
        return sum(max(0, min(hi, own_hi) - max(lo, own_lo)) for lo, hi in self.ranges)


def first_bucket_target(bucket_numel: int, first_bucket_numel: int | None = None) -> int:
    """Elements the first bucket closes at: `first_bucket_numel` if given (>= bucket_numel: no ramp,
    every bucket bucket_numel, megalite's layout before the ramp), else FIRST_BUCKET_NUMEL but at
    most a quarter of bucket_numel (so that a ramp of at least two steps exists whatever the size)."""
    if first_bucket_numel is None:
        first_bucket_numel = min(FIRST_BUCKET_NUMEL, bucket_numel // 4)
    return max(1, min(first_bucket_numel, bucket_numel))


def bucket_targets(bucket_numel: int, first_bucket_numel: int | None = None):
    """The sizes (elements) at which the 1st, 2nd, ... non-deferred bucket closes: a geometric
    ramp from `first_bucket_target` to bucket_numel, then bucket_numel for good."""
    target = first_bucket_target(bucket_numel, first_bucket_numel)
    while True:
        yield target
        target = min(bucket_numel, target * RAMP_FACTOR)


def plan_layout(params: list[tuple[int, bool]], bucket_numel: int, dp_size: int,
                units: list[list[int]] | None = None, first_bucket_numel: int | None = None) -> list[BucketLayout]:
    """Buffer layout of parameters given as (numel, deferred) in definition order: reverse order
    (roughly the order backward produces gradients), a bucket closes once its parameters hold its
    target (`bucket_targets`: small first, growing to bucket_numel), deferred parameters in buckets
    of their own (outside the ramp: they are reduced after backward). Each parameter starts at a
    multiple of ALIGN_NUMEL; each bucket's size is a multiple of ALIGN_NUMEL * dp_size, so it
    splits into equal DP shards that start aligned. `units` (ZeRO-3: one per layer) gives the
    buckets instead, as lists of indices into `params`; a unit is deferred when all of it is."""
    if units is not None:
        groups = [(list(u), all(params[k][1] for k in u)) for u in units]
    else:
        groups = _size_buckets(params, bucket_numel, first_bucket_numel)

    layout, offset = [], 0
    for members, is_deferred in groups:
        start, ranges = offset, []
        for k in members:
            offset = _round_up(offset, ALIGN_NUMEL)
            ranges.append((offset, offset + params[k][0]))
            offset += params[k][0]
        offset = start + _round_up(offset - start, ALIGN_NUMEL * dp_size)
        layout.append(BucketLayout(tuple(members), tuple(ranges), start, offset, is_deferred))
    return layout


def _size_buckets(params: list[tuple[int, bool]], bucket_numel: int,
                  first_bucket_numel: int | None = None) -> list[tuple[list[int], bool]]:
    groups: list[tuple[list[int], bool]] = []
    targets = bucket_targets(bucket_numel, first_bucket_numel)
    target = next(targets)
    current: list[int] = []
    size = 0
    for k in reversed(range(len(params))):
        numel, is_deferred = params[k]
        if is_deferred:
            groups.append(([k], True))
            continue
        current.append(k)
        size += numel
        if size >= target:
            groups.append((current, False))
            current, size, target = [], 0, next(targets)
    if current:
        groups.append((current, False))
    return groups
