"""Upcycling (`--moe-use-upcycling`): a dense checkpoint's weights as a mixture-of-experts model's,
computed as Megatron-Core's `upcycling_utils` computes them, at any layout of the MoE model.

With granularity g (`--moe-upcycling-granularity`; the dense MLP's width = g x one expert's) the dense
MLP's features are cut into g parts, and expert e holds part e mod g. Both its fc1 and fc2 are scaled
by s = a^(1/3) for a gated MLP or squared ReLU (three factors of s meet in the output), else a^(1/2),
where a, the activation scale, is g, or (E g) / k with the softmax before the top-k
(Komatsuzaki et al. 2022; He et al. 2024, arXiv:2410.07524). The router keeps its own draw, with
experts g i .. g i + g - 1 given row i (and bias i), so that a token's top-k takes whole groups of parts. fc2's bias
is copied unscaled (the routing weights sum to one). Everything else is copied as it is; what the dense
model has no counterpart for (the router, shared experts, FP8 scaling state) keeps its initialisation.

Where this is exact: the softmax after the top-k with k a multiple of g and an activation that commutes
with a positive scale to the power the scale assumes: any activation at g = 1; squared ReLU (x^2) at
any g. A gated MLP's silu or GeLU, at g > 1, gives the dense function only approximately (s is the
paper's heuristic)."""
from __future__ import annotations

import re

import torch

from megalite.checkpoint.layout import stored_tensors
from megalite.checkpoint.load import _copy_local
from megalite.models.config import TransformerConfig
from megalite.runtime import UsageError

_EXPERT = re.compile(r"^(?P<layer>.+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<leaf>fc[12]_(?:weight|bias))$")
_KEEP_INIT = re.compile(r"\.mlp\.(?:router\.|shared_experts\.|shared_expert_gate$)")


def activation_scale(config: TransformerConfig, granularity: int) -> float:
    """How much smaller a token's sum over its experts is than the dense MLP's output, before scaling."""
    if config.moe_router_pre_softmax:
        return config.num_moe_experts * granularity / config.moe_router_topk
    return float(granularity)


def weight_scale(config: TransformerConfig, granularity: int) -> float:
    a = activation_scale(config, granularity)
    cubic = config.gated_linear_unit or config.activation == "squared_relu"
    return a ** (1 / 3) if cubic else a ** (1 / 2)


def check_upcycling(dense: TransformerConfig, moe: TransformerConfig, granularity: int, path: str) -> None:
    """The dense checkpoint and the MoE model fit: one line naming the mismatch and the fix."""
    if not moe.is_moe:
        raise UsageError("--moe-use-upcycling turns a dense checkpoint into experts: give --num-experts E")
    if dense.is_moe:
        raise UsageError(f"--moe-use-upcycling: the checkpoint {path} already holds experts; drop the flag to "
                         f"resume it, or --load a dense checkpoint")
    if dense.ffn_hidden_size != moe.moe_ffn_hidden_size * granularity:
        raise UsageError(f"--moe-use-upcycling: the checkpoint {path}'s MLP is {dense.ffn_hidden_size} wide, and "
                         f"--moe-upcycling-granularity {granularity} x --moe-ffn-hidden-size "
                         f"{moe.moe_ffn_hidden_size} is {moe.moe_ffn_hidden_size * granularity}: give "
                         f"--moe-ffn-hidden-size {dense.ffn_hidden_size // granularity} (the dense width / the "
                         f"granularity)" if dense.ffn_hidden_size % granularity == 0 else
                         f"--moe-use-upcycling: the checkpoint {path}'s MLP width {dense.ffn_hidden_size} is not "
                         f"divisible by --moe-upcycling-granularity {granularity}: choose one of its divisors")
    if moe.num_moe_experts % granularity:
        raise UsageError(f"--moe-use-upcycling: --num-experts {moe.num_moe_experts} is not a multiple of "
                         f"--moe-upcycling-granularity {granularity} (each group of {granularity} experts holds "
                         f"the whole dense MLP): choose a multiple")
    if dense.gated_linear_unit != moe.gated_linear_unit or dense.add_bias_linear != moe.add_bias_linear:
        raise UsageError(f"--moe-use-upcycling: the checkpoint {path}'s MLP is "
                         f"{_kind(dense)}, this run's experts {_kind(moe)}: give the dense model's MLP flags")


def _kind(c: TransformerConfig) -> str:
    return f"{'gated' if c.gated_linear_unit else 'plain'}, {'with' if c.add_bias_linear else 'without'} biases"


class Upcycled:
    """The full tensors of the upcycled model, from the dense checkpoint's, by the MoE model's names."""

    def __init__(self, reader, moe: TransformerConfig, granularity: int):
        self.reader, self.g = reader, granularity
        self.scale = weight_scale(moe, granularity)
        self.gated, self.ffn = moe.gated_linear_unit, moe.moe_ffn_hidden_size
        self._dense: dict[str, torch.Tensor] = {}  # one layer's dense MLP at a time

    def _read(self, name: str) -> torch.Tensor:
        if name not in self._dense:
            if len(self._dense) > 4:  # the experts of one layer come together: keep that layer's only
                self._dense.clear()
            self._dense[name] = self.reader.full_tensor(name).float()
        return self._dense[name]

    def part(self, t: torch.Tensor, j: int, dim: int, blocks: int) -> torch.Tensor:
        """Part j of g of the dense features along `dim` (a gated fc1: part j of the gate and of the up)."""
        halves = t.chunk(blocks, dim)
        return torch.cat([h.narrow(dim, j * self.ffn, self.ffn) for h in halves], dim)

    def tensor(self, name: str) -> torch.Tensor | None:
        """The upcycled full tensor `name`; None: it keeps this model's initialisation."""
        m = _EXPERT.match(name)
        if m is None:
            return None if _KEEP_INIT.search(name) else self.reader.full_tensor(name)
        layer, j, leaf = m["layer"], int(m["expert"]) % self.g, m["leaf"]
        fc, kind = leaf.split("_")
        dense = self._read(f"{layer}.mlp.{fc}.{kind}")
        if leaf == "fc2_bias":
            return dense.clone()
        blocks = 2 if fc == "fc1" and self.gated else 1
        dim = 1 if leaf == "fc2_weight" else 0
        return self.part(dense, j, dim, blocks) * self.scale


def tie_router_rows(model_chunks, granularity: int) -> None:
    """Experts g i .. g i + g - 1 take router row i of the router's own draw, and its bias i where it has
    one (add_bias_linear: Megatron-Core ties the weight only, which leaves the group's logits apart)."""
    with torch.no_grad():
        for chunk in model_chunks:
            for name, p in chunk.named_parameters():
                if name.endswith(("mlp.router.weight", "mlp.router.bias")):
                    p.copy_(p[:p.shape[0] // granularity].repeat_interleave(granularity, dim=0))


def load_upcycled_weights(reader, model_chunks, moe: TransformerConfig, granularity: int) -> None:
    """This rank's pieces of the upcycled model, cut from the dense checkpoint's full tensors."""
    check_upcycling(reader.config, moe, granularity, str(reader.path))
    upcycled = Upcycled(reader, moe, granularity)
    names = set(reader.model_names())
    with torch.no_grad():
        for st in stored_tensors(model_chunks):
            if _EXPERT.match(st.name) is None and not _KEEP_INIT.search(st.name) and st.name not in names:
                raise UsageError(f"--moe-use-upcycling: the checkpoint {reader.path} has no {st.name}: it holds "
                                 f"another model; give the dense model's flags, or --load its checkpoint")
            full = upcycled.tensor(st.name)
            if full is None:
                continue
            expected = list(st.view.shape)
            if st.dim is not None:
                expected[st.dim] = st.full
            if list(full.shape) != expected:
                raise UsageError(f"--moe-use-upcycling: checkpoint tensor {st.name} has shape {tuple(full.shape)}, "
                                 f"which does not fit this model's {tuple(expected)}: give the dense model's shape "
                                 f"flags (only the experts' may differ)")
            _copy_local(st.view.view(-1), full.to(st.view.dtype), st.dim, st.start, st.view.shape, 0,
                        st.view.numel(), st.blocks)
    tie_router_rows(model_chunks, granularity)
