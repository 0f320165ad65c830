"""BERT (BertForPreTraining) <-> megalite's BERTModel: post-LayerNorm, two token types, masked-LM
and next-sentence heads, the decoder tied to the word embedding."""
from __future__ import annotations

from typing import Mapping

import torch

from megalite.models.config import TransformerConfig
from megalite.parallel.layers import pad_vocab_size
from megalite.tools.convert_hf.common import (Row, export_tensors, import_tensors, load_into, pairs, refuse,
                                              table_problems, transformers)

ARCHITECTURES = ("BertForPreTraining",)
MODEL_TYPES = ("bert",)
# HF activation names -> megalite's; the first listed for each is what export writes.
ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


def table(num_layers: int) -> list[Row]:
    """BERT rows; HF names are BertForPreTraining's (the mapping of megalite/models/bert.py).
    lm_bias comes first, as in BERTModel.state_dict() (the model's own parameter)."""
    # The decoder's bias is the one the forward adds (HF ties cls.predictions.bias to it).
    rows = [("lm_bias", "cls.predictions.decoder.bias", "vocab"),
            ("word_embeddings.weight", "bert.embeddings.word_embeddings.weight", "vocab"),
            ("position_embeddings.weight", "bert.embeddings.position_embeddings.weight", "same"),
            ("tokentype_embeddings.weight", "bert.embeddings.token_type_embeddings.weight", "same")]
    rows += pairs([("embedding_layernorm", "bert.embeddings.LayerNorm")])
    for i in range(num_layers):
        ours, theirs = f"layers.{i}.", f"bert.encoder.layer.{i}."
        for p in ("weight", "bias"):
            rows.append((f"{ours}attention.qkv.{p}",
                         tuple(f"{theirs}attention.self.{n}.{p}" for n in ("query", "key", "value")), "qkv"))
        rows += pairs([
            (f"{ours}attention.proj", f"{theirs}attention.output.dense"),
            (f"{ours}post_attention_layernorm", f"{theirs}attention.output.LayerNorm"),
            (f"{ours}mlp.fc1", f"{theirs}intermediate.dense"),
            (f"{ours}mlp.fc2", f"{theirs}output.dense"),
            (f"{ours}post_mlp_layernorm", f"{theirs}output.LayerNorm"),
        ])
    rows += pairs([("lm_dense", "cls.predictions.transform.dense"),
                   ("lm_layernorm", "cls.predictions.transform.LayerNorm")])
    rows += pairs([("pooler", "bert.pooler.dense"), ("binary_head", "cls.seq_relationship")])
    return rows


def owns_model(model) -> bool:
    return isinstance(model, transformers().BertForPreTraining)


def hf_class(cfg):
    return transformers().BertForPreTraining


def config_problems(cfg) -> list[str]:
    problems = []
    act = getattr(cfg, "hidden_act", "gelu")
    if act not in ACTIVATIONS:
        problems.append(f"hidden_act={act!r} (supported: {', '.join(ACTIVATIONS)})")
    pos = getattr(cfg, "position_embedding_type", "absolute")
    if pos != "absolute":
        problems.append(f"position_embedding_type={pos!r} (megalite learns absolute positions)")
    if getattr(cfg, "is_decoder", False):
        problems.append("is_decoder=True (megalite's BERT is bidirectional)")
    if getattr(cfg, "add_cross_attention", False):
        problems.append("add_cross_attention=True (megalite's BERT has no cross-attention)")
    if getattr(cfg, "type_vocab_size", 2) != 2:
        problems.append(f"type_vocab_size={cfg.type_vocab_size} (megalite's BERT has 2 token types)")
    if getattr(cfg, "tie_word_embeddings", True) is False:
        problems.append("tie_word_embeddings=False (megalite's masked-LM output layer is the word embedding)")
    return problems


def from_hf(model) -> tuple[TransformerConfig, dict[str, torch.Tensor]]:
    cfg = model.config
    problems = config_problems(cfg)
    theirs = dict(model.state_dict())
    if not torch.equal(theirs["cls.predictions.decoder.weight"], theirs["bert.embeddings.word_embeddings.weight"]):
        problems.append("cls.predictions.decoder.weight differs from the word embedding (megalite ties them)")
    refuse(type(model).__name__, problems)
    config = TransformerConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings,
        ffn_hidden_size=cfg.intermediate_size,
        hidden_dropout=cfg.hidden_dropout_prob, attention_dropout=cfg.attention_probs_dropout_prob,
        layernorm_epsilon=cfg.layer_norm_eps, init_method_std=cfg.initializer_range,
        layernorm_position="post", activation=ACTIVATIONS[cfg.hidden_act],
        params_dtype=theirs["bert.embeddings.word_embeddings.weight"].dtype,
    )  # causal left at its default, as in the bert-* presets: BERTModel is always bidirectional
    padded = pad_vocab_size(config.vocab_size, 1, config.make_vocab_size_divisible_by)
    return config, import_tensors(theirs, table(config.num_layers), {"qkv": config.num_attention_heads}, padded)


def to_hf(config: TransformerConfig, state_dict: Mapping[str, torch.Tensor]):
    """BertForPreTraining (eval mode) holding a megalite BERT's weights."""
    tf = transformers()
    c = config
    rows = table(c.num_layers)
    problems = []
    if c.normalization != "layernorm":
        problems.append(f"GPT-2 and BERT use LayerNorm (config: normalization={c.normalization!r})")
    if c.layernorm_position != "post":
        problems.append("BertForPreTraining is post-LayerNorm (config: layernorm_position='pre')")
    if c.add_binary_head:
        problems += table_problems(state_dict, rows, c.vocab_size)
    else:  # (the table's missing rows would say nothing more)
        problems.append("BertForPreTraining has a sentence-order head and two token types (config: "
                        "add_binary_head=False, trained with --bert-no-binary-head)")
    refuse("this megalite BERT", problems, to="Hugging Face")
    theirs = export_tensors(state_dict, rows, {"qkv": c.num_attention_heads}, c.vocab_size)
    hf_config = tf.BertConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_attention_heads, intermediate_size=c.ffn_hidden_size,
        hidden_act=next(k for k, v in ACTIVATIONS.items() if v == c.activation),
        hidden_dropout_prob=c.hidden_dropout, attention_probs_dropout_prob=c.attention_dropout,
        max_position_embeddings=c.max_position_embeddings, type_vocab_size=2,
        initializer_range=c.init_method_std, layer_norm_eps=c.layernorm_epsilon, tie_word_embeddings=True,
    )
    theirs["cls.predictions.decoder.weight"] = theirs["bert.embeddings.word_embeddings.weight"]
    theirs["cls.predictions.bias"] = theirs["cls.predictions.decoder.bias"]
    return load_into(tf.BertForPreTraining(hf_config).to(state_dict["word_embeddings.weight"].dtype), theirs)
