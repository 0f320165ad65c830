"""ZeRO stage 3 (`ShardedParamBuffer`; the module hooks that gather its units are in zero3_hooks.py;
import both from `megalite.optim.zero`).

Stage 3 (`ShardedParamBuffer`): parameters sharded too. Buckets are *units*: one per transformer
layer, one for the rest of the chunk (embeddings, final norm, output layer), one for a tied
embedding shared with another stage. A unit's whole parameters exist only while it is gathered;
the parameters stay views of its whole buffer, whose storage is resized to zero when freed (the
tensors autograd saved for backward are views of the same storage, so a re-gather before backward
refills them). `attach_unit_hooks` gathers each layer just before its forward (the next layer's
gather is prefetched asynchronously), frees it after (`reshard_after_forward`), gathers it again when
backward reaches its output (prefetching the layer before), and frees it once its gradients are
reduce-scattered. Gathered at once: the chunk's rest unit and at most two layers.

At a turn from one pass of a chunk to the next (`keep_at_turns`: one chunk a rank, resharding after
forward), the units a pass ends with and the next begins with stay whole instead of being freed and
gathered again: a forward ends with its last layer and the chunk's rest, which a backward (or, for
the rest, another forward) begins with; a backward ends with its first layer (and, where the chunk
holds the embeddings, the rest), which a forward begins with. The parameters do not change within a
step, so the numbers are the same. What a pass does not begin with is freed when it begins
(`begin_pass`), so no more units are whole at once than before; but the first layer kept at a
backward's end is whole while the embedding's gradient bucket is open (the planner's replay counts it).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from megalite.optim import buffers as _buffers
from megalite.optim import fp8_gather
from megalite.optim.buffers import Bucket
from megalite.optim.zero2 import ShardedGradBuffer
from megalite.parallel import traffic

FREE, GATHERING, WHOLE = "free", "gathering", "whole"


@dataclass
class _Unit:
    whole: torch.Tensor  # the unit's whole parameters; storage resized to 0 while free
    state: str = WHOLE
    work: object = None
    holds: int = 0  # forwards waiting for their backward (reshard_after_forward=False)
    parked: bool = False  # parameters are empty placeholders (see ShardedParamBuffer.park)
    fp8: bool = False  # filled with its FP8 weights as FP8 (`use_fp8_param_gather`): their model-dtype values absent
    pending: object = None  # (PackPlan, the gathered chunks), placed when the gather is waited for


class ShardedParamBuffer(ShardedGradBuffer):
    """ZeRO-3: parameters and gradients sharded; each unit (bucket) gathered when it is used."""
    zero_stage = 3

    def __init__(self, params, *, reshard_after_forward: bool = True, keep_params_for_step: bool = False,
                 **kwargs):
        self.reshard_after_forward = reshard_after_forward
        self.keep_params_for_step = keep_params_for_step
        self.pinned = False
        self.gather_log: list[tuple[int, str]] = []  # (unit, "forward" / "backward" / ...) per gather
        # Timeline spans (ShardedGradBuffer's) add each gather from its launch to its completion (on
        # gloo, megalite's point-to-point gather is seen done when the rank next gathers or waits:
        # `_poll`), and each wait for one (what prefetching did not hide).
        self.layer_unit_indices: set[int] = set()  # filled by attach_unit_hooks
        # Zero-bubble schedules: parameters of a unit a B is done with (their W brings the
        # gradients), and units a B released whose W is still to come, by unit.
        self._seen_in_b: dict[int, set[int]] = {}
        self._released_in_b: dict[int, int] = {}
        self.fp8_plans: dict = {}  # unit -> its PackPlan (--fp8-param-gather)
        # Kept whole from the end of a pass to the next pass's start (attach_unit_hooks fills the sets):
        # after a forward, `turn_units["forward"]` (the last layer's units and the rest); after a
        # backward, the first layer's units, and the rest released after them (`_first_layer_done`).
        self.turn_units: dict[str, set[int]] = {"forward": set(), "backward": set()}
        self.first_layer_units: set[int] = set()
        self.turn_kept: set[int] = set()
        self._first_layer_done = False
        super().__init__(params, **kwargs)

    def _allocate_params(self) -> None:
        shard = self.numel // self.dp_size
        self.param_shard = torch.zeros(shard, dtype=self.param_dtype, device=self.device)
        self.fp32_init = None if self.param_dtype == torch.float32 else torch.zeros(
            shard, dtype=torch.float32, device=self.device)
        self.units: list[_Unit] = []
        self._shapes = {id(p): p.shape for p in self.params}  # to give parked parameters their views back
        for bucket in self.buckets:
            whole32 = torch.zeros(bucket.numel, dtype=torch.float32, device=self.device)
            for p in bucket.params:
                lo = self.offset[id(p)] - bucket.start
                whole32[lo:lo + p.numel()].copy_(p.detach().reshape(-1))
            own_lo, own_hi = self.owned_range(bucket)
            base = bucket.start // self.dp_size
            self.param_shard[base:base + own_hi - own_lo].copy_(whole32[own_lo:own_hi])
            if self.fp32_init is not None:
                self.fp32_init[base:base + own_hi - own_lo].copy_(whole32[own_lo:own_hi])
            whole = whole32 if self.param_dtype == torch.float32 else whole32.to(self.param_dtype)
            for p in bucket.params:
                lo = self.offset[id(p)] - bucket.start
                p.data = whole[lo:lo + p.numel()].view(p.shape)
                if getattr(p, "expert_parallel", False):
                    # Torch refuses to slice a tensor whose storage is freed (it checks the bounds), and
                    # a save names each expert apart: take the experts' views now, while the storage
                    # exists. They stay aliases of the unit across gathers (resize_ keeps the storage).
                    p.expert_views = p.data.unbind(0)
            whole.untyped_storage().resize_(0)  # free until first used
            self.units.append(_Unit(whole, state=FREE))

    def param_slice(self, lo: int, hi: int) -> torch.Tensor:
        a, b = self._shard_range(lo, hi)
        return self.param_shard[a:b]

    def initial_fp32(self, lo: int, hi: int) -> torch.Tensor:
        a, b = self._shard_range(lo, hi)
        return self.fp32_init[a:b]

    def stored_bytes(self) -> dict[str, int]:
        return {"params": self.param_shard.nbytes, "grads": self.grad_shard.nbytes, **self.step_peaks}

    def use_fp8_param_gather(self, states: dict) -> None:
        """Gather these weights (id -> their megalite.parallel.fp8_linear.FP8Linear, delayed scaling)
        as FP8 in the forward and backward gathers (megalite.optim.fp8_gather); a save, an export or
        a refresh gathers them in the model dtype."""
        self.dp_rank = torch.distributed.get_rank(self.dp_group) if self.dp_size > 1 else 0
        for bucket in self.buckets:
            weights = [(p, states[id(p)], self.offset[id(p)] - bucket.start, self._shapes[id(p)])
                       for p in bucket.params if id(p) in states]
            if weights and self.dp_size > 1:
                self.fp8_plans[bucket.index] = fp8_gather.plan_unit(
                    bucket.numel, self.dp_size, weights, self.units[bucket.index].whole.element_size())

    # -- gathering and freeing units
    def gather(self, bucket: Bucket, wait: bool = True, why: str = "forward") -> None:
        """Start the all-gather of a unit's whole parameters unless it is under way or done;
        `wait` for it (else it is a prefetch, waited for where the unit is used)."""
        if self.spans is not None:
            self._poll()
        unit = self.units[bucket.index]
        if unit.state != FREE and unit.fp8 and not _fp8_allowed(why):  # a save needs the model-dtype values
            self._wait(unit)
            self._fill(bucket, why)
        if unit.state == FREE:
            unit.whole.untyped_storage().resize_(unit.whole.numel() * unit.whole.element_size())
            self._transient(unit.whole.nbytes, "gathered")
            self._unpark(bucket)  # views need the storage to exist
            self._fill(bucket, why)
        if wait:
            self._wait(unit)

    def _fill(self, bucket: Bucket, why: str) -> None:
        """All-gather the shards of `bucket` into its (allocated) whole buffer."""
        unit = self.units[bucket.index]
        base = bucket.start // self.dp_size
        shard = self.param_shard[base:base + bucket.numel // self.dp_size]
        start = time.perf_counter()
        plan = self.fp8_plans.get(bucket.index)
        unit.fp8 = plan is not None and _fp8_allowed(why)
        if plan is not None:
            fp8_gather.forget(plan)
        if self.dp_size == 1:
            unit.whole.copy_(shard)
        elif unit.fp8:
            chunk = fp8_gather.pack(plan, shard, self.dp_rank, record=torch.is_grad_enabled())
            gathered = torch.empty(self.dp_size * plan.chunk_bytes, dtype=torch.uint8, device=self.device)
            traffic.gather_or_scatter("dp", gathered.nbytes, self.dp_size)
            unit.work = _buffers._all_gather_single(gathered, chunk, group=self.dp_group, async_op=True)
            unit.pending = (plan, gathered)
        else:
            traffic.gather_or_scatter("dp", unit.whole.nbytes, self.dp_size)
            unit.work = _buffers._all_gather_single(unit.whole, shard, group=self.dp_group, async_op=True)
        unit.state = GATHERING
        self.gather_log.append((bucket.index, why))
        if self.spans is not None:
            self._span_when_done(unit.work, f"all-gather unit {bucket.index} ({why})", start)

    def _span_when_done(self, work, name: str, start: float) -> None:
        spans = self.spans

        def done(_=None):
            spans.append((name, "zero-gather", start, time.perf_counter() - start))
        if work is None:
            done()
        elif hasattr(work, "on_done"):  # point-to-point requests (collectives.all_gather_single on gloo)
            work.on_done(done)
        else:  # the communication thread completes it: no wait, no host sync on this thread
            work.get_future().add_done_callback(done)

    def _poll(self) -> None:
        """Stamp the end of every gather in flight that is done (requests without a future)."""
        for unit in self.units:
            if unit.state == GATHERING and hasattr(unit.work, "poll"):
                unit.work.poll()

    def _wait(self, unit: _Unit) -> None:
        if unit.state == GATHERING:
            if unit.work is not None:
                start = time.perf_counter()
                unit.work.wait()
                if self.spans is not None:
                    self.spans.append(("wait for a gather", "zero-wait", start, time.perf_counter() - start))
            if unit.pending is not None:
                fp8_gather.unpack(*unit.pending, unit.whole)
            unit.state, unit.work, unit.pending = WHOLE, None, None

    def _free(self, bucket: Bucket) -> None:
        unit = self.units[bucket.index]
        self.turn_kept.discard(bucket.index)
        if unit.state == FREE or self.pinned:
            return
        self._wait(unit)
        unit.whole.untyped_storage().resize_(0)
        self._transient(-unit.whole.nbytes, "gathered")
        unit.state, unit.holds, unit.fp8 = FREE, 0, False
        if bucket.index in self.fp8_plans:
            fp8_gather.forget(self.fp8_plans[bucket.index])

    def after_forward(self, bucket: Bucket, training: bool) -> None:
        """A unit's forward is done: free it, or keep it for the backward (or the step)."""
        unit = self.units[bucket.index]
        if not torch.is_grad_enabled():  # evaluation, or recomputation's first pass: no backward of it
            if not (self.keep_params_for_step and training):
                self._free(bucket)
        elif self.keep_params_for_step:
            pass
        elif self.reshard_after_forward:
            if bucket.index in self.turn_units["forward"]:  # the backward begins with it
                self.turn_kept.add(bucket.index)
            else:
                self._free(bucket)
        else:  # one hold per forward whose backward is still to come (1F1B runs several forwards
            # first); a layer called twice in one forward is held until finish_grad_sync frees it
            unit.holds += 1

    def _deferred_in_b(self, p: torch.nn.Parameter) -> None:
        bucket = self.bucket_of[id(p)]
        seen = self._seen_in_b.setdefault(bucket.index, set())
        seen.add(id(p))
        if len(seen) == len(bucket.params):  # B is done with the whole unit: release it now
            del self._seen_in_b[bucket.index]
            self._release_after_backward(bucket)
            self._released_in_b[bucket.index] = self._released_in_b.get(bucket.index, 0) + 1

    def _after_backward(self, bucket: Bucket) -> None:
        if self._released_in_b.get(bucket.index):  # its B released it already (a zero-bubble W)
            self._released_in_b[bucket.index] -= 1
            return
        self._release_after_backward(bucket)

    def _release_after_backward(self, bucket: Bucket) -> None:
        unit = self.units[bucket.index]
        unit.holds = max(0, unit.holds - 1)
        if unit.holds == 0 and not self.keep_params_for_step:
            first_layer = bucket.index in self.first_layer_units
            self._first_layer_done |= first_layer
            # A forward begins with it, and nothing of this backward is left to hold it through
            # (the last stage's output layer, released early, is freed as before).
            if bucket.index in self.turn_units["backward"] and (first_layer or self._first_layer_done):
                self.turn_kept.add(bucket.index)
            else:
                self._free(bucket)

    def begin_pass(self, kind: str) -> None:
        """A forward or backward (`kind`) of this chunk begins: of the units the last pass kept
        whole, those this pass does not begin with are freed; it finds the others gathered."""
        begins_with = self.turn_units["backward" if kind == "forward" else "forward"]  # what the other kind ends with
        for index in sorted(self.turn_kept - begins_with):
            self._free(self.buckets[index])
        self.turn_kept.clear()
        self._first_layer_done = False

    def finish_grad_sync(self) -> None:
        super().finish_grad_sync()
        self._seen_in_b.clear()
        self._released_in_b.clear()
        self._first_layer_done = False
        for bucket in self.buckets:  # the step is over: nothing stays gathered unless pinned
            self._free(bucket)

    def all_gather_params(self) -> None:
        """After the update only the shards are new: refill the units kept whole (pinned)."""
        kept = [(b, u) for b, u in zip(self.buckets, self.units) if u.state != FREE]
        for bucket, unit in kept:
            self._wait(unit)
            self._fill(bucket, "refresh")
        for _, unit in kept:
            self._wait(unit)

    def pin(self) -> None:
        with traffic.excluded():  # a save or an export, between steps: not a step's traffic
            for bucket in self.buckets:
                self.gather(bucket, wait=False, why="pin")
            for bucket in self.buckets:
                self.gather(bucket)
        self.pinned = True

    def unpin(self) -> None:
        self.pinned = False
        for bucket in self.buckets:
            self._free(bucket)

    def park(self) -> None:
        """Outside training (no autograd graph holds them), make the parameters of free units empty
        tensors: reading one then fails loudly instead of touching freed memory. The next gather
        gives them back their views (shapes included)."""
        for bucket, unit in zip(self.buckets, self.units):
            if unit.state == FREE and not unit.parked:
                for p in bucket.params:
                    p.data = unit.whole.new_empty(0)
                unit.parked = True

    def _unpark(self, bucket: Bucket) -> None:
        unit = self.units[bucket.index]
        if unit.parked:
            for p in bucket.params:
                lo = self.offset[id(p)] - bucket.start
                p.data = unit.whole[lo:lo + self.numel_of[id(p)]].view(self._shapes[id(p)])
            unit.parked = False

    def unit_storage_keys(self) -> list[int]:
        """The storage key of every unit (see `units_gathered_in_turn`). Parked parameters get their
        views (shapes) back first: a view needs its storage, so each parked unit is gathered and
        freed in turn (collective, like every gather)."""
        for bucket, unit in zip(self.buckets, self.units):
            if unit.parked:
                with traffic.excluded():  # checkpoint saves: not a step's traffic
                    self.gather(bucket, why="unpark")
                self._free(bucket)
        return [unit.whole.untyped_storage()._cdata for unit in self.units]

    @contextmanager
    def non_layer_units_gathered(self):
        """The chunk's units other than its layers (embeddings, final norm, output layer) gathered
        inside the block: what every forward holds anyway. A save cuts the vocabulary padding off
        these, and a cut view needs its storage."""
        held = [b for b in self.buckets if b.index not in self.layer_unit_indices and self.units[b.index].state == FREE]
        with traffic.excluded():
            for bucket in held:
                self.gather(bucket, why="save")
        try:
            yield
        finally:
            for bucket in held:
                self._free(bucket)

    def units_gathered_in_turn(self):
        """Each unit gathered in turn (and freed again after, if it was free): yields the key of its
        storage (`untyped_storage()._cdata`, shared by every view of it). A save copies each
        parameter while its unit is whole, holding one unit at a time. Collective over DP."""
        for bucket, unit in zip(self.buckets, self.units):
            was_free = unit.state == FREE
            with traffic.excluded():
                self.gather(bucket, why="save")
            yield unit.whole.untyped_storage()._cdata
            if was_free:
                self._free(bucket)


def _fp8_allowed(why: str) -> bool:
    """Whether a gather for `why` may bring FP8 weights as FP8: the training passes' gathers (and their
    prefetches), not a save's, an export's or the refresh after an update."""
    return why.split()[-1] in ("forward", "backward", "recompute")
