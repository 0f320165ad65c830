"""What mixture-of-experts layers add to a layout's memory and time: the rows a rank routes, the
activations its MoE layers keep, the bytes its token dispatcher sends, and where the expert groups
lie (megalite.models.moe; parallel folding, megalite.parallel.state.expert_grid).

Routing is taken as balanced: each rank's experts receive k x T rows per micro-batch (T the tokens
the rank routes, k the top-k), what a rank sends; dropless training can put more on one rank."""
from __future__ import annotations

import functools
import math

from megalite.models.config import TransformerConfig
from megalite.tools.plan.inputs import DTYPE_BYTES, Layout, Run


def routed_tokens(layout: Layout, run: Run) -> int:
    """T: the tokens of one micro-batch one rank routes. Each TP rank routes its sequence-parallel
    part (megalite requires --sequence-parallel with experts at tp > 1), each CP rank its chunk."""
    return run.seq_length * layout.micro_batch_size // (layout.cp * layout.tp)


def routed_rows(config: TransformerConfig, layout: Layout, run: Run) -> float:
    """Rows one rank sends to the experts per MoE layer and micro-batch, and (balanced) receives:
    k x T dropless; with a capacity factor f at most f x k x T (an expert takes ceil(f k T / E) of a
    rank's assignments), exactly E x that when padded to capacity."""
    k, tokens = config.moe_router_topk, routed_tokens(layout, run)
    factor = config.moe_expert_capacity_factor
    if factor is None:
        return float(k * tokens)
    per_expert = math.ceil(factor * k * tokens / config.num_moe_experts)
    if config.moe_pad_expert_input_to_capacity:
        return float(config.num_moe_experts * per_expert)
    return float(min(k * tokens, config.num_moe_experts * per_expert))


def activation_terms(config: TransformerConfig, layout: Layout, run: Run) -> dict[str, float]:
    """Bytes one rank keeps for the backward of one MoE layer and micro-batch, beyond the attention
    half of a dense layer, by term (`dense_mlp` is what a dense layer's MLP would keep instead):
    - router: fp32 logits and probabilities [T, E], fp32 weights and int64 indices [T, k];
    - dispatched_in: the experts' input, the rows the rank receives gathered over ETP, etp x R x h;
    - expert_ffn: the experts' ffn-wide tensors, etp x R rows of moe_ffn / etp features: four for a
      gated expert (gate, up, act(gate), fc2's input), two otherwise (as a dense MLP's);
    - combined_out: the rows back from the experts, R x h, kept to weight them by the router;
    - shared: a shared expert's ffn-wide tensors, over the sequence-gathered tokens, ffn / tp wide;
    - dense_mlp: a dense MLP's ffn-wide tensors (counted in the dense layer's formula).
    R is `routed_rows`; activations in the model dtype."""
    ab = DTYPE_BYTES[run.dtype]
    h, e, k = config.hidden_size, config.num_moe_experts, config.moe_router_topk
    t, etp = layout.tp, layout.etp
    tokens = routed_tokens(layout, run)
    rows = routed_rows(config, layout, run)
    wide = 4 if config.gated_linear_unit else 2  # ffn-wide tensors kept per token
    gathered = run.seq_length * layout.micro_batch_size // layout.cp  # an MLP's tokens under SP
    shared = config.moe_shared_expert_intermediate_size or 0
    return {
        "router": tokens * e * 8.0 + tokens * k * 12.0,
        "dispatched_in": etp * rows * h * ab,
        "expert_ffn": etp * rows * (config.moe_ffn_hidden_size // etp) * wide * ab,
        "combined_out": rows * h * ab,
        "shared": gathered * (shared // t) * wide * float(ab),
        "dense_mlp": gathered * (config.ffn_hidden_size // t) * wide * float(ab),
    }


def moe_layer_extra_bytes(config: TransformerConfig, layout: Layout, run: Run, recompute: str) -> float:
    """What a MoE layer keeps beyond a dense layer of the same config (may be negative); nothing
    under full recomputation, which keeps only the layer's input either way."""
    if recompute == "full":
        return 0.0
    terms = activation_terms(config, layout, run)
    return sum(v for name, v in terms.items() if name != "dense_mlp") - terms["dense_mlp"]


def dispatch_bytes(config: TransformerConfig, layout: Layout, run: Run) -> dict[str, float]:
    """Bytes one rank sends per MoE layer and micro-batch, forward and backward (and the forward
    again under full recomputation), by the group they cross:
    - alltoall: "ep", the dispatch and combine all-to-alls, (ep-1)/ep of its R rows of h each, four
      a micro-batch (six with full recomputation); "etp", the all-gather of the received rows over
      ETP and the reduce-scatter of their outputs, (etp-1) x R rows each, as many;
    - allgather: "ep", the all-gather of the T tokens over the ETP x EP group and the reduce-scatter
      of the outputs, (n-1) x T rows each with n = ep x etp."""
    ab = DTYPE_BYTES[run.dtype]
    h, ep, etp = config.hidden_size, layout.ep, layout.etp
    passes = 6 if layout.recompute == "full" else 4
    if config.moe_token_dispatcher_type == "allgather":
        n = ep * etp
        return {"ep": passes * (n - 1) * routed_tokens(layout, run) * h * ab, "etp": 0.0}
    rows = routed_rows(config, layout, run)
    return {"ep": passes * rows * h * ab * (ep - 1) / ep, "etp": passes * rows * h * ab * (etp - 1)}


def dispatch_exchanges(config: TransformerConfig, layout: Layout) -> int:
    """Exchanges of one MoE layer and micro-batch over the expert groups (each pays the collective
    latency): alltoall, the dispatch and combine all-to-alls in every pass (four, six with full
    recomputation), the all-gather and reduce-scatter of the rows over ETP as many (etp > 1), and
    the per-expert counts' all-gather in every forward (dropless: sizes unknown in advance);
    allgather, the all-gather and reduce-scatter over ETP x EP in every pass. None over one rank."""
    ep, etp = layout.ep, layout.etp
    if ep * etp == 1:
        return 0
    passes = 6 if layout.recompute == "full" else 4
    if config.moe_token_dispatcher_type == "allgather":
        return passes
    counts = 0 if config.moe_pad_expert_input_to_capacity else passes // 2 - 1
    return (passes if ep > 1 else 0) + (passes if etp > 1 else 0) + counts


def moe_layers(config: TransformerConfig, numbers) -> int:
    """How many of the global layers `numbers` are MoE layers."""
    return sum(1 for n in numbers if config.is_moe_layer(n))


# Placement: within a pipeline stage, rank = edp_rank * (ep * etp) + ep_rank * etp + etp_rank
_EXPERT_GROUPS = {"etp": lambda ep, etp: (1, etp), "ep": lambda ep, etp: (etp, ep),
                  "etp_ep": lambda ep, etp: (1, ep * etp), "edp": lambda ep, etp: (ep * etp, None)}


@functools.lru_cache(maxsize=4096)
def expert_group_crosses_nodes(kind: str, stage_ranks: int, pp: int, ep: int, etp: int, gpus_per_node: int) -> bool:
    """Whether any group of this kind ("etp", "ep", "etp_ep": the all-gather dispatcher's, "edp")
    spans more than one node. Its ranks are `stride` apart, `size` of them."""
    stride, size = _EXPERT_GROUPS[kind](ep, etp)
    size = size or stage_ranks // (ep * etp)
    for first in range(pp * stage_ranks):
        if (first % stage_ranks) // stride % size:
            continue  # not the first rank of its group
        if first // gpus_per_node != (first + (size - 1) * stride) // gpus_per_node:
            return True
    return False
