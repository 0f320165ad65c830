"""Hugging Face interop: GPT-2 and BERT weights into megalite and back.

    from megalite.tools.convert_hf import from_hf, to_hf, model_kind
    config, sd = from_hf(hf_model_or_saved_dir)   # GPT2LMHeadModel / GPT2Model / BertForPreTraining
    kind = model_kind(sd)                         # "gpt" | "bert"  (also hf_model_kind(model_or_dir))
    model = (GPTModel if kind == "gpt" else BERTModel)(config, seed=0)
    model.load_state_dict(sd)                     # single device, tp = 1
    hf = to_hf(config, sd)                        # the inverse: GPT2LMHeadModel / BertForPreTraining

Command line (checkpoints through `megalite.checkpoint`):

    python -m megalite.tools.convert_hf import --hf-dir HF_DIR --out CKPT_DIR
    python -m megalite.tools.convert_hf export --load CKPT_DIR --out HF_DIR

Each parameter maps through one row of a table (`_gpt_table`, `_bert_table`; docs/hf.md lists
them) saying how the tensor changes on the way in; the way out undoes it:
  same   copied;
  t      transposed (GPT-2's Conv1D stores [in, out], nn.Linear [out, in]);
  vocab  rows padded with zeros to the padded vocabulary (tp = 1), stripped on export;
  qkv    q, k, v (HF: all heads of q, then of k, then of v) interleaved into megalite's rows
         [head, (q, k, v), head_dim]; from GPT-2's packed c_attn (transposed first when a
         weight) or from BERT's three Linear layers.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Mapping

import torch

from megalite.models.config import TransformerConfig
from megalite.parallel.layers import pad_vocab_size

GPT_ARCHITECTURES = ("GPT2LMHeadModel", "GPT2Model")
BERT_ARCHITECTURES = ("BertForPreTraining",)
SUPPORTED = ", ".join(GPT_ARCHITECTURES + BERT_ARCHITECTURES)

# HF activation names -> megalite's; the first listed for each is what export writes.
_GPT_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
_BERT_ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


# ---------------------------------------------------------------------------------------------
# Name tables: (megalite name, HF name or (q, k, v) names, how)

def _gpt_table(num_layers: int) -> list[tuple[str, str | tuple[str, str, str], str]]:
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


def _bert_table(num_layers: int) -> list[tuple[str, str | tuple[str, str, str], str]]:
    """BERT rows; HF names are BertForPreTraining's (the mapping of megalite/models/bert.py).
    lm_bias comes first, as in BERTModel.state_dict() (the model's own parameter)."""
    # The decoder's bias is the one the forward adds (HF ties cls.predictions.bias to it).
    rows = [("lm_bias", "cls.predictions.decoder.bias", "vocab"),
            ("word_embeddings.weight", "bert.embeddings.word_embeddings.weight", "vocab"),
            ("position_embeddings.weight", "bert.embeddings.position_embeddings.weight", "same"),
            ("tokentype_embeddings.weight", "bert.embeddings.token_type_embeddings.weight", "same")]
    rows += _pairs([("embedding_layernorm", "bert.embeddings.LayerNorm")])
    for i in range(num_layers):
        ours, theirs = f"layers.{i}.", f"bert.encoder.layer.{i}."
        for p in ("weight", "bias"):
            rows.append((f"{ours}attention.qkv.{p}",
                         tuple(f"{theirs}attention.self.{n}.{p}" for n in ("query", "key", "value")), "qkv"))
        rows += _pairs([
            (f"{ours}attention.proj", f"{theirs}attention.output.dense"),
            (f"{ours}post_attention_layernorm", f"{theirs}attention.output.LayerNorm"),
            (f"{ours}mlp.fc1", f"{theirs}intermediate.dense"),
            (f"{ours}mlp.fc2", f"{theirs}output.dense"),
            (f"{ours}post_mlp_layernorm", f"{theirs}output.LayerNorm"),
        ])
    rows += _pairs([("lm_dense", "cls.predictions.transform.dense"),
                    ("lm_layernorm", "cls.predictions.transform.LayerNorm")])
    rows += _pairs([("pooler", "bert.pooler.dense"), ("binary_head", "cls.seq_relationship")])
    return rows


def _pairs(modules):
    return [(f"{a}.{p}", f"{b}.{p}", "same") for a, b in modules for p in ("weight", "bias")]


# ---------------------------------------------------------------------------------------------
# Tensor transforms

def _interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """q, k, v [h, ...] (rows head-major) -> [3h, ...] with rows [head, (q, k, v), head_dim]."""
    stacked = torch.stack([q, k, v])  # [3, h, ...]
    return stacked.view(3, heads, -1, *q.shape[1:]).transpose(0, 1).reshape(3 * q.shape[0], *q.shape[1:])


def _split_qkv(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of _interleave_qkv."""
    parts = qkv.view(heads, 3, -1, *qkv.shape[1:]).transpose(0, 1)  # [3, heads, head_dim, ...]
    q, k, v = (p.reshape(-1, *qkv.shape[1:]) for p in parts.unbind(0))
    return q, k, v


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy, sharing no storage with the source model."""
    return t.detach().clone(memory_format=torch.contiguous_format)


def _import(theirs: Mapping[str, torch.Tensor], table, heads: int, padded_vocab: int) -> dict[str, torch.Tensor]:
    out = {}
    for ours_name, theirs_name, how in table:
        if how == "qkv" and isinstance(theirs_name, tuple):  # BERT: three Linear layers
            t = _interleave_qkv(*(theirs[n] for n in theirs_name), heads=heads)
        elif how == "qkv":  # GPT-2: packed Conv1D [in, 3h] (weight) or [3h] (bias)
            packed = theirs[theirs_name]
            packed = packed.t() if packed.ndim == 2 else packed
            t = _interleave_qkv(*packed.chunk(3, dim=0), heads=heads)
        elif how == "t":
            t = theirs[theirs_name].t()
        elif how == "vocab":
            real = theirs[theirs_name]
            t = real.new_zeros((padded_vocab, *real.shape[1:]))
            t[: real.shape[0]] = real
        else:
            t = theirs[theirs_name]
        out[ours_name] = _own(t)
    return out


def _export(ours: Mapping[str, torch.Tensor], table, heads: int, vocab: int, gpt_packed: bool) -> dict:
    out = {}
    for ours_name, theirs_name, how in table:
        t = ours[ours_name]
        if how == "qkv":
            q, k, v = _split_qkv(t, heads)
            if gpt_packed:
                packed = torch.cat([q, k, v], dim=0)
                out[theirs_name] = _own(packed.t() if packed.ndim == 2 else packed)
            else:
                for name, part in zip(theirs_name, (q, k, v)):
                    out[name] = _own(part)
        elif how == "t":
            out[theirs_name] = _own(t.t())
        elif how == "vocab":
            out[theirs_name] = _own(t[:vocab])
        else:
            out[theirs_name] = _own(t)
    return out


# ---------------------------------------------------------------------------------------------
# Which model, and can it be converted

def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - transformers is a test dependency
        raise ImportError("Hugging Face interop needs `transformers`: pip install 'megalite[hf]'") from e
    return transformers


def _kind_of_hf_config(cfg) -> str:
    archs = list(getattr(cfg, "architectures", None) or [])
    model_type = getattr(cfg, "model_type", None)
    if model_type == "gpt2" and all(a in GPT_ARCHITECTURES for a in archs):
        return "gpt"
    if model_type == "bert" and all(a in BERT_ARCHITECTURES for a in archs):
        return "bert"
    what = ", ".join(archs) or f"model_type {model_type!r}"
    raise ValueError(f"unsupported architecture {what}: megalite converts {SUPPORTED}")


def _kind_of_hf_model(model) -> str:
    tf = _transformers()
    if isinstance(model, (tf.GPT2LMHeadModel, tf.GPT2Model)):
        return "gpt"
    if isinstance(model, tf.BertForPreTraining):
        return "bert"
    raise ValueError(f"unsupported architecture {type(model).__name__}: megalite converts {SUPPORTED}")


def hf_model_kind(model_or_dir) -> str:
    """"gpt" or "bert": what megalite model a Hugging Face model (object or saved directory) becomes.
    Raises ValueError for an architecture that from_hf does not convert."""
    if isinstance(model_or_dir, (str, os.PathLike)):
        return _kind_of_hf_config(_load_hf_config(model_or_dir))
    return _kind_of_hf_model(model_or_dir)


def model_kind(state_dict: Mapping[str, torch.Tensor]) -> str:
    """"gpt" or "bert" from a megalite state dict's names (BERT has token-type embeddings or
    masked-LM head weights, GPT neither)."""
    bert_only = ("tokentype_embeddings.weight", "embedding_layernorm.weight", "lm_bias", "lm_dense.weight")
    return "bert" if any(k in state_dict for k in bert_only) else "gpt"


def _gpt_config_problems(cfg) -> list[str]:
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
    if act not in _GPT_ACTIVATIONS:
        problems.append(f"activation_function={act!r} (supported: {', '.join(_GPT_ACTIVATIONS)})")
    if getattr(cfg, "tie_word_embeddings", True) is False:
        problems.append("tie_word_embeddings=False (megalite's output layer is the word embedding)")
    return problems


def _bert_config_problems(cfg) -> list[str]:
    problems = []
    act = getattr(cfg, "hidden_act", "gelu")
    if act not in _BERT_ACTIVATIONS:
        problems.append(f"hidden_act={act!r} (supported: {', '.join(_BERT_ACTIVATIONS)})")
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


def _refuse(what: str, problems: list[str], to: str = "megalite") -> None:
    if problems:
        raise ValueError(f"cannot convert {what} to {to}: " + "; ".join(problems))


def _load_hf_config(directory):
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a directory saved with save_pretrained (no config.json)")
    return _transformers().AutoConfig.from_pretrained(path, local_files_only=True)


def _load_hf_model(directory):
    """A supported model from a save_pretrained directory, refusing bad configs before loading
    weights and checkpoints that lack some of the weights (e.g. a BertModel's)."""
    tf = _transformers()
    cfg = _load_hf_config(directory)
    kind = _kind_of_hf_config(cfg)
    arch = (cfg.architectures or [GPT_ARCHITECTURES[0] if kind == "gpt" else BERT_ARCHITECTURES[0]])[0]
    _refuse(arch, _gpt_config_problems(cfg) if kind == "gpt" else _bert_config_problems(cfg))
    cls = tf.GPT2LMHeadModel if kind == "gpt" else tf.BertForPreTraining
    model, info = cls.from_pretrained(directory, local_files_only=True, output_loading_info=True)
    tied = set(getattr(cls, "_tied_weights_keys", None) or ())
    missing = [k for k in info.get("missing_keys", ()) if k not in tied]
    if missing:
        raise ValueError(f"cannot convert {directory} ({arch}) to megalite: the checkpoint lacks "
                         f"{', '.join(sorted(missing)[:6])}{' ...' if len(missing) > 6 else ''}")
    return model.eval()


# ---------------------------------------------------------------------------------------------
# Import

def from_hf(model_or_dir) -> tuple[TransformerConfig, dict[str, torch.Tensor]]:
    """(config, state_dict) of the megalite model equal to a Hugging Face one.

    `model_or_dir`: a GPT2LMHeadModel, GPT2Model or BertForPreTraining, or a directory written by
    their save_pretrained (read with local_files_only). GPT-2 becomes a GPTModel, BERT a BERTModel
    (post-LN; `model_kind(state_dict)` or `hf_model_kind(model_or_dir)` tells which). The state
    dict has exactly the names and shapes of that model's state_dict() on one device (tp = 1):
    vocabulary padded to `pad_vocab_size(vocab, 1, config.make_vocab_size_divisible_by)` with zero
    rows. Tensors are copies, in the Hugging Face model's dtype (= config.params_dtype).
    Raises ValueError, naming every problem at once, for an architecture or setting megalite does
    not compute the same way.
    """
    if isinstance(model_or_dir, (str, os.PathLike)):
        model = _load_hf_model(model_or_dir)
    else:
        model = model_or_dir
    kind = _kind_of_hf_model(model)
    return _gpt_from_hf(model) if kind == "gpt" else _bert_from_hf(model)


def _gpt_from_hf(model):
    tf = _transformers()
    cfg = model.config
    problems = _gpt_config_problems(cfg)
    base = model.transformer if isinstance(model, tf.GPT2LMHeadModel) else model
    theirs = dict(base.state_dict())
    if isinstance(model, tf.GPT2LMHeadModel) and not torch.equal(model.lm_head.weight, base.wte.weight):
        problems.append("lm_head.weight differs from transformer.wte.weight (megalite ties them)")
    _refuse(type(model).__name__, problems)
    wte = theirs["wte.weight"]
    config = TransformerConfig(
        num_layers=cfg.n_layer, hidden_size=cfg.n_embd, num_attention_heads=cfg.n_head,
        vocab_size=cfg.vocab_size, max_position_embeddings=cfg.n_positions,
        ffn_hidden_size=cfg.n_inner if cfg.n_inner is not None else 4 * cfg.n_embd,
        hidden_dropout=cfg.resid_pdrop, attention_dropout=cfg.attn_pdrop,
        layernorm_epsilon=cfg.layer_norm_epsilon, init_method_std=cfg.initializer_range,
        layernorm_position="pre", activation=_GPT_ACTIVATIONS[cfg.activation_function], causal=True,
        params_dtype=wte.dtype,
    )
    padded = pad_vocab_size(config.vocab_size, 1, config.make_vocab_size_divisible_by)
    return config, _import(theirs, _gpt_table(config.num_layers), config.num_attention_heads, padded)


def _bert_from_hf(model):
    cfg = model.config
    problems = _bert_config_problems(cfg)
    theirs = dict(model.state_dict())
    if not torch.equal(theirs["cls.predictions.decoder.weight"], theirs["bert.embeddings.word_embeddings.weight"]):
        problems.append("cls.predictions.decoder.weight differs from the word embedding (megalite ties them)")
    _refuse(type(model).__name__, problems)
    config = TransformerConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings,
        ffn_hidden_size=cfg.intermediate_size,
        hidden_dropout=cfg.hidden_dropout_prob, attention_dropout=cfg.attention_probs_dropout_prob,
        layernorm_epsilon=cfg.layer_norm_eps, init_method_std=cfg.initializer_range,
        layernorm_position="post", activation=_BERT_ACTIVATIONS[cfg.hidden_act],
        params_dtype=theirs["bert.embeddings.word_embeddings.weight"].dtype,
    )  # causal left at its default, as in the bert-* presets: BERTModel is always bidirectional
    padded = pad_vocab_size(config.vocab_size, 1, config.make_vocab_size_divisible_by)
    return config, _import(theirs, _bert_table(config.num_layers), config.num_attention_heads, padded)


# ---------------------------------------------------------------------------------------------
# Export

def to_hf(config: TransformerConfig, state_dict: Mapping[str, torch.Tensor], kind: str | None = None):
    """The Hugging Face model (GPT2LMHeadModel or BertForPreTraining, in eval mode) holding a
    megalite model's weights: the inverse of from_hf. `state_dict` is a single-device (tp = 1)
    megalite state dict, its vocabulary padded or not (padding is stripped); `kind` ("gpt" |
    "bert") defaults to model_kind(state_dict). Tensors are copied in their dtype."""
    kind = kind or model_kind(state_dict)
    if kind not in ("gpt", "bert"):
        raise ValueError(f"model kind must be 'gpt' or 'bert', got {kind!r}")
    tf = _transformers()
    c = config
    table = _gpt_table(c.num_layers) if kind == "gpt" else _bert_table(c.num_layers)
    problems = []
    if kind == "gpt" and (c.layernorm_position != "pre" or not c.causal):
        problems.append(f"GPT-2 is a causal pre-LayerNorm model (config: layernorm_position="
                        f"{c.layernorm_position!r}, causal={c.causal})")
    if c.normalization != "layernorm":
        problems.append(f"GPT-2 and BERT use LayerNorm (config: normalization={c.normalization!r})")
    if kind == "bert" and c.layernorm_position != "post":
        problems.append("BertForPreTraining is post-LayerNorm (config: layernorm_position='pre')")
    missing = [ours for ours, _, _ in table if ours not in state_dict]
    if missing:
        problems.append(f"the state dict lacks {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
    known = {ours for ours, _, _ in table}
    extra = [k for k in state_dict if k not in known]
    if extra:
        problems.append(f"unexpected entries {', '.join(extra[:6])}{' ...' if len(extra) > 6 else ''}")
    rows = state_dict.get("word_embeddings.weight")
    if rows is not None and rows.shape[0] < c.vocab_size:
        problems.append(f"word_embeddings has {rows.shape[0]} rows, fewer than vocab_size ({c.vocab_size})")
    _refuse(f"this megalite {kind.upper()}", problems, to="Hugging Face")

    theirs = _export(state_dict, table, c.num_attention_heads, c.vocab_size, gpt_packed=kind == "gpt")
    dtype = state_dict["word_embeddings.weight"].dtype
    if kind == "gpt":
        hf_config = tf.GPT2Config(
            vocab_size=c.vocab_size, n_positions=c.max_position_embeddings, n_embd=c.hidden_size,
            n_layer=c.num_layers, n_head=c.num_attention_heads,
            n_inner=None if c.ffn_hidden_size == 4 * c.hidden_size else c.ffn_hidden_size,
            activation_function=next(k for k, v in _GPT_ACTIVATIONS.items() if v == c.activation),
            resid_pdrop=c.hidden_dropout, embd_pdrop=c.hidden_dropout, attn_pdrop=c.attention_dropout,
            layer_norm_epsilon=c.layernorm_epsilon, initializer_range=c.init_method_std,
            scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
            tie_word_embeddings=True,
            # GPT-2's <|endoftext|> is token 50256; a smaller vocabulary has no such token.
            bos_token_id=50256 if c.vocab_size > 50256 else None,
            eos_token_id=50256 if c.vocab_size > 50256 else None,
        )
        model = tf.GPT2LMHeadModel(hf_config)
        theirs = {f"transformer.{k}": v for k, v in theirs.items()}
        theirs["lm_head.weight"] = theirs["transformer.wte.weight"]
    else:
        hf_config = tf.BertConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_attention_heads, intermediate_size=c.ffn_hidden_size,
            hidden_act=next(k for k, v in _BERT_ACTIVATIONS.items() if v == c.activation),
            hidden_dropout_prob=c.hidden_dropout, attention_probs_dropout_prob=c.attention_dropout,
            max_position_embeddings=c.max_position_embeddings, type_vocab_size=2,
            initializer_range=c.init_method_std, layer_norm_eps=c.layernorm_epsilon, tie_word_embeddings=True,
        )
        model = tf.BertForPreTraining(hf_config)
        theirs["cls.predictions.decoder.weight"] = theirs["bert.embeddings.word_embeddings.weight"]
        theirs["cls.predictions.bias"] = theirs["cls.predictions.decoder.bias"]
    model = model.to(dtype)
    missing_keys, unexpected = model.load_state_dict(theirs, strict=False)
    parameters = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    if unexpected or parameters & set(missing_keys):  # a bug in the tables, not the user's input
        raise RuntimeError(f"to_hf: unmatched names: missing {sorted(parameters & set(missing_keys))}, "
                           f"unexpected {sorted(unexpected)}")
    return model.eval()


# ---------------------------------------------------------------------------------------------
# Command line

def _cmd_import(args) -> str:
    from megalite import checkpoint

    kind = hf_model_kind(args.hf_dir)
    config, sd = from_hf(args.hf_dir)
    checkpoint.save_model_checkpoint(args.out, config, kind, sd, iteration=0)
    return (f"imported {kind} ({config.num_layers} layers, hidden {config.hidden_size}, "
            f"{config.num_attention_heads} heads, vocab {config.vocab_size}) from {args.hf_dir} into {args.out}")


def _cmd_export(args) -> str:
    from megalite import checkpoint

    if not Path(args.load).is_dir():
        raise FileNotFoundError(f"{args.load} is not a megalite checkpoint directory")
    config, kind, sd = checkpoint.load_full_state_dict(args.load)
    model = to_hf(config, sd, kind)
    model.save_pretrained(args.out)
    return f"exported {kind} from {args.load} as {type(model).__name__} into {args.out}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megalite.tools.convert_hf",
        description=f"Convert Hugging Face models ({SUPPORTED}) to megalite checkpoints and back.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face save_pretrained directory -> megalite checkpoint")
    imp.add_argument("--hf-dir", required=True, help="directory written by save_pretrained (nothing is downloaded)")
    imp.add_argument("--out", required=True, help="megalite checkpoint directory to write (iteration 0)")
    exp = sub.add_parser("export", help="megalite checkpoint (any layout) -> Hugging Face save_pretrained directory")
    exp.add_argument("--load", required=True, help="megalite checkpoint directory")
    exp.add_argument("--out", required=True, help="directory for save_pretrained")
    args = parser.parse_args(argv)
    try:
        message = _cmd_import(args) if args.command == "import" else _cmd_export(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"megalite: error: {e}", file=sys.stderr)
        return 2
    print(message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
