"""The router: which experts each token goes to, and with what weight (fp32 throughout).

Score functions, as the MoE families use them:
- softmax after top-k (the default; Mixtral, Qwen3-MoE): the top-k logits, then a softmax over
  them, so each token's weights sum to 1;
- softmax before top-k (`pre_softmax`; Qwen2-MoE, OLMoE): a softmax over every expert, the top-k
  probabilities kept as they are;
- sigmoid (DeepSeek-V3): sigmoid scores; the top-k chosen on score + expert bias (the bias moves
  selection only), the weights the scores themselves, renormalised over the top-k when k > 1.
Then the weights times `topk_scaling_factor`, where the model has one. Group-limited routing
chooses `group_topk` of `num_groups` groups of experts first (a group's score: the sum of its top
topk / group_topk scores) and the top-k among their experts.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megalite.models.config import TransformerConfig
from megalite.models.moe.balanced import force_balanced
from megalite.models.moe.capacity import count_per_expert
from megalite.models.rng import is_recomputing, weight_init
from megalite.parallel import state, traffic, weight_grad
from megalite.parallel.grad_accumulation import linear
from megalite.parallel.layers import default_device, init_device


def _topk(scores: torch.Tensor, k: int, num_groups: int | None, group_topk: int | None) -> torch.Tensor:
    """The indices of each row's top-k scores; with groups, among the best `group_topk` groups only."""
    if num_groups:
        tokens, experts = scores.shape
        grouped = scores.view(tokens, num_groups, experts // num_groups)
        group_scores = grouped.topk(k // group_topk, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(group_topk, dim=-1).indices, True)
        scores = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, experts)
    return scores.topk(k, dim=-1).indices


def route(logits: torch.Tensor, config: TransformerConfig, expert_bias: torch.Tensor | None = None):
    """(weights [T, k] fp32, expert indices [T, k], scores [T, E]) from the router's fp32 logits;
    `scores` are what the load-balancing losses average (probabilities that sum to 1 per token)."""
    k, groups, group_topk = config.moe_router_topk, config.moe_router_num_groups, config.moe_router_group_topk
    if config.moe_router_score_function == "sigmoid":
        sig = torch.sigmoid(logits)
        choice = sig if expert_bias is None else sig + expert_bias
        indices = _topk(choice.detach(), k, groups, group_topk)
        weights = sig.gather(1, indices)
        if k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        scores = sig / (sig.sum(-1, keepdim=True) + 1e-20)
    elif config.moe_router_pre_softmax:
        scores = torch.softmax(logits, dim=-1)
        indices = _topk(scores.detach(), k, groups, group_topk)
        weights = scores.gather(1, indices)
    else:
        indices = _topk(logits.detach(), k, groups, group_topk)
        weights = torch.softmax(logits.gather(1, indices), dim=-1)
        scores = torch.softmax(logits, dim=-1)
    if config.moe_router_topk_scaling_factor is not None:
        weights = weights * config.moe_router_topk_scaling_factor
    return weights, indices, scores


class TopKRouter(nn.Module):
    """Logits x W^T in fp32 (W [experts, hidden], replicated over tensor parallelism), routed by `route`.
    With aux-loss-free balancing, `expert_bias` (saved with the model) shifts selection and
    `tokens_per_expert` counts the step's routed tokens for its update."""

    def __init__(self, config: TransformerConfig, init_method=None, device=None):
        super().__init__()
        self.config = config
        device = default_device(device)
        full = torch.zeros(config.num_moe_experts, config.hidden_size, dtype=torch.float32, device=init_device(device))
        (init_method or weight_init(config))(full)
        self.weight = nn.Parameter(full.to(device=device, dtype=config.params_dtype))
        # Under sequence parallelism each TP rank routes its own tokens: partial gradients, summed over TP.
        self.weight.sequence_parallel = config.sequence_parallel
        self.bias = None  # with add_bias_linear (gpt-oss), drawn like the weight, as Megatron-Core's router
        if config.add_bias_linear:
            full = torch.zeros(config.num_moe_experts, dtype=torch.float32, device=init_device(device))
            (init_method or weight_init(config))(full)
            self.bias = nn.Parameter(full.to(device=device, dtype=config.params_dtype))
            self.bias.sequence_parallel = config.sequence_parallel
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_moe_experts, dtype=torch.float32, device=device))
            self.register_buffer("tokens_per_expert", torch.zeros(config.num_moe_experts, dtype=torch.float32,
                                                                  device=device), persistent=False)
        else:
            self.expert_bias = None

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = linear(tokens.float(), self.weight.float())
        return logits if self.bias is None else logits + weight_grad.defer_delivery(self.bias).float()

    def forward(self, tokens: torch.Tensor):
        """tokens [T, hidden] -> (weights [T, k] fp32, indices [T, k], scores [T, E], logits [T, E])."""
        logits = self.logits(tokens)
        if self.config.moe_router_force_load_balancing:  # benchmarking: even loads (balanced.py)
            logits = force_balanced(logits, tokens)
        weights, indices, scores = route(logits, self.config, self.expert_bias)
        if self.expert_bias is not None and self.training and torch.is_grad_enabled() and not is_recomputing():
            self.tokens_per_expert += count_per_expert(indices, self.config.num_moe_experts)
        return weights, indices, scores, logits


def expert_bias_routers(chunks) -> list[TopKRouter]:
    """The routers of these model chunks that balance by an expert bias (found once: a step does not
    walk every module)."""
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter) and m.expert_bias is not None]


def update_expert_biases(routers: list[TopKRouter], skipped: torch.Tensor | None = None) -> None:
    """Aux-loss-free balancing, once per optimizer step: each router's expert bias moves by the update
    rate towards balance, bias_e += rate * sign(mean load - load_e), from the whole global batch's
    counts (summed over the stage's TP x CP x DP ranks, every micro-batch). A step skipped for
    inf/NaN gradients (`skipped` 1.0) moves nothing. `routers`: `expert_bias_routers(chunks)`; a
    stage without such routers does nothing."""
    if not routers:
        return
    counts = torch.stack([r.tokens_per_expert for r in routers])
    for group in (state.get_tensor_and_context_parallel_group(), state.get_data_parallel_group()):
        if group is not None and dist.get_world_size(group) > 1:
            traffic.counted_all_reduce("metrics", counts, group)
    with torch.no_grad():
        for r, load in zip(routers, counts):
            step = r.config.moe_router_bias_update_rate * torch.sign(load.mean() - load)
            if skipped is not None:
                step = step * (1.0 - skipped)
            r.expert_bias.add_(step)
            r.tokens_per_expert.zero_()
