"""GPT-2 (GPT2LMHeadModel, GPT2Model) <-> megalite's GPTModel with learned positions and a tied
output layer."""
from __future__ import annotations

from typing import Mapping

import torch

from megalite.models.config import TransformerConfig
from megalite.parallel.layers import pad_vocab_size
from megalite.tools.convert_hf.common import (Row, export_tensors, import_tensors, load_into, refuse,
                                              table_problems, transformers)

ARCHITECTURES = ("GPT2LMHeadModel", "GPT2Model")
MODEL_TYPES = ("gpt2",)
# HF activation names -> megalite's; the first listed for each is what export writes.
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def table(num_layers: int) -> list[Row]:
    """GPT-2 rows; HF names are relative to GPT2Model (GPT2LMHeadModel adds `transformer.`)."""
    rows = [("word_embeddings.weight", "wte.weight", "vocab"),
            ("position_embeddings.weight", "wpe.weight", "same")]
    for i in range(num_layers):
        ours, theirs = f"layers.{i}.", f"h.{i}."
        for ours_mod, theirs_mod, how in (
            ("input_layernorm", "ln_1", "same"),
            ("attention.qkv", "attn.c_attn", "qkv"),
            ("attention.proj", "attn.c_proj", "t"),
            ("post_attention_layernorm", "ln_2", "same"),
            ("mlp.fc1", "mlp.c_fc", "t"),
            ("mlp.fc2", "mlp.c_proj", "t"),
        ):
            rows.append((f"{ours}{ours_mod}.weight", f"{theirs}{theirs_mod}.weight", how))
            # Biases are [out] in both layouts: only the QKV one is reordered.
            rows.append((f"{ours}{ours_mod}.bias", f"{theirs}{theirs_mod}.bias", "qkv" if how == "qkv" else "same"))
    rows += [("final_layernorm.weight", "ln_f.weight", "same"), ("final_layernorm.bias", "ln_f.bias", "same")]
    return rows


def owns_model(model) -> bool:
    tf = transformers()
    return isinstance(model, (tf.GPT2LMHeadModel, tf.GPT2Model))


def hf_class(cfg):
    return transformers().GPT2LMHeadModel


def config_problems(cfg) -> list[str]:
    problems = []
    if not getattr(cfg, "scale_attn_weights", True):
        problems.append("scale_attn_weights=False (megalite scales attention scores by 1/sqrt(head_dim))")
    if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
        problems.append("scale_attn_by_inverse_layer_idx=True (megalite does not scale scores by 1/(layer + 1))")
    if getattr(cfg, "reorder_and_upcast_attn", False):
        problems.append("reorder_and_upcast_attn=True (not supported; set it False)")
    if getattr(cfg, "add_cross_attention", False):
        problems.append("add_cross_attention=True (megalite's GPT has no cross-attention)")
    act = getattr(cfg, "activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        problems.append(f"activation_function={act!r} (supported: {', '.join(ACTIVATIONS)})")
    if getattr(cfg, "tie_word_embeddings", True) is False:
        problems.append("tie_word_embeddings=False (megalite's output layer is the word embedding)")
    return problems


def from_hf(model) -> tuple[TransformerConfig, dict[str, torch.Tensor]]:
    tf = transformers()
    cfg = model.config
    problems = config_problems(cfg)
    base = model.transformer if isinstance(model, tf.GPT2LMHeadModel) else model
    theirs = dict(base.state_dict())
    if isinstance(model, tf.GPT2LMHeadModel) and not torch.equal(model.lm_head.weight, base.wte.weight):
        problems.append("lm_head.weight differs from transformer.wte.weight (megalite ties them)")
    refuse(type(model).__name__, problems)
    config = TransformerConfig(
        num_layers=cfg.n_layer, hidden_size=cfg.n_embd, num_attention_heads=cfg.n_head,
        vocab_size=cfg.vocab_size, max_position_embeddings=cfg.n_positions,
        ffn_hidden_size=cfg.n_inner if cfg.n_inner is not None else 4 * cfg.n_embd,
        hidden_dropout=cfg.resid_pdrop, attention_dropout=cfg.attn_pdrop,
        layernorm_epsilon=cfg.layer_norm_epsilon, init_method_std=cfg.initializer_range,
        layernorm_position="pre", activation=ACTIVATIONS[cfg.activation_function], causal=True,
        params_dtype=theirs["wte.weight"].dtype,
    )
    padded = pad_vocab_size(config.vocab_size, 1, config.make_vocab_size_divisible_by)
    groups = {"qkv": config.num_attention_heads}
    return config, import_tensors(theirs, table(config.num_layers), groups, padded)


def to_hf(config: TransformerConfig, state_dict: Mapping[str, torch.Tensor]):
    """GPT2LMHeadModel (eval mode) holding a megalite GPT's weights."""
    tf = transformers()
    c = config
    rows = table(c.num_layers)
    problems = []
    if c.layernorm_position != "pre" or not c.causal:
        problems.append(f"GPT-2 is a causal pre-LayerNorm model (config: layernorm_position="
                        f"{c.layernorm_position!r}, causal={c.causal})")
    if c.normalization != "layernorm":
        problems.append(f"GPT-2 and BERT use LayerNorm (config: normalization={c.normalization!r})")
    refuse("this megalite GPT", problems + table_problems(state_dict, rows, c.vocab_size), to="Hugging Face")
    theirs = export_tensors(state_dict, rows, {"qkv": c.num_attention_heads}, c.vocab_size)
    hf_config = tf.GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.max_position_embeddings, n_embd=c.hidden_size,
        n_layer=c.num_layers, n_head=c.num_attention_heads,
        n_inner=None if c.ffn_hidden_size == 4 * c.hidden_size else c.ffn_hidden_size,
        activation_function=next(k for k, v in ACTIVATIONS.items() if v == c.activation),
        resid_pdrop=c.hidden_dropout, embd_pdrop=c.hidden_dropout, attn_pdrop=c.attention_dropout,
        layer_norm_epsilon=c.layernorm_epsilon, initializer_range=c.init_method_std,
        scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
        tie_word_embeddings=True,
        # GPT-2's <|endoftext|> is token 50256; a smaller vocabulary has no such token.
        bos_token_id=50256 if c.vocab_size > 50256 else None,
        eos_token_id=50256 if c.vocab_size > 50256 else None,
    )
    theirs = {f"transformer.{k}": v for k, v in theirs.items()}
    theirs["lm_head.weight"] = theirs["transformer.wte.weight"]
    return load_into(tf.GPT2LMHeadModel(hf_config).to(state_dict["word_embeddings.weight"].dtype), theirs)
