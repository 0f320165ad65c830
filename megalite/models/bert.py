"""BERT model for one pipeline stage: word, position and token-type embeddings, bidirectional
layers, a masked-LM head tied to the word embedding and a binary (next-sentence / sentence-order)
head on the first token.

With `layernorm_position="post"` and `activation="gelu"` (the `bert-*` presets) it is the BERT of
Devlin et al. 2019, computing what Hugging Face's `BertForPreTraining` computes; its weights map
one to one (ours <- theirs, under `bert.` / `cls.`):
    word_embeddings[:vocab], position_embeddings, tokentype_embeddings, embedding_layernorm
        <- embeddings.{word,position,token_type}_embeddings, embeddings.LayerNorm
    layers.i.attention.qkv   <- encoder.layer.i.attention.self.{query,key,value} stacked as rows
                                [head, (q, k, v), head_dim]
    layers.i.attention.proj, .post_attention_layernorm <- attention.output.dense, attention.output.LayerNorm
    layers.i.mlp.fc1, .mlp.fc2, .post_mlp_layernorm    <- intermediate.dense, output.dense, output.LayerNorm
    lm_dense, lm_layernorm, lm_bias[:vocab]            <- predictions.transform.{dense,LayerNorm}, predictions.bias
    pooler, binary_head                                <- pooler.dense, seq_relationship
With "pre" it is the pre-LayerNorm variant (no embedding norm, a final norm before the heads),
which trains stably when deep.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megalite.models.config import TransformerConfig
from megalite.models.embeddings import check_length
from megalite.models.language_model import LanguageModelStage
from megalite.models.mlp import activation_function
from megalite.models.rng import embedding_init, init_generator, init_replicated, weight_init
from megalite.parallel import state, weight_grad
from megalite.parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.parallel.grad_accumulation import embedding, linear
from megalite.parallel.mappings import gather_from_sequence_parallel_region
from megalite.errors import UsageError

# Generator components of BERT's own parts (0 and 1 are the word and position embeddings).
TOKENTYPE_EMBEDDING_COMPONENT, LM_HEAD_COMPONENT, POOLER_COMPONENT, BINARY_HEAD_COMPONENT = range(2, 6)


# Llama-family switches BERT does not take (its embeddings, heads and converter are the published
# BERT's); a UsageError (a ValueError) so that pretrain_bert.py ends in one line.
_GPT_ONLY = {  # field: (BERT's value, the flag that sets it)
    "position_embedding_type": ("learned_absolute", "--position-embedding-type"),
    "untie_embeddings_and_output_weights": (False, "--untie-embeddings-and-output-weights"),
    "num_query_groups": (None, "--group-query-attention --num-query-groups"),
    "gated_linear_unit": (False, "--swiglu, --quick-geglu"),
}


def _refuse_llama_switches(config: TransformerConfig) -> None:
    for field, (bert_value, flag) in _GPT_ONLY.items():
        if getattr(config, field) != bert_value:
            raise UsageError(f"BERTModel does not support {field}={getattr(config, field)!r} ({flag}): "
                             f"leave it at {bert_value!r}; these switches are for GPT models")


class BERTModel(LanguageModelStage):
    """The part of a BERT that one pipeline stage holds.

    pre_process: this stage embeds tokens (the first stage); post_process: it holds the heads
    (the last stage): the masked-LM head, whose output weight is the word embedding (the last
    stage keeps its own copy, initialized identically, its gradient summed with the first
    stage's over the embedding group each step), and with `add_binary_head` the pooler and the
    two-way classifier. `layer_numbers` are the global indices (0-based) of the layers held
    here; every component is initialized from `seed` and its own identity alone, so every TP
    size and pipeline split holds the same full weights. Attention is always bidirectional:
    the layers run with `config.causal` set to False whatever the given config says.

    forward(input_ids [b, s], token_type_ids=None, padding_mask=None, lm_labels=None,
    sop_labels=None). padding_mask: bool [b, s], True = a real token; padding is never attended
    to (a sample needs at least one real token). On the last stage, with lm_labels, returns
    (mlm_loss [b, s] fp32 per token, sop_loss [b] fp32 or None); weight mlm_loss with the
    masked positions, as labels elsewhere (e.g. -1) give finite meaningless values. Without
    labels returns (mlm_logits [b, s, padded_vocab / tp] with padding columns -inf, sop_logits
    [b, 2] or None). sop_loss / sop_logits are None without a binary head (and sop_loss without
    sop_labels). A stage without pre_process reads its input from `set_input_tensor`; one without
    post_process returns hidden states [s, b, h] (sequence-sharded under sequence parallelism).
    """

    def __init__(self, config: TransformerConfig, pre_process: bool = True, post_process: bool = True,
                 layer_numbers: Sequence[int] | None = None, seed: int | None = None, device=None,
                 num_tokentypes: int | None = None, add_binary_head: bool | None = None):
        # Unset: the config's (Megatron-LM's: two token types with the binary head, none without).
        add_binary_head = config.add_binary_head if add_binary_head is None else add_binary_head
        num_tokentypes = (2 if add_binary_head else 0) if num_tokentypes is None else num_tokentypes
        if num_tokentypes < 0:
            raise ValueError(f"num_tokentypes must be >= 0, got {num_tokentypes}")
        _refuse_llama_switches(config)
        config = config.replace(causal=False) if config.causal else config
        super().__init__(config, pre_process, post_process, layer_numbers, seed, device)
        self.num_tokentypes, self.add_binary_head = num_tokentypes, add_binary_head
        h, dtype = config.hidden_size, config.params_dtype
        post_norm = config.layernorm_position == "post"
        if pre_process:
            if num_tokentypes:
                self.tokentype_embeddings = self._replicated(
                    nn.Embedding(num_tokentypes, h, dtype=dtype, device=self._device), TOKENTYPE_EMBEDDING_COMPONENT)
            if post_norm:  # post-LN normalizes the embeddings; pre-LN leaves that to the first layer
                self.embedding_layernorm = self.norm()
        self.layers = self.build_layers()
        if post_process:
            if not post_norm:  # post-LN layers already end in a norm
                self.final_layernorm = self.norm()
            self._build_heads()

    def _replicated(self, module: nn.Module, component: int) -> nn.Module:
        generator = init_generator(self._seed, component, self._device)
        init = embedding_init if component == TOKENTYPE_EMBEDDING_COMPONENT else weight_init  # else a head's matrix
        return init_replicated(module, init(self.config, generator), self._device)

    def _build_heads(self) -> None:
        """Masked-LM head: dense + activation + norm per token, then logits through the word
        embedding plus a bias sharded over the vocabulary like the embedding's rows."""
        h, dtype, device = self.config.hidden_size, self.config.params_dtype, self._device
        self.lm_dense = self._replicated(nn.Linear(h, h, dtype=dtype, device=device), LM_HEAD_COMPONENT)
        for p in self.lm_dense.parameters():  # applied to a sequence shard under SP: partial grads
            p.sequence_parallel = self.config.sequence_parallel
        self.lm_layernorm = self.norm()
        tp = state.get_tensor_model_parallel_world_size()
        self.lm_bias = nn.Parameter(torch.zeros(self.padded_vocab_size // tp, dtype=dtype, device=device))
        self.lm_bias.tensor_model_parallel, self.lm_bias.partition_dim = True, 0
        if self.add_binary_head:  # on the first token, gathered whole to every rank: full grads
            self.pooler = self._replicated(nn.Linear(h, h, dtype=dtype, device=device), POOLER_COMPONENT)
            self.binary_head = self._replicated(nn.Linear(h, 2, dtype=dtype, device=device), BINARY_HEAD_COMPONENT)

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        s = input_ids.shape[1]
        check_length(self.config, s)
        x = self.word_embeddings(input_ids.t())  # [s, b, h], sequence-sharded under SP
        extra = self.position_embeddings(torch.arange(s, device=input_ids.device)).unsqueeze(1)  # [s, 1, h]
        if token_type_ids is not None:
            if not self.num_tokentypes:
                raise ValueError("token_type_ids given to a BERTModel built with num_tokentypes=0")
            extra = extra + embedding(token_type_ids.t(), self.tokentype_embeddings.weight)
        elif self.num_tokentypes:  # absent types are type 0, as in BERT
            extra = extra + weight_grad.defer_delivery(self.tokentype_embeddings.weight)[0]
        x = self.add_replicated(x, extra)  # [s, 1 or b, h]
        if self.config.layernorm_position == "post":
            x = self.embedding_layernorm(x)
        return self.embedding_dropout(x)

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden states [s, b, h] -> vocab-sharded logits [s, b, padded_vocab / tp], padding at -inf."""
        dense = linear(x, self.lm_dense.weight, self.lm_dense.bias)  # (W deferrable, like every weight)
        x = self.lm_layernorm(activation_function(self.config)(dense))
        return self.output_logits(x, self.lm_bias)

    def binary_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden states [s, b, h] -> [b, 2] from the first token, pooled by dense + tanh."""
        if self.config.sequence_parallel:
            # Each rank's first row; TP rank 0's is the sequence's first token. Every rank then
            # computes the same pooler, so the gradient is whole: split it, do not sum it.
            x = gather_from_sequence_parallel_region(x[:1], output_grad_is_parallel=False)
        pooled = torch.tanh(linear(x[0], self.pooler.weight, self.pooler.bias))
        return linear(pooled, self.binary_head.weight, self.binary_head.bias)

    def forward(self, input_ids=None, token_type_ids=None, padding_mask=None, lm_labels=None, sop_labels=None):
        if self.post_process and sop_labels is not None:
            if lm_labels is None:
                raise ValueError("sop_labels need lm_labels too: losses are returned together")
            if not self.add_binary_head:
                raise ValueError("sop_labels given to a BERTModel built with add_binary_head=False")
        x = self.embed(input_ids, token_type_ids) if self.pre_process else self.received_input()
        # Keys that are padding are masked for every query: [b, 1 (heads), 1 (queries), s (keys)].
        mask = None if padding_mask is None else padding_mask.to(torch.bool)[:, None, None, :]
        x = self.run_layers(x, mask)
        if not self.post_process:
            return x
        if self.config.layernorm_position == "pre":
            x = self.final_layernorm(x)
        logits = self.lm_logits(x)
        binary = self.binary_logits(x) if self.add_binary_head else None
        if lm_labels is None:
            return logits.transpose(0, 1), binary
        lm_loss = vocab_parallel_cross_entropy(logits, lm_labels.t()).t()
        sop_loss = None if sop_labels is None else F.cross_entropy(binary.float(), sop_labels, reduction="none")
        return lm_loss, sop_loss
