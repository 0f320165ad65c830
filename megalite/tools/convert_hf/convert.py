"""from_hf / to_hf: which family converts a model (by its Hugging Face class, or by the megalite config)."""
from __future__ import annotations

import os
from typing import Mapping

import torch

from megalite.models.config import TransformerConfig
from megalite.tools.convert_hf import bert, deepseek, gpt2, gpt_oss, llama, moe, nemotron
from megalite.tools.convert_hf.common import ConversionError, load_hf_config, load_hf_weights, refuse
from megalite.tools.convert_hf.rotary_rows import interleaved_to_rotate_half

# family module -> the megalite model kind it becomes
FAMILIES = ((gpt2, "gpt"), (bert, "bert"), (llama, "gpt"), (moe, "gpt"), (deepseek, "gpt"), (nemotron, "gpt"),
            (gpt_oss, "gpt"))
SUPPORTED = ", ".join(a for family, _ in FAMILIES for a in family.ARCHITECTURES)
# What to_hf writes: kind -> Hugging Face class -> family.
EXPORTS = {"gpt": {"GPT2LMHeadModel": gpt2, **{a: llama for a in llama.ARCHITECTURES},
                   **{a: moe for a in moe.ARCHITECTURES}, deepseek.DEEPSEEK_V3: deepseek, nemotron.NEMOTRON: nemotron,
                   gpt_oss.GPT_OSS: gpt_oss},
           "bert": {"BertForPreTraining": bert}}


def _unsupported(what: str) -> ConversionError:
    return ConversionError(f"unsupported architecture {what}: megalite converts {SUPPORTED}")


def _family_of_config(cfg):
    archs = list(getattr(cfg, "architectures", None) or [])
    model_type = getattr(cfg, "model_type", None)
    for family, kind in FAMILIES:
        if model_type in family.MODEL_TYPES and all(a in family.ARCHITECTURES for a in archs):
            return family, kind
    raise _unsupported(", ".join(archs) or f"model_type {model_type!r}")


def _family_of_model(model):
    for family, kind in FAMILIES:
        if family.owns_model(model):
            return family, kind
    raise _unsupported(type(model).__name__)


def hf_model_kind(model_or_dir) -> str:
    """"gpt" or "bert": what megalite model a Hugging Face model (object or saved directory) becomes.
    Raises ValueError for an architecture that from_hf does not convert."""
    if isinstance(model_or_dir, (str, os.PathLike)):
        return _family_of_config(load_hf_config(model_or_dir))[1]
    return _family_of_model(model_or_dir)[1]


def model_kind(state_dict: Mapping[str, torch.Tensor]) -> str:
    """"gpt" or "bert" from a megalite state dict's names (BERT has token-type embeddings or
    masked-LM head weights, GPT neither)."""
    bert_only = ("tokentype_embeddings.weight", "embedding_layernorm.weight", "lm_bias", "lm_dense.weight")
    return "bert" if any(k in state_dict for k in bert_only) else "gpt"


def load_hf_model(directory):
    """A supported model from a save_pretrained directory, refusing bad configs before loading
    weights and checkpoints that lack some of the weights (e.g. a BertModel's)."""
    cfg = load_hf_config(directory)
    family, _ = _family_of_config(cfg)
    cls = family.hf_class(cfg)
    refuse(cls.__name__, family.config_problems(cfg))
    stored_problems = getattr(family, "stored_problems", None)  # the MoE families name each expert tensor
    if stored_problems is not None:
        refuse(f"{directory} ({cls.__name__})", stored_problems(directory, cfg))
    return load_hf_weights(cls, directory, cls.__name__, names_checked=stored_problems is not None)


def from_hf(model_or_dir) -> tuple[TransformerConfig, dict[str, torch.Tensor]]:
    """(config, state_dict) of the megalite model equal to a Hugging Face one.

    `model_or_dir`: a model of one of the SUPPORTED architectures, or a directory written by its
    save_pretrained (read with local_files_only). GPT-2, the Llama, MoE and DeepSeek-V3 families become a
    GPTModel, BERT a BERTModel (`model_kind(state_dict)` or `hf_model_kind(model_or_dir)` tells which). The
    state dict has exactly the names and shapes of that model's state_dict() on one device (tp = 1):
    vocabulary padded to `pad_vocab_size(vocab, 1, config.make_vocab_size_divisible_by)` with zero
    rows. Tensors are copies, in the Hugging Face model's dtype (= config.params_dtype).
    Raises ValueError, naming every problem at once, for an architecture or setting megalite does
    not compute the same way.
    """
    model = load_hf_model(model_or_dir) if isinstance(model_or_dir, (str, os.PathLike)) else model_or_dir
    family, _ = _family_of_model(model)
    return family.from_hf(model)


def to_hf(config: TransformerConfig, state_dict: Mapping[str, torch.Tensor], kind: str | None = None,
          architecture: str | None = None):
    """The Hugging Face model (eval mode) holding a megalite model's weights: the inverse of from_hf.
    `state_dict` is a single-device (tp = 1) megalite state dict, its vocabulary padded or not
    (padding is stripped); `kind` ("gpt" | "bert") defaults to model_kind(state_dict).
    `architecture`: the Hugging Face class to write; by default BertForPreTraining for BERT,
    GPT2LMHeadModel for a GPT with learned positions, NemotronForCausalLM for a rope GPT with
    squared-ReLU MLPs, and for a RoPE / GQA / SwiGLU GPT MistralForCausalLM with a sliding window,
    Qwen3ForCausalLM with qk norms, Qwen2ForCausalLM with q/k/v biases alone, else
    LlamaForCausalLM; for a GPT with experts the first of MixtralForCausalLM, Qwen3MoeForCausalLM,
    OlmoeForCausalLM and Qwen2MoeForCausalLM that holds it, GptOssForCausalLM for one with learnable
    attention sinks; with multi-head latent attention DeepseekV3ForCausalLM. Tensors are copied in their dtype."""
    kind = kind or model_kind(state_dict)
    if kind not in ("gpt", "bert"):
        raise ConversionError(f"model kind must be 'gpt' or 'bert', got {kind!r}")
    if config.rotary_interleaved:  # Hugging Face rotates half: the same model in that layout
        state_dict = interleaved_to_rotate_half(state_dict, config)
        config = config.replace(rotary_interleaved=False)
    exports = EXPORTS[kind]
    if architecture is None:
        family = (bert if kind == "bert" else deepseek if config.multi_latent_attention
                  else gpt_oss if gpt_oss.is_gpt_oss_like(config) else moe if config.is_moe
                  else nemotron if nemotron.is_nemotron_like(config) else llama if llama.is_llama_like(config)
                  else gpt2)
    elif architecture in exports:
        family = exports[architecture]
    else:
        raise ConversionError(f"a megalite {kind.upper()} exports as {', '.join(exports)}, not {architecture}")
    if config.multi_latent_attention and family is not deepseek:
        raise ConversionError(f"this model has multi-head latent attention, {architecture} none: choose "
                              f"{deepseek.DEEPSEEK_V3}")
    if config.is_moe and family not in (moe, deepseek, gpt_oss):
        raise ConversionError(f"this model has experts, {architecture} none: choose one of "
                              f"{', '.join(moe.ARCHITECTURES + gpt_oss.ARCHITECTURES)}")
    if family in (moe, gpt_oss) and not config.is_moe:
        raise ConversionError(f"{architecture} has experts, this model none: choose a dense architecture, e.g. "
                              f"{llama.LLAMA}")
    nemotron_holds = (f"only {nemotron.NEMOTRON} holds (a dense rope model with squared-ReLU MLPs and zero-centred "
                      f"LayerNorms)")
    if family is not nemotron and config.layernorm_zero_centered_gamma:
        raise ConversionError(f"the model keeps its norm weights zero-centred (--apply-layernorm-1p), which "
                              f"{nemotron_holds}: export is not implemented for it otherwise")
    if family is not nemotron and config.activation == "squared_relu":
        raise ConversionError(f"the model's MLPs are squared-ReLU (--squared-relu), which {nemotron_holds}: export "
                              f"is not implemented for it otherwise")
    if family not in (llama, moe, gpt_oss) and llama.hf_window(config) is not None:
        raise ConversionError(f"the model attends within a sliding window (--window-size), which "
                              f"{architecture or 'the class it exports as'} does not hold: "
                              f"{llama.WINDOWED_ARCHITECTURES}")
    if config.qk_l2_norm or config.no_rope_freq is not None or config.moe_apply_probs_on_input:  # Llama 4's
        raise ConversionError("the model has Llama 4's query/key L2 norm, layers without rope or expert inputs scaled "
                              "by their weight (--qk-l2-norm, --no-rope-freq, --moe-apply-probs-on-input), which no "
                              "Hugging Face class megalite exports holds")
    gpt_oss_holds = f"only {gpt_oss.GPT_OSS} holds (a MoE model with learnable sinks)"
    quick = config.activation == "quick_gelu" or config.glu_linear_offset or config.activation_func_clamp_value
    if family is not gpt_oss and quick:
        raise ConversionError(f"the model's MLPs are quick-GeGLU or clamped / offset GLUs (--quick-geglu, "
                              f"--glu-linear-offset, --activation-func-clamp-value), which {gpt_oss_holds}")
    if family is not gpt_oss and config.softmax_type != "vanilla":
        raise ConversionError(f"the model's attention has sinks (--softmax-type {config.softmax_type}), which "
                              f"{gpt_oss_holds}")
    if family in (gpt2, bert, nemotron) and config.yarn_factor is not None:
        raise ConversionError(f"the model's rope is YaRN-scaled, which {architecture or family.ARCHITECTURES[0]} "
                              f"does not hold")
    if family in (llama, moe, deepseek, nemotron):
        return family.to_hf(config, state_dict, architecture)
    return family.to_hf(config, state_dict)
