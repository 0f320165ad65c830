"""The mixture-of-experts families (MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM,
OlmoeForCausalLM) <-> megalite's GPTModel with MoE layers.

Embeddings, norms, attention and dense MLPs are the Llama family's rows and config mapping
(llama.py). A MoE layer's router is Hugging Face's `mlp.gate`. Its experts, as transformers >= 5
holds them in memory, are one [E, 2I, H] `gate_up_proj` (each expert's gate rows, then its up rows)
and one [E, H, I] `down_proj`: exactly megalite's `experts.fc1_weight` and `fc2_weight`, so they are
copied. On disk (save_pretrained, and the released checkpoints) each expert has tensors of its own,
`mlp.experts.{e}.{gate,up,down}_proj.weight` (Mixtral: `block_sparse_moe.experts.{e}.{w1,w3,w2}
.weight` and `block_sparse_moe.gate.weight`); transformers converts between the two when it loads
and saves, and `stored_problems` first checks that the files hold every expert's tensors.

Routing (Hugging Face: a softmax over every expert, the top k kept; renormalised over the k with
`norm_topk_prob`, always for Mixtral): renormalised is megalite's default router (a softmax over the
top-k logits: the same numbers), kept as they are is `moe_router_pre_softmax`.
"""
from __future__ import annotations

import re

import warnings
from dataclasses import dataclass
from typing import Mapping

import torch

from megalite.models.config import TransformerConfig
from megalite.tools.convert_hf import llama
from megalite.tools.convert_hf.common import (ConversionNote, Row, export_tensors, import_tensors, listed,
                                              refuse, stored_tensor_names, stored_tensor_shapes, table_problems,
                                              transformers)

MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                                        "OlmoeForCausalLM")
ARCHITECTURES = (MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE)
MODEL_TYPES = {"mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE, "qwen3_moe": QWEN3_MOE, "olmoe": OLMOE}


@dataclass(frozen=True)
class Shape:
    """What decides the table's rows: the Llama family's, and the MoE layers'."""
    base: llama.Shape
    moe_layers: tuple[int, ...]  # 1: layer i's MLP is a MoE layer, 0: dense
    shared_expert: bool
    shared_expert_gate: bool


def shape_of(c) -> Shape:
    return Shape(llama.shape_of(c), tuple(c.moe_layer_freq), bool(c.moe_shared_expert_intermediate_size),
                 bool(c.moe_shared_expert_intermediate_size and c.moe_shared_expert_gate))


def moe_mlp_rows(s: Shape, i: int) -> list[Row]:
    """Layer i's MoE MLP, in the order of MoELayer.state_dict()."""
    ours, theirs = f"layers.{i}.mlp.", f"model.layers.{i}.mlp."
    rows = [(f"{ours}shared_expert_gate", f"{theirs}shared_expert_gate.weight", "same")] if s.shared_expert_gate else []
    rows += [(f"{ours}router.weight", f"{theirs}gate.weight", "same"),
             (f"{ours}experts.fc1_weight", f"{theirs}experts.gate_up_proj", "same"),
             (f"{ours}experts.fc2_weight", f"{theirs}experts.down_proj", "same")]
    if s.shared_expert:
        rows += llama.dense_mlp_rows(s.base, f"{ours}shared_experts.", f"{theirs}shared_expert.")
    return rows


def table(s: Shape) -> list[Row]:
    """Rows in the order of GPTModel.state_dict(); HF names are the in-memory *ForCausalLM model's."""
    rows = llama.embedding_rows(s.base)
    for i, moe in enumerate(s.moe_layers):
        mlp = moe_mlp_rows(s, i) if moe else llama.dense_mlp_rows(s.base, f"layers.{i}.mlp.", f"model.layers.{i}.mlp.")
        rows += llama.attention_rows(s.base, i) + mlp
    return rows + [llama.FINAL_NORM_ROW]


def tensors_from_hf(theirs: Mapping[str, torch.Tensor], c, padded_vocab: int) -> dict[str, torch.Tensor]:
    """megalite's tp = 1 tensors from a *ForCausalLM state dict (transformers >= 5: fused experts)."""
    return import_tensors(theirs, table(shape_of(c)), llama.groups_of(c), padded_vocab)


def tensors_to_hf(ours: Mapping[str, torch.Tensor], c) -> dict[str, torch.Tensor]:
    """The inverse of tensors_from_hf (tied models get no lm_head.weight: it is embed_tokens)."""
    return export_tensors(ours, table(shape_of(c)), llama.groups_of(c), c.vocab_size)


# ---------------------------------------------------------------------------------------------
# The files

def stored_names(name: str, arch: str, experts: int) -> list[str]:
    """What save_pretrained writes, as the released checkpoints store it, for the in-memory tensor
    `name`: the fused experts one tensor per expert; Mixtral's MoE blocks under `block_sparse_moe`."""
    layer, _, leaf = name.partition(".mlp.")
    per_expert = {"gate.weight": (), "experts.gate_up_proj": ("gate", "up"), "experts.down_proj": ("down",)}
    if leaf not in per_expert:
        return [name]
    block = f"{layer}.block_sparse_moe." if arch == MIXTRAL else f"{layer}.mlp."
    if not per_expert[leaf]:
        return [f"{block}gate.weight"]
    files = {"gate": "w1", "up": "w3", "down": "w2"} if arch == MIXTRAL else {
        p: f"{p}_proj" for p in ("gate", "up", "down")}
    return [f"{block}experts.{e}.{files[p]}.weight" for e in range(experts) for p in per_expert[leaf]]


def stored_problems(directory, cfg) -> list[str]:
    """Tensors a save_pretrained directory of a (checked) config must hold but lacks, or holds but
    should not: every expert's tensors are named. A layer stored as transformers holds it in memory
    (fused experts) is accepted too. [] for a directory without weight files (loading says so)."""
    stored = set(stored_tensor_names(directory))
    if not stored:
        return []
    arch = hf_class(cfg).__name__
    fields, _ = config_fields(cfg, arch)
    config = TransformerConfig(**fields)
    return file_problems(stored, table(shape_of(config)), arch, config) + expert_shape_problems(directory, config)


_EXPERT_TENSOR = re.compile(r"\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


def expert_shape_problems(directory, config: TransformerConfig) -> list[str]:
    """Each stored expert tensor of the shape the config makes ([ffn, hidden] for gate and up,
    [hidden, ffn] for down), named in one line before transformers reads (and reports) any of them."""
    ffn, hidden = config.moe_ffn_hidden_size, config.hidden_size
    wrong = []
    for name, shape in stored_tensor_shapes(directory).items():
        m = _EXPERT_TENSOR.search(name)
        if m:
            want = (hidden, ffn) if m.group(1) in ("w2", "down_proj") else (ffn, hidden)
            if shape != want:
                wrong.append(f"{name} {shape} (the config makes {want})")
    if not wrong:
        return []
    more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
    return [f"the weight files' expert shapes contradict config.json: {', '.join(wrong[:3])}{more} (use the config "
            f"saved with these weights)"]


def file_problems(stored: set[str], rows: list[Row], arch: str, config: TransformerConfig) -> list[str]:
    """What the weight files' tensor names `stored` lack of a table's `rows`, and hold beyond them,
    for any MoE family whose files store each expert as `stored_names` says (an in-memory name
    stored as it is counts too)."""
    expected = []
    for _, theirs, _ in rows:
        for name in theirs if isinstance(theirs, tuple) else (theirs,):
            expected += [name] if name in stored else stored_names(name, arch, config.num_moe_experts or 0)
    problems = []
    missing = [n for n in expected if n not in stored]
    if missing:
        problems.append(f"the weight files lack {listed(missing)} (each expert's tensors are read: copy the missing "
                        f"shard again, or save the model again with save_pretrained)")
    tied_head = {"lm_head.weight"} if not config.untie_embeddings_and_output_weights else set()
    extra = sorted(stored - set(expected) - tied_head)
    if extra:
        problems.append(f"the weight files hold tensors {arch} does not have: {listed(extra)} (a config.json of "
                        f"another model, e.g. more experts or layers: use the config saved with these weights)")
    return problems


# ---------------------------------------------------------------------------------------------
# Import

def owns_model(model) -> bool:
    return type(model).__name__ in ARCHITECTURES


def hf_class(cfg):
    archs = list(getattr(cfg, "architectures", None) or [])
    return getattr(transformers(), archs[0] if archs else MODEL_TYPES[cfg.model_type])


def moe_layer_freq(cfg, arch: str) -> list[int]:
    """1 for each MoE layer: Qwen's layers outside `mlp_only_layers` whose number + 1 is a multiple of
    `decoder_sparse_step`; every layer of Mixtral and OLMoE."""
    if arch in (MIXTRAL, OLMOE):
        return [1] * cfg.num_hidden_layers
    dense, step = set(getattr(cfg, "mlp_only_layers", None) or ()), getattr(cfg, "decoder_sparse_step", 1) or 1
    return [int(i not in dense and (i + 1) % step == 0) for i in range(cfg.num_hidden_layers)]


def _aux_loss_fields(cfg) -> dict:
    """Hugging Face adds its balancing loss only with output_router_logits; the coefficient is kept either way."""
    on = bool(getattr(cfg, "output_router_logits", False))
    return {"moe_router_load_balancing_type": "aux_loss" if on else "none",
            "moe_aux_loss_coeff": float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0)}


def _expert_fields(cfg, arch: str, problems: list[str]) -> dict:
    """The MoE fields, and the widths of the experts and of the dense MLPs."""
    experts = cfg.num_local_experts if arch == MIXTRAL else cfg.num_experts
    if not experts:
        problems.append(f"num_experts={experts} (a model without experts: convert it as a dense model)")
    renormalised = arch == MIXTRAL or bool(getattr(cfg, "norm_topk_prob", False))
    fields = dict(num_moe_experts=experts or None, moe_router_topk=cfg.num_experts_per_tok,
                  moe_router_pre_softmax=not renormalised, moe_layer_freq=moe_layer_freq(cfg, arch),
                  ffn_hidden_size=cfg.intermediate_size, **_aux_loss_fields(cfg))
    # Mixtral's and OLMoE's intermediate_size is the experts' width (they have no dense layers).
    fields["moe_ffn_hidden_size"] = cfg.intermediate_size if arch in (MIXTRAL, OLMOE) else cfg.moe_intermediate_size
    if arch == QWEN2_MOE:
        if not cfg.shared_expert_intermediate_size:
            problems.append("shared_expert_intermediate_size=0 (a Qwen2-MoE without a shared expert; megalite's "
                            "shared expert needs a width > 0)")
        fields.update(moe_shared_expert_intermediate_size=cfg.shared_expert_intermediate_size or None,
                      moe_shared_expert_gate=True)
    return fields


def _attention_fields(cfg, arch: str, problems: list[str]) -> dict:
    """Biases and qk norms: Qwen2-MoE's q/k/v biases, Qwen3-MoE's per-head and OLMoE's full-width norms."""
    if getattr(cfg, "attention_bias", False):  # Qwen3-MoE and OLMoE: q, k, v and o_proj
        problems.append("attention_bias=True (its o_proj bias comes without MLP biases; megalite's add_bias_linear "
                        "has both)")
    if getattr(cfg, "clip_qkv", None) is not None:
        problems.append(f"clip_qkv={cfg.clip_qkv} (megalite does not clamp queries, keys and values)")
    return dict(add_bias_linear=False, add_qkv_bias=arch == QWEN2_MOE and bool(getattr(cfg, "qkv_bias", True)),
                qk_layernorm=arch in (QWEN3_MOE, OLMOE), qk_layernorm_full_width=arch == OLMOE)


def config_fields(cfg, arch: str) -> tuple[dict, list[str]]:
    """(TransformerConfig fields but params_dtype, problems) of a Hugging Face config."""
    problems = []
    fields = llama.shared_fields(cfg, arch, problems)
    fields.update(_attention_fields(cfg, arch, problems))
    fields.update(_expert_fields(cfg, arch, problems))
    jitter = getattr(cfg, "router_jitter_noise", 0.0) or 0.0
    if jitter:
        warnings.warn(f"{arch} multiplies the MoE layer's input, the experts' too, by noise in [1 - {jitter}, "
                      f"1 + {jitter}] while training; megalite's --moe-input-jitter-eps jitters the router's input "
                      f"alone (Megatron-Core's), so training here goes without it unless given",
                      ConversionNote, stacklevel=3)
    return fields, problems


def config_problems(cfg) -> list[str]:
    return config_fields(cfg, hf_class(cfg).__name__)[1]


def unfused_expert_problems(theirs: Mapping[str, torch.Tensor]) -> list[str]:
    """A model object whose experts are modules of their own (transformers < 5) cannot be read."""
    if any(".mlp.experts.0." in k for k in theirs):
        return ["its experts are modules of their own (transformers < 5): convert MoE models with "
                "transformers >= 5, which holds them fused"]
    return []


def from_hf(model) -> tuple[TransformerConfig, dict[str, torch.Tensor]]:
    arch = type(model).__name__
    fields, problems = config_fields(model.config, arch)
    theirs = dict(model.state_dict())
    return llama.imported(arch, fields, problems + unfused_expert_problems(theirs), theirs, tensors_from_hf)


# ---------------------------------------------------------------------------------------------
# Export

def _features(c) -> dict[str, object]:
    """What tells the four architectures apart, of a megalite MoE config."""
    return {
        "qk norm": "full width" if c.qk_layernorm_full_width else "per head" if c.qk_layernorm else "none",
        "q/k/v biases": c.add_qkv_bias,
        "shared expert": ("none" if not c.moe_shared_expert_intermediate_size
                          else "gated" if c.moe_shared_expert_gate else "ungated"),
        "dense layers": not all(c.moe_layer_freq),
        "softmax before top-k": c.moe_router_pre_softmax,
    }


_ANY = {False, True}
# What each architecture can hold, feature by feature.
HOLDS = {
    MIXTRAL: {"qk norm": {"none"}, "q/k/v biases": {False}, "shared expert": {"none"}, "dense layers": {False},
              "softmax before top-k": {False}},
    QWEN3_MOE: {"qk norm": {"per head"}, "q/k/v biases": {False}, "shared expert": {"none"}, "dense layers": _ANY,
                "softmax before top-k": _ANY},
    OLMOE: {"qk norm": {"full width"}, "q/k/v biases": {False}, "shared expert": {"none"}, "dense layers": {False},
            "softmax before top-k": _ANY},
    QWEN2_MOE: {"qk norm": {"none"}, "q/k/v biases": _ANY, "shared expert": {"gated"}, "dense layers": _ANY,
                "softmax before top-k": _ANY},
}


def _unheld(c, arch: str) -> list[str]:
    return [f"{name}={value}" for name, value in _features(c).items() if value not in HOLDS[arch][name]]


def default_architecture(c) -> str | None:
    """The first architecture that holds the model (None: none does)."""
    return next((arch for arch in HOLDS if not _unheld(c, arch)), None)


def export_problems(c, arch: str) -> list[str]:
    """What `arch` cannot hold of a megalite MoE config."""
    problems = []
    wanted = {"position_embedding_type": "rope", "normalization": "rmsnorm", "gated_linear_unit": True,
              "activation": "silu", "layernorm_position": "pre", "causal": True, "rotary_percent": 1.0,
              "add_bias_linear": False, "moe_router_score_function": "softmax", "moe_router_topk_scaling_factor": None,
              "moe_router_num_groups": None, "moe_router_enable_expert_bias": False}
    for name, value in wanted.items():
        if getattr(c, name, None) != value:
            problems.append(f"{arch} needs {name}={value!r} (config: {getattr(c, name, None)!r})")
    problems += llama.attention_problems(c, arch)
    unheld = _unheld(c, arch)
    if unheld:
        fit = default_architecture(c)
        problems.append(f"{arch} cannot hold {', '.join(unheld)} ("
                        + (f"choose the architecture {fit})" if fit else "no Hugging Face MoE class here holds it)"))
    return problems


def hf_config(c, arch: str):
    cls = getattr(transformers(), arch.replace("ForCausalLM", "Config"))
    kwargs = llama.hf_config_kwargs(c, cls)
    kwargs.update(num_experts_per_tok=c.moe_router_topk, router_aux_loss_coef=c.moe_aux_loss_coeff,
                  output_router_logits=c.moe_router_load_balancing_type != "none" and c.moe_aux_loss_coeff > 0)
    if arch in (MIXTRAL, OLMOE):  # no dense layers: intermediate_size is the experts' width
        kwargs["intermediate_size"] = c.moe_ffn_hidden_size
    if arch == MIXTRAL:
        return llama.with_head_dim(cls(**kwargs, num_local_experts=c.num_moe_experts, router_jitter_noise=0.0), c)
    kwargs.update(num_experts=c.num_moe_experts, norm_topk_prob=not c.moe_router_pre_softmax)
    if arch == OLMOE:
        return llama.with_head_dim(cls(**kwargs, clip_qkv=None), c)
    kwargs.update(moe_intermediate_size=c.moe_ffn_hidden_size, decoder_sparse_step=1,
                  mlp_only_layers=[i for i, moe in enumerate(c.moe_layer_freq) if not moe])
    if arch == QWEN2_MOE:
        kwargs.update(shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size, qkv_bias=c.add_qkv_bias)
    return llama.with_head_dim(cls(**kwargs), c)


def to_hf(config: TransformerConfig, state_dict: Mapping[str, torch.Tensor], architecture: str | None = None):
    """`architecture` (default: the first of Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE that holds the
    model) in eval mode, holding a megalite MoE GPT's weights."""
    arch = architecture or default_architecture(config) or MIXTRAL
    rows = table(shape_of(config))
    refuse("this megalite GPT", export_problems(config, arch) + table_problems(state_dict, rows, config.vocab_size),
           to=f"Hugging Face {arch}")
    return llama.load_exported(config, state_dict, tensors_to_hf(state_dict, config),
                               getattr(transformers(), arch)(hf_config(config, arch)))
