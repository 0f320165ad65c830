"""`--overlap-param-gather`: the distributed optimizer's parameter all-gathers (ZeRO stages 1-2)
run beside the next forward instead of after the update.

After the update each DP rank holds new values for its shard of every bucket only. Without the
overlap, `ParamAndGradBuffer.all_gather_params` posts every bucket's gather and waits for all of
them before the step returns: the whole buffer crosses the link with nothing to hide behind. With
it, the step returns at once; the next step posts the gathers when its schedule begins (after its
token count's all-reduce: on gloo a small collective posted behind them would wait for their bytes on
the same connections, and hold the host), in the order the forward reads the buckets (the layout's
reverse, as parameters are laid out last-defined first); these hooks wait, in that forward, for the
buckets up to the one that holds what is about to run:

- the chunk's pre-hook, for the buckets of the parameters defined before its first layer (the
  embeddings);
- the pre-hooks of layer i's parts (its norms, attention and MLP, which the layer calls as
  modules), each for the buckets of that part's parameters and every one posted before them: the
  attention computes while the MLP's buckets still travel;
- the last layer's post-hook, and the chunk's post-hook, for all the rest (the final norm, the
  output layer, heads, multi-token prediction): those are read by the chunk's own code, not
  always through their modules' forward, so the waits are by position, never by module.

The waits are the same in every micro-batch; only the step's first forward finds any gather
pending. The values are the same bits as without the overlap: only when the forward waits changes.
Whatever else reads the parameters between steps (a save, an evaluation, an export) calls
`finish_param_gather` first (`whole_parameters` does).
"""
from __future__ import annotations

from functools import partial

from torch import nn

from megalite.optim.buffers import ParamAndGradBuffer


def attach_gather_waits(chunk: nn.Module, buffer: ParamAndGradBuffer) -> None:
    """Let `buffer`'s gathers overlap `chunk`'s next forward, each part of a layer waiting for its own
    buckets as it begins (see above)."""
    buffer.overlap_param_gather = True
    position = {id(p): buffer.gather_position(buffer.bucket_of[id(p)]) for p in buffer.params}
    layers = list(getattr(chunk, "layers", []))
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    before = 0  # the parameters defined before the first layer's (the chunk's registration order)
    for p in chunk.parameters():
        if id(p) in in_layers:
            break
        before = max(before, position.get(id(p), 0))

    def last(module: nn.Module, recurse: bool = True) -> int:
        return max((position[id(p)] for p in module.parameters(recurse=recurse) if id(p) in position), default=0)

    count = before  # gathers waited for so far, in forward order (never fewer than before)
    for layer in layers:
        # the layer's own parameters at its start; each part of it (norm, attention, MLP: the layer
        # calls each as a module) waits for its whole subtree's buckets as it begins
        count = max(count, last(layer, recurse=False))
        layer.register_forward_pre_hook(partial(_wait, buffer, count))
        for part in layer.children():
            if reads := last(part):
                count = max(count, reads)
                part.register_forward_pre_hook(partial(_wait, buffer, count))
    if not layers:  # a chunk with no layers: everything before it runs
        before = len(buffer.buckets)
    chunk.register_forward_pre_hook(partial(_wait, buffer, before))
    chunk.register_forward_hook(lambda module, args, out: buffer.finish_param_gather())
    if layers:
        layers[-1].register_forward_hook(lambda module, args, out: buffer.finish_param_gather())


def _wait(buffer: ParamAndGradBuffer, count: int, module, args) -> None:
    if buffer.gathers_pending:
        buffer.wait_param_gather(count)
