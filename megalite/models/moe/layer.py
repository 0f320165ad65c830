"""The MoE layer: router, dispatcher and local experts in place of a transformer layer's MLP, plus
an optional shared expert every token takes (a dense tensor-parallel MLP, optionally gated by
sigmoid(x . w))."""
from __future__ import annotations

import torch
from torch import nn

from megalite.models.config import TransformerConfig
from megalite.models.mlp import mlp_layer
from megalite.models.moe import losses, stats
from megalite.models.moe.capacity import count_per_expert, drop_over_capacity, expert_capacity
from megalite.models.moe.dispatcher import make_dispatcher
from megalite.models.moe.experts import GroupedMLP
from megalite.models.moe.router import TopKRouter
from megalite.models.rng import input_jitter, weight_init
from megalite.parallel import state
from megalite.parallel.grad_accumulation import linear
from megalite.parallel.layers import default_device, init_device


class MoELayer(nn.Module):
    def __init__(self, config: TransformerConfig, init_method=None, output_init_method=None, device=None,
                 layer_number: int = 0):
        super().__init__()
        self.layer_number = layer_number  # global, 0-based: where its figures are reported
        self.figures: torch.Tensor | None = None  # since the last log line (megalite.models.moe.stats)
        tp = state.get_tensor_model_parallel_world_size()
        if tp > 1 and not config.sequence_parallel:
            raise ValueError(f"mixture-of-experts layers at --tp {tp} need --sequence-parallel (each TP rank "
                             f"routes its own part of the sequence): add --sequence-parallel")
        self.config = config
        self.router = TopKRouter(config, init_method, device)
        self.experts = GroupedMLP(config, init_method, output_init_method, device)
        self.dispatcher = make_dispatcher(config.moe_token_dispatcher_type, config.num_moe_experts,
                                          config.moe_dispatch_chunks)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size:
            shared = config.replace(ffn_hidden_size=config.moe_shared_expert_intermediate_size)
            self.shared_experts = mlp_layer(shared, init_method, output_init_method, device)
            self.shared_expert_gate = None
            if config.moe_shared_expert_gate:
                full = torch.zeros(1, config.hidden_size, dtype=torch.float32, device=init_device(default_device(device)))
                (init_method or weight_init(config))(full)
                self.shared_expert_gate = nn.Parameter(full.to(device=default_device(device), dtype=config.params_dtype))
                self.shared_expert_gate.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s, b, hidden] (sequence-sharded under SP) -> the same shape."""
        tokens = x.reshape(-1, x.shape[-1])
        c = self.config
        routed_input = input_jitter(x, c.moe_input_jitter_eps, self.training, c.sequence_parallel)
        routed_input = routed_input.reshape(tokens.shape)
        weights, indices, scores, logits = self.router(routed_input)  # (the experts read the tokens unjittered)
        routed, pad_to = indices, None
        if c.moe_expert_capacity_factor is not None:
            capacity = expert_capacity(tokens.shape[0], c.moe_router_topk, c.num_moe_experts,
                                       c.moe_expert_capacity_factor)
            routed = drop_over_capacity(weights, indices, c.num_moe_experts, capacity, c.moe_token_drop_policy)
            pad_to = capacity if c.moe_pad_expert_input_to_capacity else None
        expert_input = tokens
        if c.moe_apply_probs_on_input:  # top-1: the weight scales the expert's input (in its dtype), not its output
            expert_input, weights = (weights * tokens).to(tokens.dtype), torch.ones_like(weights)
        out = self.dispatcher(expert_input, weights, routed, self.experts, pad_to=pad_to).view_as(x)
        out, aux, z = self._add_losses(out, scores, indices, logits, sequences=x.shape[1])
        if self.training and torch.is_grad_enabled():
            counts = count_per_expert(routed, c.num_moe_experts + 1)
            stats.record(self, c.num_moe_experts, counts[:c.num_moe_experts], routed.numel(), aux, z,
                         counts[c.num_moe_experts], (~torch.isfinite(logits.detach())).any(-1).sum())
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(linear(x, self.shared_expert_gate))
            out = out + shared
        return out

    def _add_losses(self, out, scores, indices, logits, sequences: int):
        """`out` with the router's loss terms attached, and this rank's weighted shares of them."""
        c = self.config
        aux = z = None
        if not (self.training and torch.is_grad_enabled()):
            return out, aux, z
        if c.moe_router_load_balancing_type != "none" and c.moe_aux_loss_coeff:
            aux = losses.load_balancing_loss(c.moe_router_load_balancing_type, scores, indices, c.num_moe_experts,
                                             c.moe_router_topk, sequences, c.moe_aux_loss_coeff)
            out = losses.attach(out, aux)
        if c.moe_z_loss_coeff:
            z = losses.z_loss(logits, sequences, c.moe_z_loss_coeff)
            out = losses.attach(out, z)
        return out, aux, z
