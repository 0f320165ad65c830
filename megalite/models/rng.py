"""Where a model's random numbers come from: one generator per component for the initial weights,
dropout on activations replicated across TP, and recomputation that replays the same masks.

Component ids (the `component` of `init_generator`): 0 the word embedding, 1 the position
embedding, 1000 + n transformer layer n; BERT's heads take 2-5 (megalite/models/bert.py); 6 the
untied output layer; 100 + k - 1 the projection of multi-token prediction's depth k (its layer is
layer num_layers + k - 1).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from megalite.parallel import state
from megalite.parallel.layers import InitMethod, XavierUniform, init_device, normal_init
from megalite.parallel.random import get_rng_tracker

WORD_EMBEDDING_COMPONENT, POSITION_EMBEDDING_COMPONENT, OUTPUT_LAYER_COMPONENT = 0, 1, 6
FIRST_LAYER_COMPONENT = 1000
SINK_FIRST_COMPONENT = 1_000_000  # a layer's attention sinks (--softmax-type learnable): a stream of their own
MTP_FIRST_COMPONENT = 100


def init_generator(seed: int, component: int, device=None) -> torch.Generator:
    """RNG for one model component (embedding, layer n, ...): depends on the seed and the
    component alone, never on the pipeline stage or TP size that builds it. It lives where the
    weights are generated (`init_device`: the GPU when building on one, else the CPU)."""
    where = init_device(device)
    if where.type == "meta":  # meta tensors draw nothing, but a generator needs a real device
        where = torch.device("cpu")
    return torch.Generator(device=where).manual_seed((seed * 1_000_003 + component) % 2**63)


def weight_init(config, generator: torch.Generator | None = None) -> InitMethod:
    """A weight matrix's init: N(0, init_method_std), or Xavier-uniform (--init-method-xavier-uniform)."""
    if config.init_method_xavier_uniform:
        return XavierUniform(generator)
    return normal_init(config.init_method_std, generator)


def output_weight_init(config, generator: torch.Generator | None = None) -> InitMethod:
    """The residual branches' last matrices (attention proj, MLP fc2): N(0, init_method_std / sqrt(2 L)),
    GPT-2's scaling that keeps the stream's variance; Xavier-uniform like every weight under
    --init-method-xavier-uniform (what Megatron-LM's flag sets, its scaled init included)."""
    if config.init_method_xavier_uniform:
        return XavierUniform(generator)
    return normal_init(config.init_method_std / math.sqrt(2.0 * config.num_layers), generator)


def embedding_init(config, generator: torch.Generator | None = None) -> InitMethod:
    """Word, position and token-type tables: N(0, embedding_init_method_std) when it is given, else as
    every weight. As Megatron-Core decides it: under Xavier-uniform, a std equal to init_method_std keeps
    the tables Xavier-uniform."""
    std = config.embedding_init_method_std
    if std is None or (config.init_method_xavier_uniform and std == config.init_method_std):
        return weight_init(config, generator)
    return normal_init(std, generator)


def init_replicated(module: nn.Module, init: InitMethod, device) -> nn.Module:
    """Same full weight on every rank: drawn by `init` in fp32, biases zero."""
    with torch.no_grad():
        full = torch.empty(module.weight.shape, device=init_device(device))
        init(full)
        module.weight.copy_(full)
        if getattr(module, "bias", None) is not None:
            module.bias.zero_()
    return module


def hidden_dropout(x: torch.Tensor, p: float, training: bool, sequence_parallel: bool) -> torch.Tensor:
    """Dropout on activations replicated across TP (default RNG, same on every TP rank).

    Under sequence parallelism each rank holds a slice of the sequence: it draws the mask for
    the whole sequence and keeps its slice, so the result equals the run without it.
    """
    if not training or p == 0.0:
        return x
    if not sequence_parallel or state.get_tensor_model_parallel_world_size() == 1:
        return F.dropout(x, p, True)
    keep = _this_ranks_share(x, lambda full: full.bernoulli_(1.0 - p))
    # The scale as a Python number: the product is formed in fp32 and rounded once, while a scale
    # stored in bf16 (1/0.9 -> 1.109375) would shrink every kept value by 0.16%.
    return x * keep * (1.0 / (1.0 - p))


def input_jitter(x: torch.Tensor, eps: float | None, training: bool, sequence_parallel: bool) -> torch.Tensor:
    """x times noise U(1 - eps, 1 + eps) in x's dtype, while training (the Switch Transformer's router
    jitter: Megatron-LM's --moe-input-jitter-eps, Hugging Face Mixtral's router_jitter_noise). Drawn as
    `hidden_dropout` draws its mask: under sequence parallelism the whole sequence's, each rank its
    slice, so TP with SP jitters as one rank does; a recomputed forward draws it again alike."""
    if not training or not eps:
        return x
    if not sequence_parallel or state.get_tensor_model_parallel_world_size() == 1:
        return x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
    return x * _this_ranks_share(x, lambda full: full.uniform_(1.0 - eps, 1.0 + eps))


def _this_ranks_share(x: torch.Tensor, draw) -> torch.Tensor:
    """`draw` filling the whole sequence's tensor (x's sequence dim times TP, from the RNG every TP rank
    shares), this TP rank's slice of it: what a rank without sequence parallelism draws for it."""
    tp = state.get_tensor_model_parallel_world_size()
    full = torch.empty((x.shape[0] * tp, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return draw(full).chunk(tp, dim=0)[state.get_tensor_model_parallel_rank()]


_recomputing = [0]  # > 0 while a checkpointed forward runs again in the backward


def is_recomputing() -> bool:
    """Whether the forward running now is activation recomputation (so it counts nothing: the
    routers' token counts, say, were taken in the first forward)."""
    return _recomputing[0] > 0


def checkpoint_with_tp_rng(fn, *args):
    """Activation checkpoint whose recomputation replays the same dropout masks, in the default
    RNG (torch restores it) and in the TP-rank RNG stream (restored here)."""
    return _torch_checkpoint(_Replaying(fn), *args, use_reentrant=False, preserve_rng_state=True)


class _Replaying:
    """A checkpointed function: its first call runs `fn` and notes the TP-rank RNG state; the
    second (the recomputation) runs it again from that state. Traced by torch.compile it is `fn`
    alone: the compiled backward recomputes the region and no Python runs again (and dynamo, which
    breaks the graph on such bookkeeping, traces none). Where dynamo cannot trace the region (a
    function in it runs eagerly), the checkpoint runs eagerly, and this with it."""

    def __init__(self, fn):
        self.fn, self.states_at_forward = fn, None

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.fn(*args)
        tracker = get_rng_tracker()
        if self.states_at_forward is None:
            self.states_at_forward = tracker.get_states()
            return self.fn(*args)
        now = tracker.get_states()
        tracker.set_states(self.states_at_forward)
        _recomputing[0] += 1
        try:
            return self.fn(*args)
        finally:
            _recomputing[0] -= 1
            tracker.set_states(now)
