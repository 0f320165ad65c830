"""ZeRO stage 2 (`ShardedGradBuffer`; import it from `megalite.optim.zero`). Stage 3's buffer
(`zero3.py`) builds on this one.

Stage 2 (`ShardedGradBuffer`): parameters whole, as at stage 1; gradients are not. Every backward
collects each bucket's gradients in a transient fp32 bucket and reduce-scatters it the moment it
is complete; the rank adds its shard into an accumulator of numel/dp elements. At most
MAX_IN_FLIGHT whole buckets are held at once (older reductions are waited for first). With m
micro-batches a step makes m reduce-scatters where stage 1 makes one: the price of not holding
whole gradients between micro-batches (DeepSpeed's stage 2 pays the same).
"""
from __future__ import annotations

import bisect
import time
import warnings

import torch

from megalite.optim import buffers as _buffers
from megalite.optim.buffers import Bucket, ParamAndGradBuffer
from megalite.parallel import traffic, weight_grad

MAX_IN_FLIGHT = 2  # whole-bucket gradients held while their reduce-scatters run


class ShardedGradBuffer(ParamAndGradBuffer):
    """ZeRO-2: whole parameters, gradients reduce-scattered every backward into a 1/dp shard."""
    zero_stage = 2

    def __init__(self, params, **kwargs):
        kwargs["reduce_scatter"] = True
        # Timeline spans (name, category, start, duration) while a step records them: each wait for a
        # reduce-scatter (what the rest of the backward did not hide; stage 3 adds its gathers').
        self.spans: list | None = None
        super().__init__(params, **kwargs)

    def _allocate(self) -> None:
        self._allocate_params()
        self.grad_shard = torch.zeros(self.numel // self.dp_size, dtype=self.grad_dtype, device=self.device)
        self._in_flight: list[tuple[Bucket, torch.Tensor, object]] = []
        self._end_queued = False  # a backward touched this buffer: its end-of-backward callback is queued
        self._launched: set[int] = set()  # buckets launched in this backward
        self.unreached_warned = False
        self._starts = [b.start for b in self.buckets]
        # Bytes held beyond the shards, now and at their peak: whole-bucket gradients, gathered units.
        self.transient = {"grads": 0, "gathered": 0}
        self.peak = {"grads": 0, "gathered": 0, "total": 0}
        self._last_step_peaks = self._peaks()

    # -- where the layout's ranges are stored: this rank's shard of each bucket, bucket by bucket
    def _shard_range(self, lo: int, hi: int) -> tuple[int, int]:
        """[lo, hi) of the layout, inside this rank's shard of one bucket, in the shard storage
        (bucket b's shard starts at b.start / dp: every bucket is a multiple of dp long)."""
        bucket = self.buckets[bisect.bisect_right(self._starts, lo) - 1]
        own_lo, own_hi = (bucket.start + x for x in self.owned_range(bucket))
        if not own_lo <= lo <= hi <= own_hi:
            raise IndexError(f"[{lo}, {hi}) is not in DP rank {self.dp_rank}'s shard of bucket {bucket.index}")
        base = bucket.start // self.dp_size
        return base + lo - own_lo, base + hi - own_lo

    def grad_slice(self, lo: int, hi: int) -> torch.Tensor:
        a, b = self._shard_range(lo, hi)
        return self.grad_shard[a:b]

    def grads_of(self, keep) -> list[torch.Tensor]:
        out = []
        for bucket in self.buckets:
            own_lo, own_hi = (bucket.start + x for x in self.owned_range(bucket))
            for p in bucket.params:
                lo, hi = self.param_range(p)
                lo, hi = max(lo, own_lo), min(hi, own_hi)
                if lo < hi and keep(p):
                    out.append(self.grad_slice(lo, hi))
        return out

    def deferred_grads(self) -> list[torch.Tensor]:
        return [self.grad_shard[b.start // self.dp_size:b.end // self.dp_size] for b in self.buckets if b.deferred]

    def stored_bytes(self) -> dict[str, int]:
        return {"params": self.param_data.nbytes, "grads": self.grad_shard.nbytes, **self.step_peaks}

    def _peaks(self) -> dict[str, int]:
        return {"peak_transient": self.peak["total"], "peak_grad_buckets": self.peak["grads"],
                "peak_gathered": self.peak["gathered"]}

    def reset_peaks(self) -> None:
        self.peak = {**self.transient, "total": sum(self.transient.values())}

    @property
    def step_peaks(self) -> dict[str, int]:
        """The transient peaks of the last step's forwards and backwards (`finish_grad_sync` takes
        them, `zero_grad` starts the next count)."""
        return self._last_step_peaks

    def _transient(self, nbytes: int, kind: str = "grads") -> None:
        self.transient[kind] += nbytes
        self.peak[kind] = max(self.peak[kind], self.transient[kind])
        self.peak["total"] = max(self.peak["total"], sum(self.transient.values()))

    # -- backward side: every backward reduce-scatters each bucket as it completes
    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        if weight_grad.is_deferred(p):  # a zero-bubble B: the gradient comes when W runs
            self._deferred_in_b(p)
            return
        self._hooks_seen += 1
        if not self._end_queued:  # land what is in flight when this backward ends
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        bucket = self.bucket_of[id(p)]
        if bucket.grad is None:
            bucket.grad = torch.zeros(bucket.numel, dtype=self.grad_dtype, device=self.device)
            self._transient(bucket.grad.nbytes)
        lo = self.offset[id(p)] - bucket.start
        bucket.grad[lo:lo + p.numel()].add_(p.grad.reshape(-1))
        p.grad = None
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        self.launch_log.append((bucket.index, self._hooks_seen))
        self._launched.add(bucket.index)
        data = bucket.grad if self.comm_dtype is None else bucket.grad.to(self.comm_dtype)
        if self.dp_size == 1:
            out, work = data, None
        else:
            out = torch.empty(bucket.numel // self.dp_size, dtype=data.dtype, device=self.device)
            traffic.gather_or_scatter("dp", data.nbytes, self.dp_size)
            work = _buffers._reduce_scatter_single(out, data, group=self.dp_group, async_op=True)
        bucket.work = work or True
        self._in_flight.append((bucket, out, work))
        while len(self._in_flight) > MAX_IN_FLIGHT:
            self._land(*self._in_flight.pop(0))
        self._after_backward(bucket)

    def _land(self, bucket: Bucket, out: torch.Tensor, work) -> None:
        if work is not None:
            start = time.perf_counter()
            work.wait()
            if self.spans is not None:
                self.spans.append(("wait for a reduce-scatter", "zero-reduce-wait", start, time.perf_counter() - start))
        base = bucket.start // self.dp_size
        self.grad_shard[base:base + out.numel()].add_(out)
        self._transient(-bucket.grad.nbytes)
        bucket.grad, bucket.work = None, None
        bucket.ready.clear()

    def _end_of_backward(self) -> None:
        """Autograd's callback at the end of a backward that reached this buffer. Buckets some of
        whose parameters took no part launch now, in index order (their zeros added); a bucket no
        gradient reached is not reduced. Collectives are matched by their order on each rank (NCCL's
        rule, gloo's too), so this is right when every DP rank's backward reaches the same parameters,
        as in every megalite model; a model whose unused parameters depend on the data is not
        supported (PyTorch's DDP without find_unused_parameters and FSDP ask the same). Warned about
        once, since a rank cannot tell the two cases apart alone."""
        self._end_queued = False
        late = [b for b in self.buckets if b.grad is not None and b.work is None]
        unreached = [b for b in self.buckets if b.grad is None and b.index not in self._launched]
        if (late or unreached) and self._launched | {b.index for b in late} and not self.unreached_warned:
            self.unreached_warned = True
            warnings.warn(f"ZeRO-{self.zero_stage}: {len(late) + len(unreached)} of {len(self.buckets)} gradient "
                          "buckets were not complete when this backward ended (parameters it did not reach). "
                          "Correct only if every data-parallel rank's backward skips the same parameters; "
                          "unused parameters that depend on the data are not supported", stacklevel=2)
        for bucket in late:
            self._launch(bucket)
        self._launched.clear()
        while self._in_flight:
            self._land(*self._in_flight.pop(0))

    def _after_backward(self, bucket: Bucket) -> None:
        """A bucket's gradients are all in (stage 3 frees its parameters here)."""

    def _deferred_in_b(self, p: torch.nn.Parameter) -> None:
        """A zero-bubble B is done with `p`, whose gradient its W will bring (stage 3 frees a unit
        whose parameters B is done with: W needs no weights)."""

    def finish_grad_sync(self) -> None:
        """Each backward reduced its buckets already: land any stragglers, reset for the next step."""
        self._end_of_backward()
        self.sync_enabled = False
        self._last_step_peaks = self._peaks()

    def zero_grad(self) -> None:
        self.grad_shard.zero_()
        self.reset_peaks()
        self.launch_log.clear()
        self._hooks_seen = 0
