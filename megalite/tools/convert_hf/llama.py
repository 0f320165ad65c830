"""The Llama family (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM) <->
megalite's GPTModel with RoPE, grouped-query attention, a SwiGLU MLP and RMSNorm.

Hugging Face's q_proj and k_proj use the "rotate half" RoPE convention, as megalite does, so q is
copied unchanged; k and v are interleaved per query group into `attention.kv`; gate and up are
stacked into `mlp.fc1` as [gate; up] (see common). The four architectures differ only in biases, qk norms and
sliding windows; the table is the same.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Mapping

import torch

from megalite.models.config import TransformerConfig
from megalite.parallel.layers import pad_vocab_size
from megalite.tools.convert_hf.common import (Row, export_tensors, import_tensors, load_into,
                                              pairs, refuse, table_problems, transformers)
from megalite.tools.convert_hf.yarn_rope import hf_yarn_parameters, yarn_fields

LLAMA, MISTRAL, QWEN2, QWEN3 = "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"
ARCHITECTURES = (LLAMA, MISTRAL, QWEN2, QWEN3)
MODEL_TYPES = {"llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2, "qwen3": QWEN3}
ROPE_TYPES = ("default", "llama3", "linear", "yarn")


@dataclass(frozen=True)
class Shape:
    """What decides the table's rows."""
    num_layers: int
    grouped: bool  # separate attention.q and attention.kv (num_query_groups set), else fused qkv
    qkv_bias: bool
    linear_bias: bool
    qk_norm: bool
    untied: bool


def shape_of(c) -> Shape:
    """The Shape of a TransformerConfig (or anything with its field names)."""
    return Shape(c.num_layers, getattr(c, "num_query_groups", None) is not None,
                 getattr(c, "add_qkv_bias", False), getattr(c, "add_bias_linear", True),
                 getattr(c, "qk_layernorm", False), getattr(c, "untie_embeddings_and_output_weights", False))


FINAL_NORM_ROW: Row = ("final_layernorm.weight", "model.norm.weight", "same")


def table(s: Shape) -> list[Row]:
    """Rows in the order of GPTModel.state_dict(); HF names are the *ForCausalLM model's."""
    rows = embedding_rows(s)
    for i in range(s.num_layers):
        rows += attention_rows(s, i) + dense_mlp_rows(s, f"layers.{i}.mlp.", f"model.layers.{i}.mlp.")
    return rows + [FINAL_NORM_ROW]


def _params(s: Shape) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The parameters of (q, k, v) and of the other linear layers."""
    linear_params = ("weight", "bias") if s.linear_bias else ("weight",)
    return ("weight", "bias") if s.qkv_bias or s.linear_bias else ("weight",), linear_params


def embedding_rows(s: Shape) -> list[Row]:
    rows = [("word_embeddings.weight", "model.embed_tokens.weight", "vocab")]
    if s.untied:
        rows.append(("output_layer.weight", "lm_head.weight", "vocab"))
    return rows


def attention_rows(s: Shape, i: int) -> list[Row]:
    """Layer i's input norm, attention and post-attention norm."""
    attention_params, linear_params = _params(s)
    ours, theirs = f"layers.{i}.", f"model.layers.{i}."
    attn = f"{theirs}self_attn."
    rows = [(f"{ours}input_layernorm.weight", f"{theirs}input_layernorm.weight", "same")]
    if s.grouped:
        rows += [(f"{ours}attention.q.{p}", f"{attn}q_proj.{p}", "same") for p in attention_params]
        rows += [(f"{ours}attention.kv.{p}", (f"{attn}k_proj.{p}", f"{attn}v_proj.{p}"), "kv")
                 for p in attention_params]
    else:
        rows += [(f"{ours}attention.qkv.{p}", tuple(f"{attn}{n}_proj.{p}" for n in "qkv"), "qkv")
                 for p in attention_params]
    if s.qk_norm:
        rows += pairs([(f"{ours}attention.q_norm", f"{attn}q_norm"),
                       (f"{ours}attention.k_norm", f"{attn}k_norm")], ("weight",))
    rows += pairs([(f"{ours}attention.proj", f"{attn}o_proj")], linear_params)
    rows.append((f"{ours}post_attention_layernorm.weight", f"{theirs}post_attention_layernorm.weight", "same"))
    return rows


def dense_mlp_rows(s: Shape, ours: str, theirs: str) -> list[Row]:
    """A SwiGLU MLP (megalite module `ours`, Hugging Face module `theirs`, both ending in '.'): gate
    and up stacked into fc1, down_proj as fc2."""
    linear_params = _params(s)[1]
    rows = [(f"{ours}fc1.{p}", (f"{theirs}gate_proj.{p}", f"{theirs}up_proj.{p}"), "glu") for p in linear_params]
    return rows + pairs([(f"{ours}fc2", f"{theirs}down_proj")], linear_params)


def groups_of(c) -> dict[str, int]:
    """The interleaved sets of each `how` (common.import_tensors' `groups`)."""
    query_groups = getattr(c, "num_query_groups", None) or c.num_attention_heads
    return {"qkv": c.num_attention_heads, "kv": query_groups, "glu": 1}


def tensors_from_hf(theirs: Mapping[str, torch.Tensor], c, padded_vocab: int) -> dict[str, torch.Tensor]:
    """megalite's tp = 1 tensors from a *ForCausalLM state dict; `c`: the config (or its fields)."""
    return import_tensors(theirs, table(shape_of(c)), groups_of(c), padded_vocab)


def tensors_to_hf(ours: Mapping[str, torch.Tensor], c) -> dict[str, torch.Tensor]:
    """The inverse of tensors_from_hf (tied models get no lm_head.weight: it is embed_tokens)."""
    return export_tensors(ours, table(shape_of(c)), groups_of(c), c.vocab_size)


# ---------------------------------------------------------------------------------------------
# Import

def owns_model(model) -> bool:
    return type(model).__name__ in ARCHITECTURES


def hf_class(cfg):
    archs = list(getattr(cfg, "architectures", None) or [])
    return getattr(transformers(), archs[0] if archs else MODEL_TYPES[cfg.model_type])


def rope_parameters(cfg) -> dict:
    """Hugging Face's RoPE settings: transformers >= 5 `rope_parameters`, earlier `rope_theta` and
    `rope_scaling`; always with rope_type and rope_theta."""
    params = getattr(cfg, "rope_parameters", None)
    if params is None:
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def sliding_window(cfg, arch: str) -> tuple[int | None, list[int] | None]:
    """(Hugging Face's sliding_window W of the layers that use one, None: every layer attends to all;
    one 1 (windowed) / 0 per layer, None: all windowed)."""
    window = getattr(cfg, "sliding_window", None)
    if not window:  # None, or Qwen2-MoE's 0 for "off"
        return None, None
    if arch == MISTRAL:
        return window, None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        pattern = [int(kind == "sliding_attention") for kind in layer_types]
        return (window, None if all(pattern) else pattern) if any(pattern) else (None, None)
    # A config with no switch (Mixtral) windows every layer whenever it has a window.
    return (window, None) if getattr(cfg, "use_sliding_window", True) else (None, None)


def _biases(cfg, arch: str) -> tuple[bool, bool, list[str]]:
    """(add_bias_linear, add_qkv_bias, problems) of an architecture's bias settings."""
    attention_bias = bool(getattr(cfg, "attention_bias", False))  # Llama, Qwen3: q, k, v and o_proj
    if arch == QWEN2:  # q, k, v biases always; none on o_proj or the MLP
        return False, True, []
    if arch == MISTRAL:
        return False, False, []
    if arch == QWEN3:
        return False, False, [f"attention_bias={attention_bias} (Qwen3's biases include o_proj's but no MLP "
                              f"biases; megalite's add_bias_linear has both)"] if attention_bias else []
    mlp_bias = bool(getattr(cfg, "mlp_bias", False))  # Llama only
    if attention_bias != mlp_bias:
        return False, False, [f"attention_bias={attention_bias} with mlp_bias={mlp_bias} (megalite's "
                              f"add_bias_linear puts biases on attention and MLP together)"]
    return attention_bias, False, []


def _rope_fields(cfg, problems: list[str]) -> dict:
    rope = rope_parameters(cfg)
    fields = {"rotary_base": float(rope["rope_theta"])}
    if rope["rope_type"] not in ROPE_TYPES:
        problems.append(f"rope_type {rope['rope_type']!r} (megalite computes {', '.join(ROPE_TYPES)} RoPE)")
    elif rope["rope_type"] == "linear":  # Hugging Face divides the frequencies, Megatron-LM the positions
        if rope.get("factor") is None:
            problems.append("linear rope scaling without factor")
        else:
            fields["rotary_seq_len_interpolation_factor"] = float(rope["factor"])
    elif rope["rope_type"] == "yarn":  # Qwen2.5's long context, gpt-oss
        fields.update(yarn_fields(rope, problems))
    elif rope["rope_type"] == "llama3":
        keys = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
                "high_freq_factor": "rope_high_freq_factor",
                "original_max_position_embeddings": "rope_original_max_position_embeddings"}
        missing = [k for k in keys if rope.get(k) is None]
        if missing:
            problems.append(f"llama3 rope scaling without {', '.join(missing)}")
        else:
            fields.update({ours: (int if ours.endswith("embeddings") else float)(rope[theirs])
                           for theirs, ours in keys.items()})
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    if partial != 1.0:
        problems.append(f"partial_rotary_factor={partial} (Hugging Face's Llama, Mistral and Qwen rotate every "
                        f"head dimension)")
    return fields


def shared_fields(cfg, arch: str, problems: list[str], reads_hidden_act: bool = True) -> dict:
    """The TransformerConfig fields every family of Llama-like layers maps alike (this module's and
    `moe`'s): all but params_dtype, the MLP's width, the biases and the qk norms. Problems are
    appended to `problems`."""
    heads, hidden = cfg.num_attention_heads, cfg.hidden_size
    groups = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    if not head_dim:
        problems.append(f"no head_dim, and hidden_size={hidden} has no num_attention_heads={heads}-th part")
    if heads % groups:
        problems.append(f"num_key_value_heads={groups} does not divide num_attention_heads={heads}")
    if reads_hidden_act and cfg.hidden_act != "silu":
        problems.append(f"hidden_act={cfg.hidden_act!r} (megalite's gated MLP is SwiGLU: silu)")
    fields = dict(
        num_layers=cfg.num_hidden_layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        # Qwen3's heads are wider than hidden / heads: their own width, else the default's
        kv_channels=head_dim if hidden % heads or head_dim != hidden // heads else None,
        vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings, hidden_dropout=0.0,
        attention_dropout=float(getattr(cfg, "attention_dropout", 0.0) or 0.0),
        layernorm_epsilon=cfg.rms_norm_eps, init_method_std=cfg.initializer_range, layernorm_position="pre",
        normalization="rmsnorm", activation="silu", gated_linear_unit=True, causal=True,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=not getattr(cfg, "tie_word_embeddings", False),
        **_rope_fields(cfg, problems),
    )
    window, pattern = sliding_window(cfg, arch)
    if window is not None:  # a query sees itself and the W - 1 keys before it
        fields.update(window_size=(window - 1, 0), window_attn_skip_freq=pattern)
    return fields


def config_fields(cfg, arch: str) -> tuple[dict, list[str]]:
    """(TransformerConfig fields but params_dtype, problems) of a Hugging Face config."""
    problems = []
    fields = shared_fields(cfg, arch, problems)
    linear_bias, qkv_bias, bias_problems = _biases(cfg, arch)
    problems += bias_problems
    fields.update(ffn_hidden_size=cfg.intermediate_size, add_bias_linear=linear_bias, add_qkv_bias=qkv_bias,
                  qk_layernorm=arch == QWEN3)
    return fields, problems


def config_problems(cfg) -> list[str]:
    return config_fields(cfg, hf_class(cfg).__name__)[1]


def tied_head_problems(theirs: Mapping[str, torch.Tensor], fields: dict) -> list[str]:
    """A tied model whose lm_head holds other weights than its embedding (megalite would drop them)."""
    lm_head = theirs.get("lm_head.weight")
    if fields["untie_embeddings_and_output_weights"] or lm_head is None:
        return []
    if torch.equal(lm_head, theirs["model.embed_tokens.weight"]):
        return []
    return ["lm_head.weight differs from model.embed_tokens.weight with tie_word_embeddings=True"]


def imported(arch: str, fields: dict, problems: list[str], theirs: Mapping[str, torch.Tensor], tensors_from):
    """(config, megalite's tp = 1 tensors) of a Llama-like model's state dict `theirs` whose config maps
    to `fields`, refusing `problems` and a tied head of other weights in one message;
    `tensors_from(theirs, config, padded_vocab)` is the family's table."""
    refuse(arch, problems + tied_head_problems(theirs, fields))
    config = TransformerConfig(**fields, params_dtype=theirs["model.embed_tokens.weight"].dtype)
    padded = pad_vocab_size(config.vocab_size, 1, config.make_vocab_size_divisible_by)
    return config, tensors_from(theirs, config, padded)


def from_hf(model) -> tuple[TransformerConfig, dict[str, torch.Tensor]]:
    arch = type(model).__name__
    fields, problems = config_fields(model.config, arch)
    return imported(arch, fields, problems, dict(model.state_dict()), tensors_from_hf)


# ---------------------------------------------------------------------------------------------
# Export

def is_llama_like(c) -> bool:
    """Whether a megalite GPT config is of this family (else GPT-2's)."""
    return (getattr(c, "position_embedding_type", "learned_absolute") == "rope"
            or getattr(c, "gated_linear_unit", False) or getattr(c, "num_query_groups", None) is not None)


def default_architecture(c) -> str:
    if getattr(c, "qk_layernorm", False):
        return QWEN3
    if getattr(c, "add_qkv_bias", False) and not getattr(c, "add_bias_linear", True):
        return QWEN2
    if hf_window(c) is not None and not getattr(c, "add_bias_linear", True):  # Llama has no sliding window
        return MISTRAL
    return LLAMA


def hf_window(c) -> tuple[int, list[int] | None] | None:
    """(Hugging Face's sliding_window, one 1 / 0 per layer or None: all) of a megalite config, None
    without a bounded window in any layer (a causal model attends to the left side's keys and itself)."""
    window, pattern = getattr(c, "window_size", None), getattr(c, "window_attn_skip_freq", None)
    if window is None or window[0] == -1 or (pattern is not None and not any(pattern)):
        return None
    return window[0] + 1, pattern


def attention_problems(c, arch: str) -> list[str]:
    """What `arch` cannot hold of a config's rope scaling and sliding window (this module's and `moe`'s,
    whose Hugging Face configs `hf_config_kwargs` writes alike)."""
    problems = []
    if getattr(c, "yarn_factor", None) is not None:
        version = torch.torch_version.TorchVersion(transformers().__version__)
        if version < (4, 55):  # before gpt-oss: the factor taken from the positions, truncate not read
            problems.append(f"YaRN rope exports with transformers >= 4.55 (this is {version}, whose YaRN reads "
                            f"neither the factor given nor truncate)")
    if getattr(c, "rotary_seq_len_interpolation_factor", None) is not None and c.rope_scaling_factor is not None:
        problems.append(f"{arch} scales rope one way: linear position interpolation and Llama 3.1's frequency "
                        f"scaling together have no Hugging Face rope_type")
    return problems + _window_problems(c, arch)


def _window_problems(c, arch: str) -> list[str]:
    window = hf_window(c)
    if window is None:
        return []
    cls = getattr(transformers(), arch.replace("ForCausalLM", "Config"))
    if not _accepts(cls, "sliding_window"):
        return [f"{arch} has no sliding window (window_size={c.window_size}): {WINDOWED_ARCHITECTURES}"]
    if window[1] is not None and not _accepts(cls, "layer_types"):
        return [f"{arch} windows every layer or none (window_attn_skip_freq={c.window_attn_skip_freq}): "
                f"{PATTERNED_ARCHITECTURES}"]
    return []


WINDOWED_ARCHITECTURES = ("the sliding window exports as MistralForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM "
                          "(with experts: MixtralForCausalLM, Qwen2MoeForCausalLM or Qwen3MoeForCausalLM)")
PATTERNED_ARCHITECTURES = ("a window in some layers only exports as Qwen2ForCausalLM or Qwen3ForCausalLM (with "
                           "experts: Qwen2MoeForCausalLM)")


def export_problems(c, arch: str) -> list[str]:
    """What `arch` cannot hold of a megalite config."""
    problems = []
    wanted = {"position_embedding_type": "rope", "normalization": "rmsnorm", "gated_linear_unit": True,
              "activation": "silu", "layernorm_position": "pre", "causal": True, "rotary_percent": 1.0}
    for name, value in wanted.items():
        if getattr(c, name, None) != value:
            problems.append(f"{arch} needs {name}={value!r} (config: {getattr(c, name, None)!r})")
    problems += attention_problems(c, arch)
    s = shape_of(c)
    holds = {  # (linear bias, q/k/v bias only, qk norm) an architecture can hold
        LLAMA: {(False, False, False), (True, False, False), (True, True, False)},
        MISTRAL: {(False, False, False)},
        QWEN2: {(False, True, False)},
        QWEN3: {(False, False, True)},
    }[arch]
    if (s.linear_bias, s.qkv_bias, s.qk_norm) not in holds:
        problems.append(f"{arch} cannot hold add_bias_linear={s.linear_bias}, add_qkv_bias={s.qkv_bias}, "
                        f"qk_layernorm={s.qk_norm} (choose the architecture {default_architecture(c)})")
    return problems


def _accepts(cls, name: str) -> bool:
    return name in inspect.signature(cls.__init__).parameters


def hf_config(c, arch: str):
    cls = getattr(transformers(), arch.replace("ForCausalLM", "Config"))
    return with_head_dim(cls(**hf_config_kwargs(c, cls)), c)


def with_head_dim(hf_cfg, c):
    """hf_cfg with the heads' width where its class takes none as an argument but its attention reads
    `config.head_dim` (Qwen3-MoE), so that heads wider than hidden / heads survive the export."""
    if getattr(hf_cfg, "head_dim", None) != c.head_dim:
        hf_cfg.head_dim = c.head_dim
    return hf_cfg


def hf_config_kwargs(c, cls) -> dict:
    """The arguments of a Llama-like Hugging Face config class `cls` that every such family sets alike
    (this module's and `moe`'s)."""
    rope = {"rope_type": "default", "rope_theta": c.rotary_base}
    if getattr(c, "rotary_seq_len_interpolation_factor", None) is not None:
        rope.update(rope_type="linear", factor=c.rotary_seq_len_interpolation_factor)
    if getattr(c, "rope_scaling_factor", None) is not None:
        rope.update(rope_type="llama3", factor=c.rope_scaling_factor, low_freq_factor=c.rope_low_freq_factor,
                    high_freq_factor=c.rope_high_freq_factor,
                    original_max_position_embeddings=c.rope_original_max_position_embeddings)
    rope.update(hf_yarn_parameters(c))
    kwargs = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.query_groups, hidden_act="silu",
        max_position_embeddings=c.max_position_embeddings, initializer_range=c.init_method_std,
        rms_norm_eps=c.layernorm_epsilon, attention_dropout=c.attention_dropout,
        tie_word_embeddings=not c.untie_embeddings_and_output_weights,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,  # megalite's config holds no token ids
    )
    if _accepts(cls, "rope_parameters"):
        kwargs["rope_parameters"] = rope
    else:  # transformers < 5
        kwargs["rope_theta"] = rope.pop("rope_theta")
        kwargs["rope_scaling"] = rope if rope["rope_type"] != "default" else None
    window = hf_window(c)
    pattern = None if window is None else window[1] or [1] * c.num_layers
    # layer_types says which layers; max_window_layers (the first windowed one) says the same to readers that
    # window the layers from it on, exactly where the windowed layers are the last ones
    windows = {"sliding_window": None, "use_sliding_window": False} if window is None else {
        "sliding_window": window[0], "use_sliding_window": True, "max_window_layers": pattern.index(1),
        "layer_types": ["sliding_attention" if on else "full_attention" for on in pattern]}
    for name, value in (("head_dim", c.head_dim), ("attention_bias", c.add_bias_linear),
                        ("mlp_bias", c.add_bias_linear), *windows.items()):
        if _accepts(cls, name):
            kwargs[name] = value
    return kwargs


def to_hf(config: TransformerConfig, state_dict: Mapping[str, torch.Tensor], architecture: str | None = None):
    """`architecture` (default: the one the config's biases and qk norm call for) in eval mode,
    holding a megalite GPT's weights."""
    arch = architecture or default_architecture(config)
    rows = table(shape_of(config))
    refuse("this megalite GPT", export_problems(config, arch) + table_problems(state_dict, rows, config.vocab_size),
           to=f"Hugging Face {arch}")
    return load_exported(config, state_dict, tensors_to_hf(state_dict, config),
                         getattr(transformers(), arch)(hf_config(config, arch)))


def load_exported(config, state_dict: Mapping[str, torch.Tensor], theirs: dict, model):
    """`model` (a new Hugging Face *ForCausalLM) in megalite's dtype and eval mode, holding `theirs`
    (the exported tensors), with the tied head pointing at the embedding."""
    if not config.untie_embeddings_and_output_weights:
        theirs["lm_head.weight"] = theirs["model.embed_tokens.weight"]
    return load_into(model.to(state_dict["word_embeddings.weight"].dtype), theirs)
