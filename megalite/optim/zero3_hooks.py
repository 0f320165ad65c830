"""ZeRO stage 3's units and the module hooks that gather them as a chunk's passes use them
(`attach_unit_hooks`, `layer_units`; import them from `megalite.optim.zero`). The buffer they drive is
`ShardedParamBuffer` (zero3.py), whose docstring says when each unit is gathered and freed."""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from megalite import faults
from megalite.optim.zero3 import ShardedParamBuffer


def layer_units(chunk: nn.Module, params: list[torch.nn.Parameter], deferred) -> list[list[int]]:
    """ZeRO-3 units of a chunk, as indices into `params`: each of `chunk.layers` (last first, as
    backward meets them), then the rest, then each deferred (tied across stages) parameter alone."""
    index = {id(p): k for k, p in enumerate(params)}
    if not hasattr(chunk, "layers"):
        raise ValueError(f"ZeRO-3 gathers a chunk's parameters layer by layer, but {type(chunk).__name__} has no "
                         "`layers` (a ModuleList of its transformer layers): give it one, or use --zero-stage 2")
    units, in_layers = [], set()
    for layer in reversed(list(chunk.layers)):
        members = [index[id(p)] for p in reversed(list(layer.parameters())) if id(p) in index]
        in_layers.update(members)
        if members:
            units.append(members)
    rest = [k for k in reversed(range(len(params))) if k not in in_layers and not deferred(params[k])]
    if rest:
        units.append(rest)
    units += [[k] for k in range(len(params)) if k not in in_layers and deferred(params[k])]
    return units


def _tensors(out) -> list[torch.Tensor]:
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


def _in_backward() -> bool:
    """True inside autograd's backward (a recomputation, a tensor hook). A private torch call, pinned
    by tests/test_zero.py::test_in_backward_tells_forward_from_backward."""
    return torch._C._current_graph_task_id() != -1


class _UnitHooks:
    """Module hooks that gather a chunk's units on use (see the module docstring)."""

    def __init__(self, buffer: ShardedParamBuffer, chunk: nn.Module, keep_at_turns: bool):
        self.buffer, self.chunk = buffer, chunk
        self._began = None  # the autograd graph task whose backward began_pass was called for
        layers = list(getattr(chunk, "layers", []))
        first_of = {id(p): buffer.bucket_of[id(p)] for p in buffer.params}
        self.layer_units = []
        for layer in layers:
            units = {first_of[id(p)].index: first_of[id(p)] for p in layer.parameters() if id(p) in first_of}
            self.layer_units.append(list(units.values()))
        in_layers = {b.index for units in self.layer_units for b in units}
        buffer.layer_unit_indices |= in_layers
        self.chunk_units = [b for b in buffer.buckets if b.index not in in_layers]
        with_units = [units for units in self.layer_units if units]  # an expert buffer skips dense layers
        if keep_at_turns and with_units and buffer.reshard_after_forward and not buffer.keep_params_for_step:
            rest = {b.index for b in self.chunk_units}
            buffer.first_layer_units = {b.index for b in with_units[0]}
            buffer.turn_units = {"forward": rest | {b.index for b in with_units[-1]},
                                 "backward": rest | buffer.first_layer_units}
        chunk.register_forward_pre_hook(self._chunk_pre)
        chunk.register_forward_hook(self._chunk_post)
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(partial(self._layer_pre, i))
            layer.register_forward_hook(partial(self._layer_post, i))

    def _gather(self, units, wait=True, why="forward"):
        faults.point("gather")
        for b in units:
            self.buffer.gather(b, wait=wait, why=why)

    def _prefetch_layer(self, i: int, why: str) -> None:
        if 0 <= i < len(self.layer_units):
            self._gather(self.layer_units[i], wait=False, why=f"prefetch {why}")

    def _on_backward_of(self, units, previous_layer: int, begins: bool = False):
        def hook(grad):
            # the chunk's backward begins here (once a backward: a chunk may return several outputs)
            task = torch._C._current_graph_task_id()
            if begins and task != self._began:
                self._began = task
                self.buffer.begin_pass("backward")
            self._gather(units, why="backward")
            self._prefetch_layer(previous_layer, "backward")
            return grad
        return hook

    def _chunk_pre(self, module, args):
        if _in_backward():
            return
        self.buffer.begin_pass("forward")
        self._gather(self.chunk_units)
        self._prefetch_layer(0, "forward")

    def _chunk_post(self, module, args, out):
        if _in_backward():
            return
        if torch.is_grad_enabled():
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(self._on_backward_of(self.chunk_units, len(self.layer_units) - 1, begins=True))
        for b in self.chunk_units:
            self.buffer.after_forward(b, module.training)

    def _layer_pre(self, i, module, args):
        self._gather(self.layer_units[i], why="recompute" if _in_backward() else "forward")
        if not _in_backward():
            self._prefetch_layer(i + 1, "forward")

    def _layer_post(self, i, module, args, out):
        if torch.is_grad_enabled():
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(self._on_backward_of(self.layer_units[i], i - 1))
        if not _in_backward():  # a recomputation inside backward keeps its unit for that backward
            for b in self.layer_units[i]:
                self.buffer.after_forward(b, module.training)


def attach_unit_hooks(chunk: nn.Module, buffer: ShardedParamBuffer, keep_at_turns: bool = False) -> None:
    """Gather `chunk`'s ZeRO-3 units as its forward and backward use them. `keep_at_turns`: keep the
    units one pass ends with and the next begins with (see the module docstring); only where the
    rank's passes are all this chunk's, one at a time (no interleaving, no V, no overlapped pairs),
    else a kept unit would stay whole while another chunk's or lane's pass runs."""
    _UnitHooks(buffer, chunk, keep_at_turns)
