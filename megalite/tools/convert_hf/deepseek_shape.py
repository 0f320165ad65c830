"""What decides DeepSeek-V3's table rows (Shape, from a megalite config) and the class's name: the base
that deepseek.py and its MLA (deepseek_mla) and MoE (deepseek_moe) mappings share."""
from __future__ import annotations

from dataclasses import dataclass

from megalite.tools.convert_hf import llama

DEEPSEEK_V3 = "DeepseekV3ForCausalLM"


@dataclass(frozen=True)
class Shape:
    """What decides the table's rows."""
    num_layers: int
    q_lora: bool  # q_down, q_norm, q_up; else one `q`
    moe_layers: tuple[int, ...]  # 1: layer i's MLP has experts, 0: dense
    expert_bias: bool
    shared_expert: bool
    untied: bool
    mtp_layers: int = 0  # multi-token prediction's depths: Hugging Face's layers num_layers, num_layers + 1, ...


def shape_of(c) -> Shape:
    moe_layers = tuple(c.moe_layer_freq) if c.is_moe else (0,) * c.num_layers
    return Shape(c.num_layers, c.q_lora_rank is not None, moe_layers, c.is_moe and c.moe_router_enable_expert_bias,
                 bool(c.moe_shared_expert_intermediate_size), c.untie_embeddings_and_output_weights,
                 c.mtp_num_layers)


def llama_shape(s: Shape) -> llama.Shape:
    """The Llama family's Shape, for its embedding and (bias-free) dense MLP rows."""
    return llama.Shape(s.num_layers, grouped=False, qkv_bias=False, linear_bias=False, qk_norm=False, untied=s.untied)
