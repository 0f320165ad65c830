"""scripts/benchmark_step.py's plain side: GPT-2 in plain PyTorch (scripts/benchmark_gpt.py's PlainGPT)
and transformers' Llama, Mixtral and BERT built from local configs at a benchmark shape (`s`: a
benchmark_step.Shape), each trained by a step of loss, backward, clip_grad_norm_ and fused AdamW."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
MOE_EXPERTS, MOE_TOPK = 8, 2  # the moe family: every MLP 8 experts, top-2
LR = 1e-4


@dataclass
class Side:
    name: str
    step: Callable[[], torch.Tensor]  # one full training step; returns the step's mean loss
    num_params: int


def _plain_gpt_class():
    spec = importlib.util.spec_from_file_location("benchmark_gpt", ROOT / "scripts" / "benchmark_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PlainGPT


def hf_llama(s, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=vocab, hidden_size=s.hidden, intermediate_size=s.ffn, num_hidden_layers=s.layers,
                         num_attention_heads=s.heads, num_key_value_heads=s.groups or s.heads,
                         max_position_embeddings=s.positions, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attention_bias=False,
                         mlp_bias=False, attention_dropout=0.0, bos_token_id=0, eos_token_id=1, pad_token_id=None,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def hf_mixtral(s, vocab: int):
    from transformers import MixtralConfig, MixtralForCausalLM
    config = MixtralConfig(vocab_size=vocab, hidden_size=s.hidden, intermediate_size=s.ffn,
                           num_hidden_layers=s.layers, num_attention_heads=s.heads,
                           num_key_value_heads=s.groups or s.heads, num_local_experts=MOE_EXPERTS,
                           num_experts_per_tok=MOE_TOPK, max_position_embeddings=s.positions, rms_norm_eps=1e-5,
                           tie_word_embeddings=False, rope_theta=10000.0, attention_dropout=0.0,
                           router_jitter_noise=0.0, output_router_logits=False, sliding_window=None,
                           bos_token_id=0, eos_token_id=1, pad_token_id=None, attn_implementation="sdpa",
                           experts_implementation="eager")
    return MixtralForCausalLM(config)


def hf_bert(s, vocab: int):
    from transformers import BertConfig, BertForPreTraining
    config = BertConfig(vocab_size=vocab, hidden_size=s.hidden, num_hidden_layers=s.layers,
                        num_attention_heads=s.heads, intermediate_size=s.ffn, hidden_act="gelu",
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        max_position_embeddings=s.positions, type_vocab_size=2, layer_norm_eps=1e-12,
                        attn_implementation="sdpa")
    return BertForPreTraining(config)


def build_plain(family: str, s, padded_vocab: int, batch: dict, compiled: bool, model=None) -> Side:
    """The plain counterpart over megalite's padded vocabulary, on the same batch. `model`: a
    prebuilt one (llama: the Hugging Face model whose weights megalite also loaded)."""
    torch.manual_seed(0)
    if family == "gpt":
        model = _plain_gpt_class()(s.layers, s.hidden, s.heads, padded_vocab, s.positions)
        tokens, labels = batch["tokens"], batch["labels"]
        forward = torch.compile(model) if compiled else model  # as benchmark_gpt.py compiles it

        def loss_fn():
            return forward(tokens, labels)
    elif family in ("llama", "moe"):
        model = model if model is not None else (hf_llama if family == "llama" else hf_mixtral)(s, padded_vocab)
        tokens, labels = batch["tokens"], batch["labels"]

        def forward_and_loss(ids, targets):
            logits = model(input_ids=ids, use_cache=False).logits
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        fn = torch.compile(forward_and_loss) if compiled else forward_and_loss

        def loss_fn():
            return fn(tokens, labels)
    else:
        model = hf_bert(s, padded_vocab)
        mlm_labels = batch["labels"].masked_fill(batch["loss_mask"] == 0, -100)
        inputs = dict(input_ids=batch["tokens"], attention_mask=batch["padding_mask"].long(),
                      token_type_ids=batch["token_types"], labels=mlm_labels, next_sentence_label=batch["sop_labels"])

        def forward_and_loss(**kw):
            return model(**kw).loss
        fn = torch.compile(forward_and_loss) if compiled else forward_and_loss

        def loss_fn():
            return fn(**inputs)
    model.train()
    params = list(model.parameters())
    decay = [p for p in params if p.dim() > 1]
    rest = [p for p in params if p.dim() <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=LR, betas=(0.9, 0.95), eps=1e-8, fused=True)

    def step():
        loss = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return Side("plain", step, sum(p.numel() for p in params))
