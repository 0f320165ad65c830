"""The model's sections of a run's configuration: the model (a preset and what overrides it) and its
mixture of experts. Each field has a default, a type and one line of help (megalite.config.sections
says how fields become flags); the rules that turn them into a model are megalite.config.rules."""
from __future__ import annotations

from dataclasses import dataclass

from megalite.config.fields import FRACTION, NON_NEGATIVE, POSITIVE, POSITIVE_INT, PROBABILITY, check_numbers, opt

_RECOMPUTE = ("none", "selective", "full")


@dataclass
class ModelConfig:
    """The model: a preset and what overrides it (unset fields keep the preset's value)."""
    model: str | None = opt(None, "model preset (default: the entry point's tiny model)", metavar="PRESET",
                             shape=True)
    num_layers: int | None = opt(None, "override the preset", check=POSITIVE_INT, shape=True)
    hidden_size: int | None = opt(None, "override the preset", check=POSITIVE_INT, shape=True)
    num_attention_heads: int | None = opt(None, "override the preset", check=POSITIVE_INT, shape=True)
    ffn_hidden_size: int | None = opt(None, "override the preset (default 4 x hidden; 8h/3 rounded down to 64 "
                                            "with --swiglu)", check=POSITIVE_INT, shape=True)
    kv_channels: int | None = opt(None, "width of a query/key/value head (Hugging Face's head_dim; default hidden / "
                                        "heads; MLA reads its own widths)", check=POSITIVE_INT, shape=True)
    vocab_size: int | None = opt(None, "override the preset (synthetic data; with a tokenizer: at least its size)",
                                 check=(lambda v: v >= 2, "an integer >= 2"), shape=True)
    make_vocab_size_divisible_by: int | None = opt(
        None, "pad the vocabulary to a multiple of this x tp (default 128)", check=POSITIVE_INT, shape=True)
    seq_length: int | None = opt(None, "tokens per sample (default: the preset's positions)", check=POSITIVE_INT)
    max_position_embeddings: int | None = opt(
        None, "positions the model holds (default: the preset's, raised to --seq-length)", check=POSITIVE_INT,
        shape=True)
    init_method_std: float | None = opt(None, "standard deviation of the weights' initialization (default 0.02)",
                                        check=POSITIVE)
    init_method_xavier_uniform: bool = opt(False, "initialize every weight matrix Xavier-uniform, U(+-sqrt(6 / "
                                                  "(fan_in + fan_out))) of the full matrix, not N(0, std)")
    embedding_init_method_std: float | None = opt(None, "the embedding tables' N(0, std) (default: as every weight; "
                                                        "1.0 is arXiv 2312.16903's)", check=POSITIVE)
    hidden_dropout: float = opt(0.0, "dropout on the residual stream (0 is usual for pretraining)", check=PROBABILITY)
    attention_dropout: float = opt(0.0, "dropout on attention probabilities", check=PROBABILITY)
    recompute: str = opt("none", "activation recomputation", choices=_RECOMPUTE,
                         flags=("--recompute", "--recompute-granularity"),
                         sets={"--recompute-activations": "selective"})
    recompute_method: str = opt("uniform", "--recompute full: which layers of a stage (uniform: every "
                                           "--recompute-num-layers; block: the first N)", choices=("uniform", "block"))
    recompute_num_layers: int | None = opt(None, "--recompute full: layers per stage (default all)",
                                           check=POSITIVE_INT)
    attention_backend: str = opt("auto", "sdpa: PyTorch's fused attention (what auto picks); fused: score matmuls "
                                         "+ megalite's fused softmax kernel; torch: explicit softmax matrices; "
                                         "Megatron-LM's flash/unfused/local run as sdpa/torch/fused (its fused as "
                                         "sdpa for a model of Megatron-LM's flags), with a note",
                                 choices=("auto", "sdpa", "fused", "torch", "flash", "unfused", "local"))
    window_size: str | None = opt(None, "sliding-window attention: LEFT,RIGHT keys each query sees before and after "
                                        "itself (-1: no bound; a causal model's RIGHT is 0; LEFT alone: LEFT,0); "
                                        "Hugging Face's sliding_window W is W-1,0", metavar="LEFT,RIGHT", shape=True)
    window_attn_skip_freq: str | None = opt(None, "with --window-size, the layers attending to all instead: every "
                                                  "N-th (an int), or one 1 (window) / 0 (all) per layer: [1,1,1,0]",
                                            shape=True)
    torch_compile: bool = opt(False, "torch.compile the model (fuses bias+GeLU, dropout+residual, norms, the "
                                     "loss): each stage's chunk whole at --tp 1 and --cp 1, else each layer")
    normalization: str | None = opt(None, "the norm of every layer (default: the preset's); Megatron-LM's "
                                          "LayerNorm/RMSNorm spellings too", choices=("layernorm", "rmsnorm"),
                                    shape=True)
    norm_backend: str = opt("auto", "LayerNorm / RMSNorm: megalite's fused kernel where it runs, else PyTorch "
                                    "(auto); fused: the kernel or an error saying why it cannot run; torch: "
                                    "PyTorch ops", choices=("auto", "fused", "torch"))
    position_embedding_type: str | None = opt(
        None, "positions (default: the preset's); Megatron-LM's yarn is rope with YaRN's scaling by "
              "--rotary-scaling-factor", choices=("learned_absolute", "rope", "yarn", "none"),
        sets={"--use-rotary-position-embeddings": "rope"}, shape=True)
    no_position_embedding: bool = opt(False, "no learned absolute position embedding (Megatron-LM's flag): positions "
                                             "none, unless --position-embedding-type rope gives rotary ones",
                                      shape=True)
    # Rope frequencies and the norms' epsilon may be retuned on resume (a longer context): a note says so.
    rotary_base: float | None = opt(None, "rope: the base of the rotation frequencies", check=POSITIVE)
    rotary_percent: float | None = opt(None, "rope: the fraction of each head's dims rotated", check=FRACTION,
                                       shape=True)
    rotary_interleaved: bool = opt(False, "rope: rotate neighbouring dims (0, 1), (2, 3), ... of a head (GPT-J's "
                                          "and Meta's Llama layout), not dim i with i + rotated / 2", shape=True)
    rotary_seq_len_interpolation_factor: float | None = opt(
        None, "rope: linear position interpolation, positions divided by this (Hugging Face's linear rope; "
              "not with YaRN or multi-latent attention)", check=POSITIVE)
    rope_scaling_factor: float | None = opt(None, "rope: Llama 3.1 frequency scaling factor",
                                            check=(lambda v: v >= 1, ">= 1"))
    rope_low_freq_factor: float | None = opt(None, "rope scaling: low-frequency factor", check=POSITIVE)
    rope_high_freq_factor: float | None = opt(None, "rope scaling: high-frequency factor", check=POSITIVE)
    rope_original_max_position_embeddings: int | None = opt(
        None, "rope scaling: the context length the model was first trained at", check=POSITIVE_INT)
    use_rope_scaling: bool = opt(False, "rope: Llama 3.1 frequency scaling (factor 8 unless "
                                        "--rope-scaling-factor)")
    rotary_scaling_factor: float | None = opt(None, "Megatron-LM's rope scaling factor: Llama 3.1's with "
                                                    "--use-rope-scaling, else YaRN's with --rope-type yarn (the "
                                                    "default of --multi-latent-attention)",
                                              check=(lambda v: v >= 1, ">= 1"))
    rope_type: str | None = opt(None, "Megatron-LM's rope kind for --rotary-scaling-factor: rope, or yarn (the "
                                      "default with --multi-latent-attention)", choices=("rope", "yarn"))
    yarn_factor: float | None = opt(None, "rope: YaRN frequency scaling by this factor (DeepSeek-V3: 40; "
                                          "docs/deepseek.md)", check=(lambda v: v >= 1, ">= 1"))
    yarn_original_max_position_embeddings: int | None = opt(
        None, "YaRN: the context length the model was first trained at (default 4096)", check=POSITIVE_INT)
    yarn_beta_fast: float | None = opt(None, "YaRN: frequencies turning more often than this over the original "
                                             "context are kept (default 32)", check=POSITIVE)
    yarn_beta_slow: float | None = opt(None, "YaRN: frequencies turning less often than this are divided by the "
                                             "factor (default 1)", check=POSITIVE)
    yarn_correction_range_round_to_int: bool | None = opt(
        None, "YaRN: the ramp's ends rounded outwards to whole dims (default; DeepSeek's); "
              "--no-yarn-correction-range-round-to-int keeps them fractional (gpt-oss's truncate=False)",
        switch=True, sets={"--no-yarn-correction-range-round-to-int": False})
    yarn_mscale: float | None = opt(None, "YaRN: cos and sin times (1 + 0.1 mscale ln factor) / (1 + 0.1 "
                                          "mscale-all-dim ln factor) (default 1)",
                                    flags=("--yarn-mscale", "--mscale"), check=NON_NEGATIVE)
    yarn_mscale_all_dim: float | None = opt(None, "YaRN, multi-latent attention only: the softmax scale times "
                                                  "(1 + 0.1 this ln factor)^2 (default 0)",
                                            flags=("--yarn-mscale-all-dim", "--mscale-all-dim"), check=NON_NEGATIVE)
    swiglu: bool = opt(False, "gated MLP with silu (ffn size: each of gate and up; default 8h/3 rounded down "
                              "to 64)", shape=True)
    openai_gelu: bool | None = opt(
        None, "GeLU's tanh form in the MLP (Megatron-LM's --openai-gelu); false: the exact (erf) GeLU. Default: "
              "the preset's with --model (GPT-2's tanh, BERT's exact), else Megatron-LM's: the tanh form of its "
              "fused bias-GeLU where the layers have biases, the exact GeLU with --disable-bias-linear or "
              "--no-bias-gelu-fusion", switch=True)
    no_bias_gelu_fusion: bool = opt(False, "Megatron-LM's: no fused bias-GeLU, whose tanh form a model of Megatron-LM's "
                                           "flags otherwise computes: the exact GeLU (see --openai-gelu)")
    group_query_attention: bool = opt(False, "grouped-query attention (with --num-query-groups)", shape=True)
    num_query_groups: int | None = opt(None, "key/value heads (with --group-query-attention)", check=POSITIVE_INT,
                                       shape=True)
    disable_bias_linear: bool = opt(False, "no biases in the layers' linear maps", shape=True)
    add_qkv_bias: bool = opt(False, "query/key/value biases even without other biases", shape=True)
    qk_layernorm: bool = opt(False, "normalize every query and key head", shape=True)
    qk_l2_norm: bool = opt(False, "every query and key head at unit root-mean-square, no weights (Llama 4's)",
                           shape=True)
    no_rope_freq: str | None = opt(None, "layers without rope: every N-th (an int dividing the layers), or one 1 "
                                         "(no rope) / 0 per layer: [0,0,0,1] (Llama 4's)", shape=True)
    softmax_type: str | None = opt(None, "attention sinks: vanilla (none), off-by-one (a zero logit in every "
                                         "softmax), learnable (one logit a head, gpt-oss's)",
                                   choices=("vanilla", "off-by-one", "learnable"), shape=True)
    qk_layernorm_full_width: bool = opt(False, "with --qk-layernorm: one RMSNorm over all query heads and one over "
                                               "all key heads (OLMoE), not one per head", shape=True)
    untie_embeddings_and_output_weights: bool = opt(False, "an output layer of its own instead of the word "
                                                           "embedding", shape=True)
    multi_latent_attention: bool = opt(False, "multi-head latent attention (DeepSeek-V2/V3; docs/deepseek.md)",
                                       shape=True)
    q_lora_rank: int | None = opt(None, "MLA: the queries' latent width (unset: a plain query projection)",
                                  check=POSITIVE_INT, shape=True)
    kv_lora_rank: int | None = opt(None, "MLA: the keys' and values' latent width (default 512)", check=POSITIVE_INT,
                                   shape=True)
    qk_head_dim: int | None = opt(None, "MLA: a query/key head's dims without positions (default 128)",
                                  check=POSITIVE_INT, shape=True)
    qk_pos_emb_head_dim: int | None = opt(None, "MLA: a query/key head's rotary dims, one rotary key shared by the "
                                                "heads (default 64)", check=POSITIVE_INT, shape=True)
    v_head_dim: int | None = opt(None, "MLA: a value head's dims (default 128)", check=POSITIVE_INT, shape=True)
    mtp_num_layers: int | None = opt(None, "multi-token prediction: this many sequential modules predicting one "
                                           "more token each (DeepSeek-V3; docs/deepseek.md)",
                                     check=NON_NEGATIVE, shape=True)
    mtp_loss_scaling_factor: float | None = opt(None, "multi-token prediction: the depths' mean loss times this "
                                                      "joins the training loss (default 0.1)", check=NON_NEGATIVE)
    apply_layernorm_1p: bool = opt(False, "norm weights stored zero-centred, applied as 1 + w", shape=True)
    fp32_residual_connection: bool = opt(False, "the residual stream between layers and pipeline stages in fp32 "
                                                "beside --bf16/--fp16 weights (Megatron-LM's flag)")
    squared_relu: bool = opt(False, "MLP activation relu(x)^2 (Nemotron's; not with --swiglu)", shape=True)
    quick_geglu: bool = opt(False, "gated MLP with quick GeLU, x sigmoid(1.702 x) (gpt-oss's; not with --swiglu)",
                            shape=True)
    glu_linear_offset: float | None = opt(None, "a gated MLP's act(gate) * (up + C) (gpt-oss's 1; default 0)",
                                          shape=True)
    activation_func_clamp_value: float | None = opt(None, "a gated MLP's gate clamped to at most V and its up to "
                                                          "[-V, V] before the product (gpt-oss's 7)", shape=True)
    bert_no_binary_head: bool = opt(False, "BERT: no sentence-order head and no token types; each sample one "
                                           "segment, the masked-LM loss alone (pretrain_bert.py)", shape=True)
    norm_epsilon: float | None = opt(None, "epsilon of every LayerNorm / RMSNorm",
                                     flags=("--norm-epsilon", "--layernorm-epsilon"), check=POSITIVE)

    def check(self) -> None:
        check_numbers(self)
        if self.recompute_num_layers is not None and self.recompute != "full":
            raise ValueError(f"--recompute-num-layers {self.recompute_num_layers} applies to --recompute full only "
                             f"(got --recompute {self.recompute})")
        chosen = [f for f, on in (("--squared-relu", self.squared_relu), ("--swiglu", self.swiglu),
                                  ("--quick-geglu", self.quick_geglu)) if on]
        if len(chosen) > 1:
            raise ValueError(f"{' and '.join(chosen)} each choose the MLP's activation: keep one")
        if (self.num_query_groups is not None) != self.group_query_attention:
            raise ValueError("--group-query-attention and --num-query-groups G go together: give both, or neither")


@dataclass
class MoEConfig:
    """Mixture of experts (Megatron-LM's flags; docs/moe.md). Without --num-experts every MLP is dense."""
    num_experts: int | None = opt(None, "experts per MoE layer", flags=("--num-experts",), check=POSITIVE_INT,
                                  shape=True)
    moe_router_topk: int = opt(2, "experts per token", check=POSITIVE_INT, shape=True)
    moe_ffn_hidden_size: int | None = opt(None, "one expert's MLP width (default --ffn-hidden-size)",
                                          check=POSITIVE_INT, shape=True)
    moe_layer_freq: str = opt("1", "which layers are MoE: every k-th (an int), or one 0/1 per layer: [0,1,1,1] "
                                   "or ([0]*1+[1]*3)", shape=True)
    moe_router_score_function: str = opt("softmax", "router scores", choices=("softmax", "sigmoid"), shape=True)
    moe_router_pre_softmax: bool = opt(False, "softmax over all experts before top-k (weights not renormalised)",
                                       shape=True)
    moe_router_topk_scaling_factor: float | None = opt(None, "multiply the top-k weights by this", check=POSITIVE,
                                                       shape=True)
    moe_router_num_groups: int | None = opt(None, "group-limited routing: experts in this many groups",
                                            check=POSITIVE_INT, shape=True)
    moe_router_group_topk: int | None = opt(None, "group-limited routing: groups a token may use",
                                            check=POSITIVE_INT, shape=True)
    moe_router_load_balancing_type: str = opt("aux_loss", "load-balancing loss",
                                              choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "none"))
    moe_aux_loss_coeff: float = opt(0.0, "load-balancing loss coefficient", check=NON_NEGATIVE)
    moe_z_loss_coeff: float | None = opt(None, "router z-loss coefficient", check=NON_NEGATIVE)
    moe_router_enable_expert_bias: bool = opt(False, "aux-loss-free balancing: a per-expert bias on selection only "
                                                     "(sigmoid scores)", shape=True)
    moe_router_bias_update_rate: float = opt(1e-3, "the expert bias's step per optimizer step", check=NON_NEGATIVE)
    moe_router_force_load_balancing: bool = opt(False, "benchmarking: route by standard-normal logits hashed from "
                                                       "each token (even loads in expectation), the gradient "
                                                       "straight through to the router's")
    moe_token_dispatcher_type: str = opt("alltoall", "how tokens reach the experts' ranks (Megatron-LM's flex, "
                                                     "DeepEP's fused all-to-all: the all-to-all, with a note)",
                                         choices=("alltoall", "allgather", "flex"))
    moe_expert_capacity_factor: float | None = opt(None, "tokens an expert takes: this x its even share (default: "
                                                         "dropless)", check=POSITIVE)
    moe_token_drop_policy: str = opt("probs", "over capacity, drop the lowest-weight tokens or the last ones",
                                     choices=("probs", "position"))
    moe_pad_expert_input_to_capacity: bool = opt(False, "pad every expert's input to its capacity (static shapes)")
    moe_input_jitter_eps: float | None = opt(None, "training: the router's input times noise U(1 - eps, 1 + eps) "
                                                   "(Switch Transformer's jitter; Mixtral's router_jitter_noise)",
                                             check=(lambda v: 0 <= v < 1, "in [0, 1)"))
    moe_apply_probs_on_input: bool = opt(False, "top-1 routing: the expert reads its token times the routing weight "
                                                "and its output joins unweighted (Llama 4's)", shape=True)
    moe_shared_expert_intermediate_size: int | None = opt(None, "a dense MLP of this width every token also takes",
                                                          check=POSITIVE_INT, shape=True)
    moe_shared_expert_gate: bool = opt(False, "the shared expert's output times sigmoid(x . w)", shape=True)
    moe_use_upcycling: bool = opt(False, "start the experts from --load's dense checkpoint (upcycling), save them to "
                                         "--save before training and train on (docs/moe.md)")
    moe_upcycling_granularity: int = opt(1, "upcycling: the dense MLP's width over one expert's (its features cut "
                                            "into this many experts)", check=POSITIVE_INT)

    def check(self) -> None:
        check_numbers(self)
