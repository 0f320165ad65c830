"""Named model shapes (`--model`): GPT-2 and GPT-3's, BERT's, the Llama family's, mixtures of experts,
DeepSeek-V3's; each a dict of TransformerConfig fields, `preset(name, **overrides)` the config."""
from __future__ import annotations

from megalite.models.config import TransformerConfig

# BERT as published (Devlin et al. 2019; Hugging Face's bert-*-uncased). Attention direction is
# left to the model class: BERTModel is always bidirectional, GPTModel causal.
_BERT = dict(layernorm_position="post", activation="gelu", layernorm_epsilon=1e-12)

# Named shapes. Vocabulary sizes are those of the tokenizers they are used with; the GPT-2
# family follows the GPT-2 / Megatron-LM papers, BERT's the 30522-token WordPiece vocabulary.
PRESETS: dict[str, dict] = {
    "gpt-tiny": dict(num_layers=4, hidden_size=128, num_attention_heads=4, max_position_embeddings=128,
                     vocab_size=1024),
    "gpt2-124m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, max_position_embeddings=1024),
    "gpt2-350m": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, max_position_embeddings=1024),
    "gpt-1.3b": dict(num_layers=24, hidden_size=2048, num_attention_heads=16, max_position_embeddings=2048),
    "gpt-175b": dict(num_layers=96, hidden_size=12288, num_attention_heads=96, max_position_embeddings=2048),
    "bert-tiny": dict(num_layers=2, hidden_size=128, num_attention_heads=2, max_position_embeddings=128,
                      vocab_size=30522, **_BERT),
    "bert-base": dict(num_layers=12, hidden_size=768, num_attention_heads=12, max_position_embeddings=512,
                      vocab_size=30522, **_BERT),
    "bert-large": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, max_position_embeddings=512,
                       vocab_size=30522, **_BERT),
}

# The Llama family: rotary positions, SwiGLU, RMSNorm, grouped-query attention, no biases. Shapes
# from each model's published Hugging Face config.json (hidden_size, intermediate_size,
# num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size, max_position_embeddings,
# rope_theta, rms_norm_eps, tie_word_embeddings, rope_scaling):
#   HuggingFaceTB/SmolLM2-135M, Qwen/Qwen2.5-0.5B, meta-llama/Llama-3.2-1B, meta-llama/Meta-Llama-3-8B,
#   meta-llama/Meta-Llama-3-70B.
_LLAMA = dict(position_embedding_type="rope", gated_linear_unit=True, activation="silu", normalization="rmsnorm",
              add_bias_linear=False, untie_embeddings_and_output_weights=True)
_LLAMA3 = dict(_LLAMA, vocab_size=128256, rotary_base=500000.0, num_query_groups=8)

PRESETS.update({
    # For tests: 8 heads in 2 groups trains at tp 4 with replicated key/value groups.
    "llama-tiny": dict(_LLAMA, num_layers=4, hidden_size=128, num_attention_heads=8, num_query_groups=2,
                       ffn_hidden_size=256, max_position_embeddings=128, vocab_size=1024),
    "smollm2-135m": dict(_LLAMA, num_layers=30, hidden_size=576, num_attention_heads=9, num_query_groups=3,
                         ffn_hidden_size=1536, max_position_embeddings=8192, vocab_size=49152,
                         rotary_base=100000.0, untie_embeddings_and_output_weights=False),
    "qwen2.5-0.5b": dict(_LLAMA, num_layers=24, hidden_size=896, num_attention_heads=14, num_query_groups=2,
                         ffn_hidden_size=4864, max_position_embeddings=32768, vocab_size=151936,
                         rotary_base=1000000.0, layernorm_epsilon=1e-6, add_qkv_bias=True,
                         untie_embeddings_and_output_weights=False),
    "llama-3.2-1b": dict(_LLAMA3, num_layers=16, hidden_size=2048, num_attention_heads=32, ffn_hidden_size=8192,
                         max_position_embeddings=131072, rope_scaling_factor=32.0, rope_low_freq_factor=1.0,
                         rope_high_freq_factor=4.0, rope_original_max_position_embeddings=8192,
                         untie_embeddings_and_output_weights=False),
    "llama-3-8b": dict(_LLAMA3, num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=14336,
                       max_position_embeddings=8192),
    "llama-3-70b": dict(_LLAMA3, num_layers=80, hidden_size=8192, num_attention_heads=64, ffn_hidden_size=28672,
                        max_position_embeddings=8192),
})

# Mixtures of experts on the Llama family's layers. From each model's published Hugging Face
# config.json (besides the fields above: num_local_experts / num_experts, num_experts_per_tok,
# moe_intermediate_size, norm_topk_prob, router_aux_loss_coef, router_z_loss_coef):
#   mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen3-30B-A3B, allenai/OLMoE-1B-7B-0924.
# norm_topk_prob true (Mixtral, Qwen3) is a softmax over the top-k logits, megalite's default
# router; false (OLMoE) is --moe-router-pre-softmax.
PRESETS.update({
    # For tests: the first layer dense, then 8 experts top-2 and a shared expert (every path of a MoE layer).
    "moe-tiny": dict(_LLAMA, num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=128, max_position_embeddings=128, vocab_size=1024, num_moe_experts=8,
                     moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=[0, 1, 1, 1],
                     moe_shared_expert_intermediate_size=32, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001),
    "mixtral-8x7b": dict(_LLAMA, num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                         ffn_hidden_size=14336, max_position_embeddings=32768, vocab_size=32000,
                         rotary_base=1000000.0, num_moe_experts=8, moe_router_topk=2, moe_aux_loss_coeff=0.02),
    # Qwen3's heads are 128 wide (head_dim) at hidden 2048 with 32 heads: kv_channels 128.
    "qwen3-30b-a3b": dict(_LLAMA, num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                          kv_channels=128,
                          ffn_hidden_size=6144, max_position_embeddings=40960, vocab_size=151936,
                          rotary_base=1000000.0, layernorm_epsilon=1e-6, qk_layernorm=True, num_moe_experts=128,
                          moe_router_topk=8, moe_ffn_hidden_size=768, moe_aux_loss_coeff=0.001),
    # OLMoE normalizes queries and keys over the whole projection (2048 wide): qk_layernorm_full_width.
    "olmoe-1b-7b": dict(_LLAMA, num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=1024,
                        qk_layernorm=True, qk_layernorm_full_width=True,
                        max_position_embeddings=4096, vocab_size=50304, num_moe_experts=64, moe_router_topk=8,
                        moe_ffn_hidden_size=1024, moe_router_pre_softmax=True, moe_aux_loss_coeff=0.01,
                        moe_z_loss_coeff=0.001),
})


# DeepSeek-V3 (arXiv 2412.19437; deepseek-ai/DeepSeek-V3's config.json): multi-head latent attention,
# 256 routed experts (top-8 of 8 groups, 4 groups per token) under a sigmoid router with aux-loss-free
# bias, one shared expert, the first 3 layers dense, one multi-token prediction module, YaRN to 160K.
# Its balance terms as the paper trains them: sequence-wise aux loss alpha 0.0001, bias rate 0.001.
_DEEPSEEK = dict(_LLAMA, multi_latent_attention=True, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
                 kv_lora_rank=512, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                 moe_router_load_balancing_type="seq_aux_loss", moe_router_bias_update_rate=1e-3, mtp_num_layers=1,
                 mtp_loss_scaling_factor=0.1)
PRESETS.update({
    "deepseek-v3": dict(_DEEPSEEK, num_layers=61, hidden_size=7168, num_attention_heads=128, ffn_hidden_size=18432,
                        q_lora_rank=1536, vocab_size=129280, max_position_embeddings=163840, layernorm_epsilon=1e-6,
                        yarn_factor=40.0, yarn_original_max_position_embeddings=4096, yarn_mscale=1.0,
                        yarn_mscale_all_dim=1.0, num_moe_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
                        moe_layer_freq=[0] * 3 + [1] * 58, moe_router_num_groups=8, moe_router_group_topk=4,
                        moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=2048,
                        moe_aux_loss_coeff=1e-4),
    # For tests: DeepSeek-V3's every path at CPU size (no query low rank: add --q-lora-rank for it).
    "deepseek-tiny": dict(_DEEPSEEK, num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                          kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
                          max_position_embeddings=128, vocab_size=1024, num_moe_experts=16, moe_router_topk=4,
                          moe_ffn_hidden_size=32, moe_layer_freq=[0, 1, 1], moe_router_num_groups=4,
                          moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                          moe_shared_expert_intermediate_size=32, moe_aux_loss_coeff=0.01),
})


# gpt-oss (OpenAI; openai/gpt-oss-20b's and -120b's config.json, Megatron-Bridge's gpt-oss page): every MLP a
# MoE layer of quick-GeGLU experts clamped at 7 with the up half offset by 1, biases everywhere, learned
# attention sinks, a 128-token window in every other layer (the first windowed), YaRN x32 without rounding.
_GPT_OSS = dict(_LLAMA, add_bias_linear=True, softmax_type="learnable", activation="quick_gelu",
                glu_linear_offset=1.0, activation_func_clamp_value=7.0, window_size=(127, 0), window_attn_skip_freq=2,
                rotary_base=150000.0, yarn_factor=32.0, yarn_original_max_position_embeddings=4096,
                yarn_correction_range_round_to_int=False, moe_router_topk=4)
PRESETS.update({
    "gpt-oss-20b": dict(_GPT_OSS, num_layers=24, hidden_size=2880, num_attention_heads=64, num_query_groups=8,
                        kv_channels=64, ffn_hidden_size=2880, vocab_size=201088, max_position_embeddings=131072,
                        num_moe_experts=32, moe_ffn_hidden_size=2880),
    "gpt-oss-120b": dict(_GPT_OSS, num_layers=36, hidden_size=2880, num_attention_heads=64, num_query_groups=8,
                         kv_channels=64, ffn_hidden_size=2880, vocab_size=201088, max_position_embeddings=131072,
                         num_moe_experts=128, moe_ffn_hidden_size=2880),
    # For tests: every path of a gpt-oss layer at CPU size (a 4-token window, YaRN over 16 positions).
    "gpt-oss-tiny": dict(_GPT_OSS, num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                         kv_channels=16, ffn_hidden_size=32, vocab_size=1024, max_position_embeddings=64,
                         window_size=(3, 0), yarn_factor=4.0, yarn_original_max_position_embeddings=16,
                         num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.01),
})


def preset(name: str, **overrides) -> TransformerConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}")
    return TransformerConfig(**{**PRESETS[name], **overrides})
