"""DeepSeek-V3's routing and mixture of experts <-> Hugging Face's: the MoE layers' rows, the router's
and experts' config fields both ways, and what export fills in that megalite does not hold.

MoE layers (after `first_k_dense_replace` dense ones): the router `mlp.gate` (sigmoid scores;
`e_score_correction_bias`, on selection only, is megalite's `router.expert_bias`), the experts
fused in memory as for the other MoE families (moe.py; one tensor per expert in the files), and
`n_shared_experts` ungated shared experts, which are one MLP n times `moe_intermediate_size` wide.
"""
from __future__ import annotations

import torch

from megalite.tools.convert_hf import llama
from megalite.tools.convert_hf.common import Row
from megalite.tools.convert_hf.deepseek_shape import DEEPSEEK_V3, Shape, llama_shape, shape_of


def moe_mlp_rows(s: Shape, i: int) -> list[Row]:
    """Layer i's MoE MLP, in the order of MoELayer.state_dict()."""
    ours, theirs = f"layers.{i}.mlp.", f"model.layers.{i}.mlp."
    rows = [(f"{ours}router.weight", f"{theirs}gate.weight", "same")]
    if s.expert_bias:
        rows.append((f"{ours}router.expert_bias", f"{theirs}gate.e_score_correction_bias", "same"))
    rows += [(f"{ours}experts.fc1_weight", f"{theirs}experts.gate_up_proj", "same"),
             (f"{ours}experts.fc2_weight", f"{theirs}experts.down_proj", "same")]
    if s.shared_expert:
        rows += llama.dense_mlp_rows(llama_shape(s), f"{ours}shared_experts.", f"{theirs}shared_experts.")
    return rows


def _group_fields(cfg, problems: list[str]) -> dict:
    """Group-limited routing. Hugging Face scores a group by the sum of its 2 best (biased) scores,
    megalite by its best topk / group_topk: the same when topk = 2 x group_topk (DeepSeek-V3: 8, 4)."""
    groups, chosen, k = cfg.n_group or 1, cfg.topk_group or 1, cfg.num_experts_per_tok
    if groups <= 1 or chosen >= groups:  # every group stays in: plain top-k
        return {}
    if k != 2 * chosen:
        problems.append(f"n_group={groups}, topk_group={chosen} with num_experts_per_tok={k} (Hugging Face scores a "
                        f"group by its 2 best experts, megalite by its num_experts_per_tok / topk_group best: they "
                        f"agree only when num_experts_per_tok = 2 x topk_group)")
        return {}
    return dict(moe_router_num_groups=groups, moe_router_group_topk=chosen)


def moe_fields(cfg, problems: list[str]) -> dict:
    """The MLP widths and, when some layer has experts, the MoE fields."""
    layers, dense = cfg.num_hidden_layers, min(cfg.first_k_dense_replace or 0, cfg.num_hidden_layers)
    fields = dict(ffn_hidden_size=cfg.intermediate_size)
    if dense == layers:  # no MoE layer: a dense model with MLA
        return fields
    k, width = cfg.num_experts_per_tok, cfg.moe_intermediate_size
    # megalite's sigmoid router renormalises its top-k weights whenever k > 1 (router.route).
    if bool(cfg.norm_topk_prob) != (k > 1):
        problems.append(f"norm_topk_prob={cfg.norm_topk_prob} with num_experts_per_tok={k} (megalite's sigmoid "
                        f"router divides the top-k scores by their sum exactly when k > 1)")
    scaling = float(cfg.routed_scaling_factor)
    fields.update(num_moe_experts=cfg.n_routed_experts, moe_router_topk=k, moe_ffn_hidden_size=width,
                  moe_layer_freq=[0] * dense + [1] * (layers - dense), moe_router_score_function="sigmoid",
                  moe_router_enable_expert_bias=True, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                  moe_router_topk_scaling_factor=scaling if scaling != 1.0 else None,
                  moe_shared_expert_intermediate_size=(cfg.n_shared_experts or 0) * width or None,
                  **_group_fields(cfg, problems))
    return fields


def dense_first(c) -> int:
    """first_k_dense_replace: the dense layers before the first MoE one (all, without experts)."""
    return list(c.moe_layer_freq).index(1) if c.is_moe and any(c.moe_layer_freq) else c.num_layers


def export_moe_problems(c) -> list[str]:
    """What DeepseekV3ForCausalLM cannot hold of a megalite config's experts and router (none without
    experts)."""
    problems = []
    if not c.is_moe:
        return problems
    freq, dense = list(c.moe_layer_freq), dense_first(c)
    if freq != [0] * dense + [1] * (len(freq) - dense):
        problems.append(f"{DEEPSEEK_V3} has its dense layers first (first_k_dense_replace): moe_layer_freq {freq} "
                        f"has a dense layer after a MoE one")
    shared, width = c.moe_shared_expert_intermediate_size or 0, c.moe_ffn_hidden_size
    if shared % width:
        problems.append(f"moe_shared_expert_intermediate_size={shared} is not a multiple of moe_ffn_hidden_size="
                        f"{width} ({DEEPSEEK_V3}'s shared experts are n_shared_experts x moe_intermediate_size wide)")
    groups, chosen, k = c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk
    if groups and chosen < groups and k != 2 * chosen:
        problems.append(f"moe_router_topk={k} with moe_router_group_topk={chosen} ({DEEPSEEK_V3} scores a group by "
                        f"its 2 best experts, megalite by its topk / group_topk = {k // chosen} best)")
    return problems


def hf_moe_kwargs(c) -> dict:
    """DeepseekV3Config's expert and router arguments of a megalite config with experts."""
    k, width = c.moe_router_topk, c.moe_ffn_hidden_size
    return dict(n_routed_experts=c.num_moe_experts, num_experts_per_tok=k, moe_intermediate_size=width,
                n_shared_experts=(c.moe_shared_expert_intermediate_size or 0) // width,
                routed_scaling_factor=float(c.moe_router_topk_scaling_factor or 1.0), norm_topk_prob=k > 1,
                n_group=c.moe_router_num_groups or 1, topk_group=c.moe_router_group_topk or 1)


def fill_what_megalite_lacks(theirs: dict[str, torch.Tensor], c, model) -> None:
    """Zero correction biases for a router without expert biases (selection by the scores alone),
    and the zero-width shared experts of n_shared_experts=0, which have no elements to copy."""
    moe_layers = shape_of(c).moe_layers
    for i, has_experts in enumerate(moe_layers + moe_layers[-1:] * c.mtp_num_layers):
        name = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        if has_experts and name not in theirs:
            theirs[name] = torch.zeros(c.num_moe_experts, dtype=torch.float32)
    theirs.update({n: t for n, t in model.state_dict().items() if n not in theirs and t.numel() == 0})
