"""--optimizer muon: Muon for the hidden weight matrices, AdamW for everything else (Megatron-LM's split).

Muon (Keller Jordan, 2024; Megatron-Core's `TensorParallelMuon` over NVIDIA's Emerging-Optimizers)
updates a matrix W with gradient G, at learning rate lr and weight decay wd, as
    W <- W - lr wd W                                  (decoupled weight decay)
    M <- beta M + (1 - beta) G                         (--muon-momentum)
    U = (1 - beta) G + beta M  with --muon-use-nesterov, else U = M
    W <- W - lr s NS(U)                                (s: --muon-scale-mode x --muon-extra-scale-factor)
where NS orthogonalizes (megalite.optim.newton_schulz). The matrices are the 2-D weights but the word
embedding and the output layer (each expert's matrix alone); every other parameter (biases, norms,
the embedding and output layer) is updated by AdamW as --optimizer adam would.

A fused query/key/value weight is orthogonalized as its three matrices (all heads' queries, keys,
values) unless --muon-no-split-qkv. A matrix sharded over tensor parallelism is orthogonalized
(--muon-tp-mode): `blockwise`, each rank's shard alone (Megatron-LM's default: the numbers depend on
--tp); `duplicated`, whole on every rank (all-gathered); `distributed`, whole, by an all-reduce of the
Gram matrix each step. The last two give one device's update at any layout.

Muon's momentum is kept as the state "exp_avg" and a step count as "step", so checkpoints save and
load it at any layout as they do Adam's first moment. A step with inf/NaN gradients is skipped on the
device (`found_inf`), and the gradient clip rides in as `grad_scale`, as in PyTorch's fused AdamW.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.optim.grads import is_expert
from megalite.optim.newton_schulz import newton_schulz, scale_factor
from megalite.parallel import traffic
from megalite.parallel.layers import tp_shard, tp_unshard


def is_muon_matrix(p: torch.nn.Parameter) -> bool:
    """Megatron-LM's rule: a 2-D weight (an expert's own matrix), but not the word embedding or the
    output layer. Biases, norms and each expert's bias go to AdamW."""
    dims = p.ndim - (1 if is_expert(p) else 0)
    return dims == 2 and not getattr(p, "is_embedding_or_output_parameter", False)


def muon_matrix(p: torch.nn.Parameter) -> tuple:
    """(the matrix's (rows, cols), an expert's; the dim TP or ETP shards of it, 0 or 1, None if none),
    or (None, None) where p is not Muon's: what the planner counts."""
    if not is_muon_matrix(p):
        return None, None
    sharded = getattr(p, "tensor_model_parallel", False) or is_expert(p)
    return tuple(p.shape[-2:]), p.partition_dim - (p.ndim - 2) if sharded else None


@dataclass
class Rows:
    """How a fused weight's rows split into the matrices Muon orthogonalizes: the rows repeat in units
    of sum(widths), each unit's first widths[0] rows belonging to the first matrix, and so on (a
    query/key/value weight: [heads or groups, (q, k, v), head_dim]). `aligned`: each TP rank's shard
    holds whole units (not so for key groups replicated over TP)."""
    widths: tuple[int, ...]
    aligned: bool = True


@dataclass
class Matrix:
    """One matrix Muon orthogonalizes as a whole (or a stack of experts' matrices, each alone): the
    masters whose rows it joins (a query weight and its key/value weight without the split), how its
    rows split, and how it is sharded: along `dim` (-2 rows, -1 columns; None: whole here), in `blocks`
    blocks, over `group` of `size` ranks."""
    masters: list[torch.Tensor]
    rows: Rows | None = None
    dim: int | None = None
    blocks: int = 1
    group: object = None
    size: int = 1
    rank: int = 0


def _split(x: torch.Tensor, rows: Rows | None) -> list[torch.Tensor]:
    if rows is None:
        return [x]
    unit = sum(rows.widths)
    parts = x.reshape(*x.shape[:-2], x.shape[-2] // unit, unit, x.shape[-1]).split(list(rows.widths), dim=-2)
    return [p.reshape(*x.shape[:-2], -1, x.shape[-1]) for p in parts]


def _join(parts: list[torch.Tensor], rows: Rows | None, like: torch.Tensor) -> torch.Tensor:
    if rows is None:
        return parts[0]
    units = like.shape[-2] // sum(rows.widths)
    return torch.cat([p.reshape(*like.shape[:-2], units, w, like.shape[-1]) for p, w in zip(parts, rows.widths)],
                     dim=-2).reshape(like.shape)


class Muon(torch.optim.Optimizer):
    """Muon over `matrices` (their masters grouped in `groups` for lr and weight decay)."""

    def __init__(self, groups, matrices: list[Matrix], *, lr: float, momentum: float, nesterov: bool, steps: int,
                 precision: str, scale_mode: str, extra_scale: float, tp_mode: str):
        super().__init__(groups, dict(lr=lr, weight_decay=0.0))
        self.matrices, self.momentum, self.nesterov, self.steps = matrices, momentum, nesterov, steps
        self.precision, self.scale_mode, self.extra_scale, self.tp_mode = precision, scale_mode, extra_scale, tp_mode
        self.group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        self.grad_scale = self.found_inf = None

    @torch.no_grad()
    def step(self, closure=None):
        for matrix in self.matrices:
            if any(m.grad is None for m in matrix.masters):
                continue
            updates, momenta = [], []
            for master in matrix.masters:
                grad = master.grad if self.grad_scale is None else master.grad / self.grad_scale
                state = self.state[master]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(master)
                    state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
                momentum = state["exp_avg"].lerp(grad, 1 - self.momentum)
                updates.append(grad.lerp(momentum, self.momentum) if self.nesterov else momentum)
                momenta.append(momentum)
            for master, momentum, update in zip(matrix.masters, momenta, self._orthogonalized(matrix, updates)):
                group = self.group_of[id(master)]
                lr, state = group["lr"], self.state[master]
                weights = master.add(master, alpha=-lr * group["weight_decay"])
                weights.add_(update, alpha=-lr)
                self._commit(master, weights)
                self._commit(state["exp_avg"], momentum)
                state["step"] += 1 if self.found_inf is None else 1 - self.found_inf
        return None

    def _commit(self, into: torch.Tensor, value: torch.Tensor) -> None:
        """into <- value, unless the step is skipped (decided on the device: no host sync)."""
        if self.found_inf is None:
            into.copy_(value)
        else:
            into.copy_(torch.where(self.found_inf > 0, into, value))

    def _orthogonalized(self, matrix: Matrix, updates: list[torch.Tensor]) -> list[torch.Tensor]:
        sharded = matrix.dim is not None and matrix.size > 1
        mode = self.tp_mode if sharded else "blockwise"
        if mode == "distributed" and matrix.rows is not None and not matrix.rows.aligned:
            mode = "duplicated"  # the split needs whole units of rows: orthogonalize the gathered matrix
        if mode == "duplicated":
            updates = [self._gathered(matrix, u) for u in updates]
        joined = torch.cat(updates, dim=-2) if len(updates) > 1 else updates[0]
        done = []
        for part in _split(joined, matrix.rows):
            rows, cols = part.shape[-2:]
            if mode == "distributed":
                out = newton_schulz(part, self.steps, self.precision, transpose=matrix.dim == -2, group=matrix.group)
                rows, cols = (rows * matrix.size, cols) if matrix.dim == -2 else (rows, cols * matrix.size)
            else:
                out = newton_schulz(part, self.steps, self.precision)
            done.append(out * (scale_factor(rows, cols, self.scale_mode) * self.extra_scale))
        whole = _join(done, matrix.rows, joined)
        pieces = whole.split([u.shape[-2] for u in updates], dim=-2) if len(updates) > 1 else [whole]
        if mode == "duplicated":
            pieces = [tp_shard(p, matrix.dim, matrix.size, matrix.rank, matrix.blocks) for p in pieces]
        return pieces

    @staticmethod
    def _gathered(matrix: Matrix, shard: torch.Tensor) -> torch.Tensor:
        shards = [torch.empty_like(shard) for _ in range(matrix.size)]
        traffic.gather_or_scatter("tp", shard.numel() * shard.element_size() * matrix.size, matrix.size)
        dist.all_gather(shards, shard.contiguous(), group=matrix.group)
        return tp_unshard(shards, matrix.dim, matrix.blocks)


class _RoutedState(Mapping):
    """The states of both optimizers, each master's where its optimizer keeps it."""

    def __init__(self, chain: "MuonAndAdamW"):
        self.chain = chain

    def _of(self, master):
        return self.chain.optimizer_of(master).state

    def __getitem__(self, master):
        return self._of(master)[master]

    def get(self, master, default=None):
        return self._of(master).get(master, default)

    def __iter__(self):
        for opt in self._optimizers():
            yield from opt.state

    def __len__(self):
        return sum(len(opt.state) for opt in self._optimizers())

    def _optimizers(self):
        return self.chain.optimizers


class MuonAndAdamW:
    """What MegaliteOptimizer drives as its `inner` optimizer: Muon for the matrices, fused AdamW for
    the rest, one list of param groups (the lr and weight decay set on them reach both)."""

    def __init__(self, muon: Muon | None, adam: torch.optim.Optimizer | None):
        self.muon, self.adam = muon, adam
        self.optimizers = [o for o in (muon, adam) if o is not None]
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]
        self.state = _RoutedState(self)
        self.defaults = {"fused": True}

    def optimizer_of(self, master):
        """The optimizer that updates `master`."""
        return self.muon if self.muon is not None and id(master) in self.muon.group_of else self.adam

    def moment_names(self, master) -> tuple[str, ...]:
        """The moments this master's optimizer keeps (what a checkpoint holds for it)."""
        muon = self.muon is not None and id(master) in self.muon.group_of
        return ("exp_avg",) if muon else ("exp_avg", "exp_avg_sq")

    def __setattr__(self, name, value):
        if name in ("grad_scale", "found_inf"):  # the clip and the skip reach both
            for opt in self.optimizers:
                setattr(opt, name, value)
        object.__setattr__(self, name, value)

    def step(self, closure=None):
        for opt in self.optimizers:
            opt.step()

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict() if self.muon else None,
                "adam": self.adam.state_dict() if self.adam else None}

    def load_state_dict(self, sd: dict) -> None:
        for name, opt in (("muon", self.muon), ("adam", self.adam)):
            if opt is not None:
                opt.load_state_dict(sd[name])
        # (torch's load makes new group dicts: the lr and weight decay set on ours must reach them)
        self.param_groups[:] = [g for o in self.optimizers for g in o.param_groups]
        if self.muon is not None:
            self.muon.group_of = {id(p): g for g in self.muon.param_groups for p in g["params"]}
