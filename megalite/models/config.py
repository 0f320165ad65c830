"""TransformerConfig: the shape and regularization of a transformer (its named presets:
megalite.models.presets)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megalite.models.layer_pattern import layer_pattern
from megalite.models.qk_variants import normalized_qk_variants
from megalite.models.softmax_sink import SOFTMAX_TYPES
from megalite.models.window import layer_window, normalized_window


TP_COMM_OVERLAP_NEEDS = ("--tp-comm-overlap overlaps sequence parallelism's all-gathers and reduce-scatters with "
                         "the GEMMs: it needs --tp 2 or more and --sequence-parallel")
TP_COMM_SPLITS_NEEDS = ("--tp-comm-overlap-splits cuts each sequence shard's GEMMs and transfers into pieces: it "
                        "needs --tp 2 or more and --sequence-parallel, and a value >= 1")


@dataclass
class TransformerConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int = 50257
    max_position_embeddings: int = 1024
    ffn_hidden_size: int | None = None  # default 4 * hidden_size
    # A head's width (Megatron-LM's --kv-channels, Hugging Face's head_dim); None: hidden / heads.
    # Qwen3's heads are 128 wide at hidden 2048 with 32 heads, 2x wider than hidden / heads.
    kv_channels: int | None = None
    # No dropout by default, as usual for pretraining and as the CLI's --hidden-dropout and
    # --attention-dropout; fine-tuning (and BERT as published, 0.1) passes it explicitly.
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    layernorm_epsilon: float = 1e-5
    # Norm weights stored zero-centred, applied as 1 + w (Megatron-LM's --apply-layernorm-1p): the same
    # function at initialization, the weights small numbers whatever their precision.
    layernorm_zero_centered_gamma: bool = False
    init_method_std: float = 0.02
    # Megatron-LM's --init-method-xavier-uniform: every weight matrix U(-a, a), a = sqrt(6 / (fan_in + fan_out)).
    init_method_xavier_uniform: bool = False
    embedding_init_method_std: float | None = None  # the embedding tables' N(0, std) (None: as every weight)
    make_vocab_size_divisible_by: int = 128  # padded to a multiple of this times TP
    sequence_parallel: bool = False
    # Sequence parallelism's all-gathers and reduce-scatters pipelined with the linear layers' GEMMs
    # (megalite.parallel.tp_overlap): when communication runs, not the numbers.
    tp_comm_overlap: bool = False
    # Each sequence shard's GEMMs in this many row pieces, overlapped or not (the same numbers either
    # way); overlapped, each piece travels on as soon as it is there, so a shard's GEMM runs beside
    # its own transfer's tail.
    tp_comm_overlap_splits: int = 1
    # Context parallelism (the size is the process groups'): p2p rings keys and values, a2a exchanges
    # heads for the sequence, a2a+p2p both (megalite.parallel.context_parallel, _a2a, _hierarchy).
    cp_comm_type: str = "p2p"
    cp_a2a_size: int = 1  # a2a+p2p: the all-to-all's ranks (megalite.parallel.context_parallel_hierarchy)
    recompute: str = "none"  # none | selective | full
    recompute_num_layers: int | None = None  # full: how many layers per stage (default all)
    recompute_method: str = "uniform"  # full: uniform | block
    # sdpa: PyTorch's fused attention (flash where available); fused: score matmuls + megalite's
    # fused softmax kernel; torch: explicit matmuls and softmax (the layout the memory formula counts)
    attention_backend: str = "sdpa"
    norm_backend: str = "auto"  # auto | fused: megalite.ops (kernel where it runs) | torch: F.layer_norm
    # Architecture switches; the defaults are GPT-2's, BERT as published is post / gelu / not causal.
    layernorm_position: str = "pre"  # pre: x + f(LN(x)) | post: LN(x + f(x))
    normalization: str = "layernorm"  # layernorm (weight and bias) | rmsnorm (weight only)
    # MLP: gelu_tanh (tanh approximation) | gelu (exact, erf) | silu | squared_relu | quick_gelu (x sigmoid(1.702 x))
    activation: str = "gelu_tanh"
    causal: bool = True  # attention: to earlier positions only, or bidirectional
    # Sliding-window attention (megalite.models.window): Megatron-LM's --window-size (left, right; -1 unbounded)
    # in every layer, or in those --window-attn-skip-freq marks (kept as one 0/1 per layer; None: all).
    window_size: tuple | None = None
    window_attn_skip_freq: int | list | None = None
    # Llama 4's (megalite.models.qk_variants): queries and keys at unit RMS per head; layers without rope (0/1 each)
    qk_l2_norm: bool = False
    no_rope_freq: int | list | None = None
    # Attention sinks (megalite.models.softmax_sink): vanilla | off-by-one (a zero logit) | learnable (one a head)
    softmax_type: str = "vanilla"
    # BERT: the pooler and sentence-order head, and two token types (Megatron-LM's --bert-no-binary-head
    # turns all three off: one segment a sample, masked-LM loss alone).
    add_binary_head: bool = True
    # Megatron-LM's --fp32-residual-connection: the stream between the layers (and pipeline stages) in fp32
    # beside bf16/fp16 weights; each norm reads it in fp32 and gives its output in the weights' dtype.
    fp32_residual_connection: bool = False
    params_dtype: torch.dtype = torch.float32
    # Llama-family switches (Megatron-Core's names); the defaults leave GPT-2 and BERT as they were.
    position_embedding_type: str = "learned_absolute"  # learned_absolute | rope | none
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0  # rope rotates the first int(head_dim * rotary_percent) dims of a head
    # Megatron-LM's --rotary-interleaved: rope rotates pairs of neighbouring dims (0, 1), (2, 3), ... (GPT-J's
    # and Meta's original Llama layout) instead of dim i with dim i + rotated / 2 (Hugging Face's).
    rotary_interleaved: bool = False
    # Megatron-LM's --rotary-seq-len-interpolation-factor (linear position interpolation, arXiv 2306.15595;
    # Hugging Face's "linear" rope): positions times 1 / factor before they meet the frequencies.
    rotary_seq_len_interpolation_factor: float | None = None
    # Llama 3.1 frequency scaling (None: off): wavelengths above original / low_freq_factor are
    # divided by the factor, those below original / high_freq_factor kept, a smooth blend between.
    rope_scaling_factor: float | None = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    # YaRN (arXiv 2309.00071, as DeepSeek-V3 uses it; None: off): frequencies turning fewer than
    # beta_slow times over the original context are divided by the factor, more than beta_fast times
    # kept, a linear blend between; cos/sin times m(mscale) / m(mscale_all_dim), and MLA's softmax
    # scale times m(mscale_all_dim)^2, where m(k) = 1 + 0.1 k ln(factor).
    yarn_factor: float | None = None
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True  # the ramp's ends floor / ceil'd (Hugging Face's truncate)
    gated_linear_unit: bool = False  # MLP: fc2(act(gate) * up), gate and up each ffn_hidden_size wide
    # a gated MLP's act(min(gate, v)) * (clamp(up, -v, v) + offset) (Megatron-LM's flags; gpt-oss's v 7, offset 1)
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    num_query_groups: int | None = None  # grouped-query attention (None: one key/value head per query head)
    add_bias_linear: bool = True  # biases of every linear layer in the transformer layers
    add_qkv_bias: bool = False  # query/key/value biases even without add_bias_linear (Qwen2)
    qk_layernorm: bool = False  # a norm over head_dim on every query and key head, before rope
    # OLMoE: q_norm and k_norm span the whole projection (all heads, or all key groups) at once, not
    # one head; rmsnorm only. Under TP the statistics are summed over the ranks' heads.
    qk_layernorm_full_width: bool = False
    untie_embeddings_and_output_weights: bool = False  # an output layer of its own on the last stage
    # Multi-head latent attention (DeepSeek-V2/V3; megalite.models.mla), Megatron-Core's names.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # the queries' latent width (None: one plain query projection)
    kv_lora_rank: int = 512  # the keys' and values' latent width
    qk_head_dim: int = 128  # a query/key head's dims without positions
    qk_pos_emb_head_dim: int = 64  # its rotary dims (one rotary key per token, shared by the heads)
    v_head_dim: int = 128
    # Mixture of experts (Megatron-Core's names; megalite.models.moe). None: every MLP is dense.
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None  # one expert's width (default ffn_hidden_size)
    moe_layer_freq: int | list = 1  # every k-th layer is MoE, or a 0/1 per layer ([0, 1, 1, 1])
    moe_router_score_function: str = "softmax"  # softmax | sigmoid
    moe_router_pre_softmax: bool = False  # softmax over all experts, then top-k (weights not renormalised)
    moe_router_topk_scaling_factor: float | None = None  # the top-k weights times this
    moe_router_num_groups: int | None = None  # group-limited routing: experts in this many groups,
    moe_router_group_topk: int | None = None  # of which each token may use this many
    moe_router_load_balancing_type: str = "aux_loss"  # aux_loss | seq_aux_loss | global_aux_loss | none
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing: a bias on selection only
    moe_router_force_load_balancing: bool = False  # benchmarking: logits hashed from each token (moe/balanced.py)
    moe_router_bias_update_rate: float = 1e-3
    moe_token_dispatcher_type: str = "alltoall"  # alltoall | allgather
    moe_expert_capacity_factor: float | None = None  # None: dropless
    moe_token_drop_policy: str = "probs"  # probs | position: which tokens over capacity are dropped
    moe_pad_expert_input_to_capacity: bool = False
    moe_apply_probs_on_input: bool = False  # top-1: the weight scales the expert's input, not its output (Llama 4)
    moe_input_jitter_eps: float | None = None  # training: the router's input times U(1 - eps, 1 + eps)
    moe_shared_expert_intermediate_size: int | None = None  # a dense MLP every token also takes
    moe_shared_expert_gate: bool = False  # the shared expert's output times sigmoid(x . w)
    # The all-to-all dispatcher's exchanges a group of local experts at a time, pipelined with the
    # groups' GEMMs (megalite.models.moe.chunked): when communication runs, not the numbers.
    moe_dispatch_chunks: int = 1
    # Multi-token prediction (DeepSeek-V3; megalite.models.mtp): this many sequential modules on the
    # last stage, their losses weighted by mtp_loss_scaling_factor / mtp_num_layers.
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_channels is not None and self.kv_channels < 1:
            raise ValueError(f"kv_channels must be >= 1, got {self.kv_channels}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}): set kv_channels (--kv-channels) to the heads' width"
            )
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be none, selective or full, got {self.recompute!r}")
        if self.attention_backend not in ("sdpa", "fused", "torch"):
            raise ValueError(f"attention_backend must be sdpa, fused or torch, got {self.attention_backend!r}")
        if self.normalization not in ("layernorm", "rmsnorm"):
            raise ValueError(f"normalization must be layernorm or rmsnorm, got {self.normalization!r}")
        if self.norm_backend not in ("auto", "fused", "torch"):
            raise ValueError(f"norm_backend must be auto, fused or torch, got {self.norm_backend!r}")
        if self.recompute_method not in ("uniform", "block"):
            raise ValueError(f"recompute_method must be uniform or block, got {self.recompute_method!r}")
        if self.layernorm_position not in ("pre", "post"):
            raise ValueError(f"layernorm_position must be pre or post, got {self.layernorm_position!r}")
        if self.activation not in ("gelu_tanh", "gelu", "silu", "squared_relu", "quick_gelu"):
            raise ValueError(f"activation must be gelu_tanh, gelu, silu, squared_relu or quick_gelu, got "
                             f"{self.activation!r}")
        if (self.glu_linear_offset or self.activation_func_clamp_value is not None) and not self.gated_linear_unit:
            raise ValueError("--glu-linear-offset and --activation-func-clamp-value shape a gated MLP's halves: add "
                             "--swiglu or --quick-geglu, or drop them")
        if self.activation_func_clamp_value is not None and not self.activation_func_clamp_value > 0:
            raise ValueError(f"--activation-func-clamp-value must be > 0, got {self.activation_func_clamp_value}")
        if self.fp32_residual_connection and (self.layernorm_position == "post" or self.mtp_num_layers):
            raise ValueError("--fp32-residual-connection keeps a pre-norm model's stream in fp32: post-norm layers "
                             "(the bert-* presets) and multi-token prediction are not offered with it: drop it")
        if self.embedding_init_method_std is not None and not self.embedding_init_method_std > 0:
            raise ValueError(f"--embedding-init-method-std must be > 0, got {self.embedding_init_method_std}")
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal must be True or False, got {self.causal!r}")
        if self.mtp_num_layers < 0 or self.mtp_loss_scaling_factor < 0:
            raise ValueError(f"--mtp-num-layers ({self.mtp_num_layers}) and --mtp-loss-scaling-factor "
                             f"({self.mtp_loss_scaling_factor}) must be >= 0")
        if self.multi_latent_attention:  # first: rope's checks read its rotary dims
            self._check_mla_fields()
        self._check_llama_fields()
        if self.num_moe_experts is not None:
            self._check_moe_fields()
        if self.window_size is not None or self.window_attn_skip_freq is not None:
            self.window_size, self.window_attn_skip_freq = normalized_window(self)
        if self.softmax_type not in SOFTMAX_TYPES:
            raise ValueError(f"--softmax-type must be one of {', '.join(SOFTMAX_TYPES)}, got {self.softmax_type!r}")
        if self.softmax_type == "learnable" and self.init_method_xavier_uniform:  # Megatron-Core's init fails too
            raise ValueError("--softmax-type learnable draws its sinks from N(0, init_method_std), which "
                             "--init-method-xavier-uniform has no form for (a 1-D tensor): drop one")
        if self.qk_l2_norm or self.no_rope_freq is not None:
            self.qk_layernorm, self.no_rope_freq = normalized_qk_variants(self)
            self.qk_layernorm_full_width = self.qk_layernorm_full_width and self.qk_layernorm

    def _check_moe_fields(self) -> None:
        experts, topk = self.num_moe_experts, self.moe_router_topk
        if experts < 1:
            raise ValueError(f"num_moe_experts must be >= 1, got {experts}")
        if not 1 <= topk <= experts:
            raise ValueError(f"--moe-router-topk ({topk}) must be between 1 and the number of experts ({experts})")
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        choices = {"moe_router_score_function": ("softmax", "sigmoid"),
                   "moe_router_load_balancing_type": ("aux_loss", "seq_aux_loss", "global_aux_loss", "none"),
                   "moe_token_dispatcher_type": ("alltoall", "allgather"),
                   "moe_token_drop_policy": ("probs", "position")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.moe_router_pre_softmax and self.moe_router_score_function != "softmax":
            raise ValueError("--moe-router-pre-softmax applies to the softmax score function only")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if (groups is None) != (group_topk is None):
            raise ValueError("group-limited routing needs both --moe-router-num-groups and --moe-router-group-topk")
        if groups is not None:
            if groups < 1 or experts % groups:
                raise ValueError(f"--moe-router-num-groups ({groups}) must divide the number of experts ({experts})")
            if not 1 <= group_topk <= groups:
                raise ValueError(f"--moe-router-group-topk ({group_topk}) must be between 1 and "
                                 f"--moe-router-num-groups ({groups})")
            if group_topk * (experts // groups) < topk:
                raise ValueError(f"--moe-router-group-topk {group_topk} groups of {experts // groups} experts cannot "
                                 f"hold --moe-router-topk {topk} experts: raise the group top-k")
            if topk % group_topk:
                raise ValueError(f"--moe-router-topk ({topk}) must be a multiple of --moe-router-group-topk "
                                 f"({group_topk}): each chosen group's score is the sum of its top "
                                 f"topk / group_topk experts")
        if self.moe_expert_capacity_factor is not None and self.moe_expert_capacity_factor <= 0:
            raise ValueError(f"--moe-expert-capacity-factor must be > 0, got {self.moe_expert_capacity_factor}")
        if self.moe_apply_probs_on_input and topk != 1:  # as Megatron-Core asserts
            raise ValueError(f"--moe-apply-probs-on-input scales each token's one expert input: it needs "
                             f"--moe-router-topk 1, not {topk}")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ValueError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
        self.moe_layer_freq = moe_layer_pattern(self.moe_layer_freq, self.num_layers)

    def tp_comm_options(self) -> dict:
        """The parallel linear layers' arguments for sequence parallelism's communication."""
        return {"tp_comm_overlap": self.tp_comm_overlap, "tp_comm_overlap_splits": self.tp_comm_overlap_splits}

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts is not None

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether layer `layer_number` (0-based, of the whole model) has experts for its MLP. The layers
        of multi-token prediction (numbered on from num_layers) are MoE when the last layer is."""
        return self.is_moe and bool(self.moe_layer_freq[min(layer_number, self.num_layers - 1)])

    def uses_rope(self, layer_number: int) -> bool:
        """Whether layer `layer_number` (0-based) rotates its queries and keys."""
        skips = self.no_rope_freq
        return self.position_embedding_type == "rope" and not (skips is not None and skips[layer_number])

    def window_of(self, layer_number: int):
        """Layer `layer_number`'s (0-based) sliding window (left, right), or None: it attends to all it may."""
        return layer_window(self, layer_number)

    def _check_llama_fields(self) -> None:
        if self.position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ValueError(f"position_embedding_type must be learned_absolute, rope or none, "
                             f"got {self.position_embedding_type!r}")
        groups = self.num_query_groups
        if groups is not None and (groups < 1 or self.num_attention_heads % groups):
            raise ValueError(f"num_query_groups ({groups}) must divide num_attention_heads "
                             f"({self.num_attention_heads})")
        if self.position_embedding_type == "rope":
            self._check_rope()
        elif self.rotary_interleaved:
            raise ValueError(f"--rotary-interleaved lays out rope's pairs, and position_embedding_type is "
                             f"{self.position_embedding_type!r}: add --position-embedding-type rope, or drop it")
        if self.qk_layernorm_full_width and not (self.qk_layernorm and self.normalization == "rmsnorm"):
            raise ValueError("qk_layernorm_full_width needs qk_layernorm=True and normalization='rmsnorm' (it widens "
                             "the RMSNorm of queries and keys to all heads): set both, or drop it")

    def _check_mla_fields(self) -> None:
        if self.position_embedding_type != "rope":
            raise ValueError("--multi-latent-attention rotates a decoupled key: it needs --position-embedding-type rope")
        if self.qk_pos_emb_head_dim < 2 or self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"--qk-pos-emb-head-dim must be even and >= 2 (rope rotates pairs of dims), got "
                             f"{self.qk_pos_emb_head_dim}")
        for name in ("kv_lora_rank", "qk_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"--q-lora-rank must be >= 1 (or unset: a plain query projection), got {self.q_lora_rank}")
        if self.num_query_groups is not None or self.qk_layernorm:
            raise ValueError("--multi-latent-attention has its own keys and norms: drop --num-query-groups / "
                             "--qk-layernorm")
        if self.rotary_interleaved:  # as Megatron-Core refuses it
            raise ValueError("--rotary-interleaved does not apply to --multi-latent-attention: drop it")

    def _check_rope(self) -> None:
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
        if self.rotary_dims < 2 or self.rotary_dims % 2:
            raise ValueError(f"rope needs an even number (>= 2) of rotated dims per head, got {self.rotary_dims} "
                             f"(head_dim {self.head_dim} x rotary_percent {self.rotary_percent})")
        if self.rotary_base <= 0:
            raise ValueError(f"rotary_base must be > 0, got {self.rotary_base}")
        if self.rope_scaling_factor is not None:
            if self.rope_scaling_factor < 1.0:
                raise ValueError(f"rope_scaling_factor must be >= 1, got {self.rope_scaling_factor}")
            if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
                raise ValueError(f"rope_low_freq_factor ({self.rope_low_freq_factor}) must be > 0 and below "
                                 f"rope_high_freq_factor ({self.rope_high_freq_factor})")
            if self.rope_original_max_position_embeddings < 1:
                raise ValueError(f"rope_original_max_position_embeddings must be >= 1, "
                                 f"got {self.rope_original_max_position_embeddings}")
        if self.yarn_factor is not None:
            self._check_yarn()
        factor = self.rotary_seq_len_interpolation_factor
        if factor is not None and factor <= 0:
            raise ValueError(f"--rotary-seq-len-interpolation-factor must be > 0, got {factor}")
        if factor is not None and (self.yarn_factor is not None or self.multi_latent_attention):
            # Megatron-Core's YaRN and MLA rotary embeddings never read it: a run there ignores it
            raise ValueError("--rotary-seq-len-interpolation-factor scales plain rope's positions; YaRN and "
                             "--multi-latent-attention do not use it (Megatron-LM ignores it there): drop it")

    def _check_yarn(self) -> None:
        if self.rope_scaling_factor is not None:
            raise ValueError("rope scaling is either Llama 3.1's (--rope-scaling-factor) or YaRN's (--yarn-factor): "
                             "drop one")
        if self.yarn_factor < 1.0:
            raise ValueError(f"--yarn-factor must be >= 1, got {self.yarn_factor}")
        if self.yarn_original_max_position_embeddings < 1:
            raise ValueError(f"--yarn-original-max-position-embeddings must be >= 1, "
                             f"got {self.yarn_original_max_position_embeddings}")
        if not 0 < self.yarn_beta_slow <= self.yarn_beta_fast:
            raise ValueError(f"--yarn-beta-slow ({self.yarn_beta_slow}) must be > 0 and at most --yarn-beta-fast "
                             f"({self.yarn_beta_fast}): they count rotations over the original context")
        if self.yarn_mscale < 0 or self.yarn_mscale_all_dim < 0:
            raise ValueError(f"--yarn-mscale ({self.yarn_mscale}) and --yarn-mscale-all-dim "
                             f"({self.yarn_mscale_all_dim}) must be >= 0")

    @property
    def head_dim(self) -> int:
        """A query/key/value head's width: kv_channels, or hidden / heads."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads: num_query_groups, or one per query head (multi-head attention)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def rotary_dims(self) -> int:
        """How many leading dims of each query and key head rope rotates (MLA: its rotary part)."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.head_dim * self.rotary_percent)

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise ValueError naming both numbers when the model cannot be split over `tp` ranks."""
        for what, n in (
            ("num_attention_heads", self.num_attention_heads),
            ("ffn_hidden_size", self.ffn_hidden_size),
        ):
            if n % tp:
                raise ValueError(
                    f"{what} ({n}) is not divisible by the tensor-parallel size ({tp}): "
                    f"choose --tp among the divisors of {n}"
                )
        self._check_query_groups(tp)
        if self.sequence_parallel and tp == 1:
            raise ValueError("sequence parallelism needs a tensor-parallel size > 1 (got --tp 1)")
        if self.tp_comm_overlap and (tp == 1 or not self.sequence_parallel):
            raise ValueError(TP_COMM_OVERLAP_NEEDS)
        splits = self.tp_comm_overlap_splits
        if splits < 1 or (splits > 1 and (tp == 1 or not self.sequence_parallel)):
            raise ValueError(TP_COMM_SPLITS_NEEDS)

    def _check_query_groups(self, tp: int) -> None:
        """GQA: each rank holds whole key/value groups (G % tp == 0), or its query heads share one group
        whose weights it gathers (tp % G == 0, the kv rows still splitting evenly over the ranks)."""
        if self.num_query_groups is None:
            return
        groups, kv_rows = self.num_query_groups, 2 * self.num_query_groups * self.head_dim
        if groups % tp and tp % groups:
            raise ValueError(f"num_query_groups ({groups}) and the tensor-parallel size ({tp}) must divide one "
                             f"another: choose --tp among the divisors or multiples of {groups}")
        if kv_rows % tp:
            raise ValueError(f"the key/value rows (2 x {groups} groups x head_dim {self.head_dim} = {kv_rows}) "
                             f"are not divisible by the tensor-parallel size ({tp})")

    def replace(self, **changes) -> "TransformerConfig":
        return dataclasses.replace(self, **changes)


def moe_layer_pattern(freq, num_layers: int) -> list[int]:
    """--moe-layer-freq as a 0/1 per layer: an int k (every k-th layer, the first included: 1 is all),
    a list, or Megatron-LM's Python spelling of one ("([0]*1+[1]*3)")."""
    def every(k: int, layers: int) -> list[int]:
        if k < 1:
            raise ValueError(f"--moe-layer-freq must be >= 1, got {k}")
        return [int(i % k == 0) for i in range(layers)]
    return layer_pattern(freq, num_layers, "--moe-layer-freq", every, "0 (dense) or 1 (MoE)")
