"""Contiguous parameter and gradient buffers with bucketed, overlapped data-parallel reduction.

Each model chunk's parameters are laid out, in reverse definition order (roughly the order backward
produces their gradients), in one flat parameter buffer (model dtype) and one flat gradient buffer
(fp32 by default). Parameters become views of the first; `param.main_grad` is a view of the second.
The gradient buffer is cut into buckets, each padded to a multiple of the data-parallel size so that
it splits evenly into DP shards (the distributed optimizer owns shard i of every bucket on DP rank
i): the first bucket backward fills is small, so that its reduction starts early, and the next ones
grow to about `bucket_numel` elements (megalite.optim.bucket_plan says why).

Every parameter starts at a multiple of `ALIGN_NUMEL` (64) elements, and every bucket is padded to
a multiple of 64 * dp so that its DP shards start aligned too: cuBLAS, fused norms, fused Adam and
NCCL all take slower paths on addresses that are not 16-byte aligned. `plan_layout`
(megalite.optim.bucket_plan) is the whole layout as a pure function (the planner uses it as well).

During the backward of the last micro-batch of a step (`enable_sync()`), a hook on every parameter
marks its gradient ready; the moment a bucket's last gradient is ready, its all-reduce (or
reduce-scatter, for the distributed optimizer) starts asynchronously, overlapping the rest of
backward. `finish_grad_sync()` launches what is left and waits. Earlier micro-batches only
accumulate, so gradients are reduced once per step. Deferred buckets (the tied word embedding when
it lives on two pipeline stages) wait for `finish_grad_sync`: `megalite.optim.grads.finalize_grads`
sums them over the stages first, and is the one place the loop finishes a step's gradients.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# The layout (re-exported: the planner and tests import it from here too)
from megalite.optim.bucket_plan import ALIGN_NUMEL, BucketLayout, plan_layout  # noqa: F401
from megalite.optim.host_pages import zeros_flat
from megalite.parallel import traffic, weight_grad
from megalite.parallel.grad_accumulation import add_row_sums, key_parameter
# Module attributes, so that tests can count the bytes sent by wrapping them (megalite counts them
# itself too, in megalite.parallel.traffic).
from megalite.parallel.mappings import all_gather_single as _all_gather_single
from megalite.parallel.mappings import reduce_scatter_single as _reduce_scatter_single


_all_reduce = dist.all_reduce

# Below this many elements an overwriting GEMM's zero pass costs less than a separate zero_() call.
MEMSET_GEMM_MIN_NUMEL = 1 << 14


def write_gemm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a @ b, overwriting `out`. On a CPU as `zero_()` then a GEMM that adds (beta 1): MKL's
    overwriting GEMM (beta 0) first scales `out` by zero in a pass of its own, slower than torch's
    fill (scripts/gemm_into.py: 0.86-0.95 of the time for the weights of benchmark_step.py's GPT
    models; a GPT tiny compiled step 3% faster). 0 + x is x: the same bits on this CPU's MKL
    (tests/test_grad_accumulation.py checks it wherever it runs). A GPU's GEMM applies beta 0 in its
    epilogue: there it stays one kernel."""
    if out.is_cpu and out.numel() >= MEMSET_GEMM_MIN_NUMEL:
        out.zero_().addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


@dataclass
class Bucket:
    index: int
    params: list
    start: int
    end: int
    deferred: bool = False  # reduced only in finish_grad_sync (tied embeddings: finalize_grads sums them first)
    ready: set = field(default_factory=set)
    work: object = None
    comm: torch.Tensor | None = None  # low-precision copy being reduced, if any
    grad: torch.Tensor | None = None  # ZeRO-2/3: this backward's whole-bucket gradient, until reduce-scattered

    @property
    def numel(self) -> int:
        return self.end - self.start


class ParamAndGradBuffer:
    """ZeRO stages 0 and 1: whole parameters and whole gradients on every DP rank (the distributed
    optimizer, stage 1, reduce-scatters and owns one shard). `megalite.optim.zero` builds stages 2
    and 3 on this class: the same layout, less of it stored."""
    zero_stage = 0  # 1 with reduce_scatter; the subclasses say 2 or 3

    def __init__(self, params: list[torch.nn.Parameter], *, param_dtype: torch.dtype, grad_dtype: torch.dtype,
                 bucket_numel: int, dp_group, dp_size: int, reduce_scatter: bool,
                 comm_dtype: torch.dtype | None = None, deferred=lambda p: False, dp_rank: int | None = None,
                 units: list[list[int]] | None = None, experts: bool = False,
                 first_bucket_numel: int | None = None):
        if not params:
            raise ValueError("ParamAndGradBuffer needs at least one parameter")
        self.dp_group, self.dp_size, self.reduce_scatter = dp_group, dp_size, reduce_scatter
        self.experts = experts  # expert weights: dp_group is the expert-data-parallel group
        self.chunk_index = 0  # the model chunk whose parameters these are (set by whoever builds several)
        if reduce_scatter and self.zero_stage == 0:
            self.zero_stage = 1
        # dp_rank: only to lay out and shard without a process group (tests, planning).
        if dp_rank is None:
            dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        self.dp_rank = dp_rank
        self.grad_dtype, self.param_dtype = grad_dtype, param_dtype
        self.comm_dtype = comm_dtype if comm_dtype not in (None, grad_dtype) else None
        self.launch_log: list[tuple[int, int]] = []  # (bucket index, gradients ready so far) per launch
        self._hooks_seen = 0
        # Parameters whose main_grad holds this step's gradient: `zero_grad` does not clear the
        # buffer (a pass over every gradient, each step); a parameter's first gradient overwrites
        # its main_grad (the hook's copy, a GEMM's `out=`), later ones add, and one that gets none
        # is zeroed before its bucket is read (`_zero_unwritten`).
        self._written: set[int] = set()
        # Tied embeddings whose output GEMM wrote main_grad in this micro-batch and whose lookup's
        # rows are still to be added (add_tied_output_grad, add_tied_lookup_grad).
        self._tied_pending: set[int] = set()
        self.sync_enabled = False
        # The update's parameter gathers, in the order posted, and how many were waited for
        # (all at once unless `overlap_param_gather`: megalite.optim.param_gather waits in the forward).
        self.overlap_param_gather = False
        self._gather_due = False  # updated shards whose gathers are not posted yet
        self._gathers: list = []
        self._gathered = 0

        # first_bucket_numel: None, the ramp of bucket_plan; >= bucket_numel, equal buckets
        layout = plan_layout([(p.numel(), bool(deferred(p))) for p in params], bucket_numel, dp_size, units,
                             first_bucket_numel)
        self.buckets: list[Bucket] = []
        self.offset: dict[int, int] = {}  # id(param) -> start in the buffers
        self.numel_of = {id(p): p.numel() for p in params}  # ZeRO-3 parks parameters empty between uses
        self.bucket_of: dict[int, Bucket] = {}
        for i, planned in enumerate(layout):
            ps = [params[k] for k in planned.members]
            bucket = Bucket(i, ps, planned.start, planned.end, deferred=planned.deferred)
            self.buckets.append(bucket)
            for p, (lo, _) in zip(ps, planned.ranges):
                self.offset[id(p)] = lo
                self.bucket_of[id(p)] = bucket
        self.numel = layout[-1].end
        self.device = params[0].device
        self.params = [p for b in self.buckets for p in b.params]
        self._allocate()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _allocate(self) -> None:
        """Whole flat buffers; parameters become views of one, `main_grad` views of the other."""
        self._allocate_params()
        self.grad_data = zeros_flat(self.numel, self.grad_dtype, self.device)
        for p in self.params:
            lo, n = self.offset[id(p)], p.numel()
            p.main_grad = self.grad_data[lo:lo + n].view(p.shape)
            if p.dtype == self.grad_dtype:
                p.grad = p.main_grad  # autograd accumulates in place: no copy
                p.grad_buffer = self  # and linear layers' GEMMs write their weight gradients here
                p.has_grad_buffer = True
                key_parameter(p)  # (compiled code reaches the buffer by this key)

    def _allocate_params(self) -> None:
        """The whole parameter buffer (parameters become views of it) and, for a cast-down model,
        the fp32 values as initialized (the optimizer's master weights start from them)."""
        self.param_data = zeros_flat(self.numel, self.param_dtype, self.device)
        self.fp32_init = None
        if self.param_dtype != torch.float32:
            self.fp32_init = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        for p in self.params:
            lo, n = self.offset[id(p)], p.numel()
            if self.fp32_init is not None:
                self.fp32_init[lo:lo + n].copy_(p.detach().reshape(-1))
            self.param_data[lo:lo + n].copy_(p.detach().reshape(-1))
            p.data = self.param_data[lo:lo + n].view(p.shape)

    # -- where a range of the layout is stored (the optimizer and checkpoints ask) ------------
    def param_slice(self, lo: int, hi: int) -> torch.Tensor:
        """The stored parameter elements [lo, hi) of the layout (model dtype)."""
        return self.param_data[lo:hi]

    def grad_slice(self, lo: int, hi: int) -> torch.Tensor:
        """The reduced gradient elements [lo, hi) of the layout (after `finish_grad_sync`)."""
        return self.grad_data[lo:hi]

    def initial_fp32(self, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) as initialized, in fp32 (for the masters of a cast-down model)."""
        return self.fp32_init[lo:hi]

    @property
    def has_fp32_init(self) -> bool:
        return self.fp32_init is not None

    def drop_fp32_init(self) -> None:
        self.fp32_init = None

    def grads_of(self, keep) -> list[torch.Tensor]:
        """The gradient views this rank reduces for the parameters `keep(p)` selects: whole here."""
        return [p.main_grad for p in self.params if keep(p)]

    def pin(self) -> None:
        """Keep whole parameters on this rank until `unpin` (ZeRO-3; always so below it, once the
        update's gathers are waited for)."""
        self.finish_param_gather()

    def unpin(self) -> None:
        """Undo `pin`."""

    def park(self) -> None:
        """After training: ZeRO-3 empties its sharded parameters (see zero.py); nothing here."""

    def stored_bytes(self) -> dict[str, int]:
        """Bytes this buffer holds now: parameters and gradients (optimizer state is the optimizer's)."""
        return {"params": self.param_data.nbytes, "grads": self.grad_data.nbytes}

    # -- backward side -------------------------------------------------------------------------
    def enable_sync(self) -> None:
        """The next backward is the step's last for this chunk: reduce buckets as they fill."""
        self.sync_enabled = True

    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        if weight_grad.is_deferred(p):  # a zero-bubble B: the gradient comes when W runs
            return
        grad = p.grad
        if grad is not p.main_grad:  # the step's first gradient, or a low-precision parameter's
            if grad is None:  # every use wrote main_grad itself (grad_accumulation), or none had a gradient
                if id(p) not in self._written:
                    p.main_grad.zero_()
            elif id(p) in self._written:
                p.main_grad.add_(grad)
            else:  # main_grad still holds the last step's: overwritten, as zero + grad would give
                p.main_grad.copy_(grad)
            # Later micro-batches accumulate in place (same dtype); a bf16 one's comes here again.
            p.grad = p.main_grad if p.dtype == self.grad_dtype else None
        self._written.add(id(p))  # (autograd added in place into main_grad: written too)
        self._hooks_seen += 1
        if not self.sync_enabled:
            return
        bucket = self.bucket_of[id(p)]
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params) and not bucket.deferred and bucket.work is None:
            self._launch(bucket)

    def add_weight_grad(self, p: torch.nn.Parameter, grad_out: torch.Tensor, inputs: torch.Tensor) -> None:
        """main_grad (+)= grad_out^T @ inputs (2-D), as autograd's linear backward computes and
        accumulates it (megalite.parallel.grad_accumulation). Autograd still runs `p`'s
        post-accumulate hook, with no gradient, once all its uses are back: readiness as before."""
        if id(p) in self._written:
            p.main_grad.add_(grad_out.t().mm(inputs))
        else:  # the step's first: the GEMM's output is the gradient
            write_gemm(p.main_grad, grad_out.t(), inputs)
            self._written.add(id(p))

    def add_embedding_grad(self, p: torch.nn.Parameter, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """main_grad[ids] += rows (1-D ids, 2-D rows), summed as autograd's embedding backward sums
        them into a zeroed table (then added to main_grad): bitwise the same gradient."""
        if id(p) in self._written:  # G + (the rows summed from zero), with no table-sized temporary
            add_row_sums(p.main_grad, ids, rows)
        else:  # the step's first: the zeroed table is main_grad itself
            p.main_grad.zero_().index_add_(0, ids, rows)
            self._written.add(id(p))

    def add_tied_output_grad(self, p: torch.nn.Parameter, grad_out: torch.Tensor,
                             inputs: torch.Tensor) -> torch.Tensor | None:
        """The output layer's part of a tied embedding's gradient, grad_out^T @ inputs. In the
        step's first micro-batch it is written into main_grad and the lookup's part follows
        (add_tied_lookup_grad; the lookup's backward always comes after, as the output's input
        gradient feeds it); later, it is returned for autograd to sum with the lookup's part, as
        autograd does (G + (output + lookup): main_grad may not take them one by one)."""
        if id(p) in self._written:
            return grad_out.t().mm(inputs)
        write_gemm(p.main_grad, grad_out.t(), inputs)
        self._written.add(id(p))
        self._tied_pending.add(id(p))
        return None

    def add_tied_lookup_grad(self, p: torch.nn.Parameter, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """The lookup's part of a tied embedding's gradient: added into main_grad right after the
        output's part was written there (one addition per element, as autograd's output + lookup),
        else returned as autograd's embedding backward makes it, a zeroed table with the rows added."""
        if id(p) in self._tied_pending:
            self._tied_pending.discard(id(p))
            add_row_sums(p.main_grad, ids, rows)
            return None
        return torch.zeros_like(p.main_grad).index_add_(0, ids, rows)

    def _zero_unwritten(self, bucket: Bucket) -> None:
        """Parameters of `bucket` that got no gradient this step: zeroed before it is read."""
        for p in bucket.params:
            if id(p) not in self._written:
                p.main_grad.zero_()
                self._written.add(id(p))
                if p.dtype == self.grad_dtype:
                    p.grad = p.main_grad

    def _launch(self, bucket: Bucket) -> None:
        self._zero_unwritten(bucket)
        self.launch_log.append((bucket.index, self._hooks_seen))
        if self.dp_size == 1:
            bucket.work = True
            return
        data = self.grad_data[bucket.start:bucket.end]
        if self.comm_dtype is not None:
            bucket.comm = data.to(self.comm_dtype)
            data = bucket.comm
        if self.reduce_scatter:  # deferred buckets too: the optimizer reads only its shard of them
            shard = bucket.numel // self.dp_size
            out = data[self.dp_rank * shard:(self.dp_rank + 1) * shard]
            traffic.gather_or_scatter("dp", data.nbytes, self.dp_size)
            bucket.work = _reduce_scatter_single(out, data, group=self.dp_group, async_op=True)
        else:
            traffic.all_reduce("dp", data.nbytes, self.dp_size)
            bucket.work = _all_reduce(data, group=self.dp_group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Reduce whatever is not yet in flight, wait for everything, reset for the next step."""
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not True:
                bucket.work.wait()
            if bucket.comm is not None:
                lo, hi = self.owned_range(bucket) if self.reduce_scatter else (0, bucket.numel)
                self.grad_data[bucket.start + lo:bucket.start + hi].copy_(bucket.comm[lo:hi])
            bucket.work, bucket.comm = None, None
            bucket.ready.clear()
        self.sync_enabled = False

    def deferred_grads(self) -> list[torch.Tensor]:
        """The gradient views of the deferred buckets, to be summed elsewhere before `finish_grad_sync`."""
        for bucket in self.buckets:
            if bucket.deferred:
                self._zero_unwritten(bucket)
        return [self.grad_data[b.start:b.end] for b in self.buckets if b.deferred]

    def zero_grad(self) -> None:
        """A new step: no fill (see `_written`); autograd hands each parameter's first gradient
        over as a new tensor (`grad` None), which the hook copies into main_grad."""
        for p in self.params:
            if p.dtype == self.grad_dtype:
                p.grad = None
        self.launch_log.clear()
        self._hooks_seen = 0
        self._written.clear()
        self._tied_pending.clear()

    # -- optimizer side ------------------------------------------------------------------------
    def owned_range(self, bucket: Bucket) -> tuple[int, int]:
        """This DP rank's shard of a bucket, relative to the bucket's start."""
        shard = bucket.numel // self.dp_size
        return self.dp_rank * shard, (self.dp_rank + 1) * shard

    def param_range(self, p) -> tuple[int, int]:
        lo = self.offset[id(p)]
        return lo, lo + self.numel_of[id(p)]

    def all_gather_params(self) -> None:
        """After each DP rank updated its shard of every bucket, give every rank the whole: each
        bucket's all-gather, posted in the order the forward reads them (the layout's reverse).
        `overlap_param_gather`: posted only when the next step begins (`start_param_gather`: after
        the step's bookkeeping collectives, which on gloo would otherwise queue behind them on the
        same connections and hold the host) and waited for by the forward's hooks before each
        bucket's parameters are read (megalite.optim.param_gather), or by `finish_param_gather`
        where something else reads the parameters."""
        if self.dp_size == 1:
            return
        self.finish_param_gather()  # (a forward always waited for the last step's: none left here)
        for bucket in self.buckets:  # counted in the step whose update they carry, wherever they go
            traffic.gather_or_scatter("dp", (bucket.end - bucket.start) * self.param_data.element_size(),
                                      self.dp_size)
        self._gather_due = True
        if not self.overlap_param_gather:
            self.finish_param_gather()

    def start_param_gather(self) -> None:
        """Post the update's bucket gathers, if not yet posted (forward order)."""
        if not self._gather_due:
            return
        self._gather_due = False
        works = []
        for bucket in reversed(self.buckets):
            lo, hi = self.owned_range(bucket)
            full = self.param_data[bucket.start:bucket.end]
            works.append(_all_gather_single(full, full[lo:hi], group=self.dp_group, async_op=True))
        self._gathers, self._gathered = works, 0

    @property
    def gathers_pending(self) -> bool:
        """Whether any of the last update's bucket gathers is still to be posted or waited for."""
        return self._gather_due or self._gathered < len(self._gathers)

    def wait_param_gather(self, count: int) -> None:
        """Wait for the first `count` bucket gathers in the order they are posted (forward order)."""
        self.start_param_gather()
        while self._gathered < min(count, len(self._gathers)):
            self._gathers[self._gathered].wait()
            self._gathered += 1
        if self._gathered == len(self._gathers):
            self._gathers, self._gathered = [], 0

    def finish_param_gather(self) -> None:
        """Every bucket's parameters whole again (a save, an evaluation, the end of training)."""
        self.start_param_gather()
        self.wait_param_gather(len(self._gathers))

    def gather_position(self, bucket: Bucket) -> int:
        """How many gathers `all_gather_params` posts up to and including `bucket`'s."""
        return len(self.buckets) - bucket.index
