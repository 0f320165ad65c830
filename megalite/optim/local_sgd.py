"""Local SGD / DiLoCo: data-parallel replicas that synchronize every H steps instead of every step.

Each replica (its TP x CP x PP ranks) takes inner optimizer steps on its own share of each global
batch, with no gradient reduction across replicas. Every H inner steps the replicas average their
pseudo-gradients (outer parameters minus their current parameters) over the data-parallel group,
and an outer optimizer, SGD with Nesterov momentum, updates the shared fp32 outer parameters,
which every replica then copies into its masters (Douillard et al. 2023, "DiLoCo", arXiv
2311.08105). With b the momentum buffer (0 at the start), mu `outer_momentum`, g the averaged
pseudo-gradient:

    b <- mu * b + g
    outer <- outer - outer_lr * (g + mu * b)        (mu = 0: outer <- outer - outer_lr * g)

Options (docs/local-sgd.md states them precisely):
- fragments F > 1 (streaming, Douillard et al. 2025, arXiv 2501.18512): the parameters are cut
  into F contiguous fragments; fragment j synchronizes when the inner step count s satisfies
  s % H == (j + 1) * H / F % H, so one fragment goes over the wire every H / F steps (1/F of the
  bytes each time) and each fragment still every H steps.
- async: at a fragment's sync the pseudo-gradient is only launched (an asynchronous all-reduce,
  overlapped with the next H inner steps); the outer step applies the one launched at the
  fragment's previous sync, one round late. The replicas restart from the outer parameters as
  they are after that (delayed) update.

The class works on the inner optimizer's fp32 masters (the parameters themselves in an fp32 run)
and a `publish` callback that writes masters into the model, so tests can drive it directly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite import faults
from megalite.optim.optimizer import moment_dtype, moment_names
from megalite.parallel import traffic


@dataclass
class _Fragment:
    index: int
    lo: int  # its range in the flat outer buffers
    hi: int
    masters: list[torch.Tensor]  # the masters it covers, in the flat order
    offset: int  # synchronized after inner step s when s % interval == offset
    work: object = None  # the all-reduce in flight (async: until the fragment's next sync)
    comm: torch.Tensor | None = None  # the pseudo-gradient being summed over the replicas
    ready: torch.Tensor | None = None  # async: an average already waited for (`settle`), for the next sync


def split_fragments(numels: list[int], fragments: int) -> list[tuple[int, int]]:
    """Contiguous (first, end) index ranges of `numels` cutting their total into `fragments` parts
    of about equal size (a tensor is never split; a part may be empty when tensors are few)."""
    total, bounds, acc, k = sum(numels), [0], 0, 0
    for j in range(1, fragments):
        target = total * j / fragments
        while k < len(numels) and acc + numels[k] / 2 <= target:
            acc += numels[k]
            k += 1
        bounds.append(k)
    bounds.append(len(numels))
    return [(bounds[j], bounds[j + 1]) for j in range(fragments)]


class LocalSGD:
    """The outer loop around an inner optimizer: call `after_inner_step()` after every inner step."""

    def __init__(self, masters: list[torch.Tensor], *, interval: int, outer_lr: float, outer_momentum: float,
                 group=None, comm_dtype: torch.dtype = torch.float32, asynchronous: bool = False,
                 fragments: int = 1, publish=lambda: None, warmup: int = 0):
        if interval < 1 or fragments < 1 or interval % fragments:
            raise ValueError(f"local SGD needs an interval >= 1 divisible by the fragments: got interval {interval}, "
                             f"fragments {fragments}")
        self.interval, self.outer_lr, self.outer_momentum = interval, outer_lr, outer_momentum
        self.group, self.comm_dtype, self.asynchronous, self.publish = group, comm_dtype, asynchronous, publish
        self.replicas = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
        self.masters = list(masters)
        device = self.masters[0].device if self.masters else torch.device("cpu")
        with torch.no_grad():
            self.outer = torch.cat([m.detach().reshape(-1).float() for m in self.masters]) if self.masters \
                else torch.zeros(0, device=device)
        self.momentum = torch.zeros_like(self.outer)
        self.steps = 0  # inner steps taken since the start of training
        self.warmup = warmup  # the first `warmup` steps are data-parallel (`average_grads`); rounds start after
        self.sent_bytes = 0  # bytes handed to the all-reduce (whole tensors), for tests and the planner's
        numels = [m.numel() for m in self.masters]
        starts = [0]
        for n in numels:
            starts.append(starts[-1] + n)
        self.fragments = [
            _Fragment(j, starts[a], starts[b], self.masters[a:b], (j + 1) * interval // fragments % interval)
            for j, (a, b) in enumerate(split_fragments(numels, fragments))]

    # -- the loop's call ----------------------------------------------------------------------
    @property
    def in_warmup(self) -> bool:
        """The step about to be taken is a data-parallel one (post-local SGD's warmup)."""
        return self.steps < self.warmup

    def average_grads(self, grads: list[torch.Tensor]) -> None:
        """Warmup: average the replicas' gradients (whole buffers), as data parallelism does."""
        if self.replicas == 1:
            return
        for g in grads:
            traffic.counted_all_reduce("dp", g, self.group)
            g.div_(self.replicas)

    def after_inner_step(self) -> list[int]:
        """Count one inner step; synchronize the fragments that are due. Returns their indices."""
        self.steps += 1
        if self.steps <= self.warmup:
            if self.steps == self.warmup and self.masters:  # the replicas are equal: rounds start here
                with torch.no_grad():
                    self.outer.copy_(torch.cat([m.detach().reshape(-1).float() for m in self.masters]))
            return []
        due = [f for f in self.fragments if (self.steps - self.warmup) % self.interval == f.offset]
        for f in due:
            self._sync(f)
        if due:
            self.publish()
        return [f.index for f in due]

    def _sync(self, f: _Fragment) -> None:
        with torch.no_grad():
            current = torch.cat([m.detach().reshape(-1).float() for m in f.masters]) if f.masters \
                else self.outer[:0]
            delta = self.outer[f.lo:f.hi] - current  # this replica's pseudo-gradient
            if not self.asynchronous:
                self._launch(f, delta)
                self._outer_step(f, self._wait(f))
            else:  # apply the previous round's average (if any), send this round's
                previous = self._wait(f) if f.comm is not None else f.ready
                f.ready = None
                self._launch(f, delta)
                if previous is not None:
                    self._outer_step(f, previous)
            for m, (lo, hi) in zip(f.masters, self._ranges(f)):
                m.copy_(self.outer[lo:hi].view_as(m))

    def _ranges(self, f: _Fragment):
        lo = f.lo
        for m in f.masters:
            yield lo, lo + m.numel()
            lo += m.numel()

    def _launch(self, f: _Fragment, delta: torch.Tensor) -> None:
        comm = delta.to(self.comm_dtype) if self.comm_dtype != torch.float32 else delta
        f.comm, f.work = comm, None
        if self.replicas > 1 and comm.numel():
            self.sent_bytes += comm.nbytes
            faults.point("outer")
            traffic.all_reduce("dp", comm.nbytes, self.replicas)
            # dist.all_reduce looked up at call time: megalite.testing.counting_collectives wraps it.
            f.work = dist.all_reduce(comm, group=self.group, async_op=True)

    def _wait(self, f: _Fragment) -> torch.Tensor:
        """The averaged pseudo-gradient of the reduction in flight for `f` (fp32)."""
        if f.work is not None:
            f.work.wait()
        mean = f.comm.float()
        if self.replicas > 1:
            mean.div_(self.replicas)
        f.work, f.comm = None, None
        return mean

    def _outer_step(self, f: _Fragment, g: torch.Tensor) -> None:
        outer, b = self.outer[f.lo:f.hi], self.momentum[f.lo:f.hi]
        if self.outer_momentum:
            b.mul_(self.outer_momentum).add_(g)
            g = g.add(b, alpha=self.outer_momentum)
        outer.add_(g, alpha=-self.outer_lr)

    # -- checkpoints ---------------------------------------------------------------------------
    def settle(self) -> None:
        """Async: wait for the reductions in flight and keep their results for the next syncs (a
        checkpoint then holds them; the values are the same whenever they are waited for)."""
        for f in self.fragments:
            if f.comm is not None:
                f.ready = self._wait(f)

    def state_dict(self) -> dict:
        self.settle()
        return {"steps": self.steps, "outer": self.outer, "momentum": self.momentum,
                "pending": [f.ready for f in self.fragments]}

    def load_state_dict(self, sd: dict) -> None:
        if sd["outer"].numel() != self.outer.numel() or len(sd["pending"]) != len(self.fragments):
            raise ValueError(f"local SGD state of {sd['outer'].numel()} elements in {len(sd['pending'])} fragments "
                             f"does not fit this run's {self.outer.numel()} in {len(self.fragments)}")
        self.steps = int(sd["steps"])
        self.outer.copy_(sd["outer"])
        self.momentum.copy_(sd["momentum"])
        for f, ready in zip(self.fragments, sd["pending"]):
            f.work = f.comm = None
            f.ready = None if ready is None else ready.to(self.outer.device).float().clone()


def replica_state(local: LocalSGD, optimizer) -> dict:
    """What a rank of a local-SGD run saves of its own (replicas differ between outer steps, and
    their inner optimizers always): the outer state, its inner masters and optimizer state, and its
    loss scaler. Live tensors: write them before training goes on, or snapshot them."""
    return {"local_sgd": local.state_dict(),
            "masters": [piece.master.detach() for piece in optimizer.pieces],
            "inner": [{k: v for k, v in optimizer.inner.state.get(piece.master, {}).items() if torch.is_tensor(v)}
                      for piece in optimizer.pieces],
            "loss_scaler": optimizer.loss_scaler.state_dict()}


def load_replica_state(sd: dict, local: LocalSGD, optimizer) -> None:
    """The inverse of `replica_state`, at the same layout; the model gets the masters (`publish`)."""
    if len(sd["masters"]) != len(optimizer.pieces):
        raise ValueError(f"the checkpoint's replica state holds {len(sd['masters'])} optimizer pieces, this rank "
                         f"{len(optimizer.pieces)}")
    with torch.no_grad():
        for piece, master, inner in zip(optimizer.pieces, sd["masters"], sd["inner"]):
            piece.master.copy_(master.view_as(piece.master))
            state = optimizer.inner.state[piece.master]
            state.clear()
            moments = moment_names(optimizer.inner, piece.master)
            if any(k not in inner for k in moments):  # saved by an optimizer keeping fewer: start anew
                continue
            for k, v in inner.items():
                if k != "step" and k not in moments:  # (another optimizer's: Adam's second moment into Muon)
                    continue
                # Fused optimizers keep the step count on the masters' device; others on the host. A
                # moment takes this run's dtype (--exp-avg-dtype may differ from the saving run's).
                on_device = k != "step" or bool(optimizer.inner.defaults.get("fused"))
                dtype = v.dtype if k == "step" else moment_dtype(optimizer.inner, piece.master, k)
                state[k] = v.to(piece.master.device if on_device else "cpu", dtype).clone()
    optimizer.loss_scaler.load_state_dict(sd["loss_scaler"])
    local.load_state_dict(sd["local_sgd"])
    optimizer.publish()
