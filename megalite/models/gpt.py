"""GPT model for one pipeline stage: GPT-2 by default (learned positions, pre-LayerNorm, tanh-GELU
MLP, biases, input and output embeddings tied), the Llama family by config (rope, RMSNorm, SwiGLU,
grouped-query attention, no biases, an untied output layer)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from megalite.models.config import TransformerConfig
from megalite.models.documents import PackedDocuments
from megalite.models.embeddings import check_length
from megalite.models.language_model import LanguageModelStage
from megalite.models.mtp import MTPModule
from megalite.parallel import state
from megalite.parallel.context_parallel import context_parallel_positions
from megalite.parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.parallel.mappings import gather_from_sequence_parallel_region


class GPTModel(LanguageModelStage):
    """The part of a GPT that one pipeline stage holds.

    pre_process: this stage embeds tokens (the first stage); post_process: it holds the final
    norm and the output layer (the last stage). Tied (the default), the output weight is the word
    embedding: a last stage that is not also the first keeps its own copy, initialized
    identically, its gradient summed with the first stage's over the embedding group each step;
    untied, it is an `output_layer` of its own. `layer_numbers` are the global indices
    (0-based) of the layers held here; each layer's initialization depends on `seed` and its
    number only, so every split of the model holds the same weights.

    forward(input_ids [b, s], position_ids=None, attention_mask=None, labels=None) returns the
    per-token loss [b, s] (fp32) with labels, else logits [b, s, padded_vocab / tp] (padding
    columns -inf). A stage without pre_process reads its input from `set_input_tensor`; one
    without post_process returns hidden states [s, b, h].
    attention_mask: optional bool [b, 1, s, s], True = masked out, applied on top of causality; or
    `PackedDocuments` (megalite.models.documents): attention within each document packed into a
    sequence, and/or positions counted from each document's start (theirs are the position_ids).

    With `loss_mask` [b, s] too, it returns the summed losses [1 + D] (fp32): the main model's
    sum of per-token loss x loss_mask, then each multi-token prediction depth's (`mtp`, D =
    config.mtp_num_layers modules on the last stage; megalite.models.mtp), which read `mtp_labels`
    and `mtp_loss_mask` [b, s, D] (`with_mtp_targets`).

    With `inference_context` (a megalite.generation KVCache) it runs one step of generation instead
    (`generation_step`): the cache, not the modules, holds what earlier steps saw.
    """

    def __init__(self, config: TransformerConfig, pre_process: bool = True, post_process: bool = True,
                 layer_numbers: Sequence[int] | None = None, seed: int | None = None, device=None):
        super().__init__(config, pre_process, post_process, layer_numbers, seed, device)
        self.layers = self.build_layers()
        if post_process:
            self.final_layernorm = self.norm()
            if config.mtp_num_layers:
                self.mtp = nn.ModuleList(MTPModule(config, k, self._seed, self._device)
                                         for k in range(1, config.mtp_num_layers + 1))

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        s = input_ids.shape[1]  # this rank's tokens: with context parallelism, its share of each sequence
        cp = state.get_context_parallel_world_size()
        check_length(self.config, s * cp)
        x = self.word_embeddings(input_ids.t())  # [s, b, h], sequence-sharded under SP
        if self.position_embeddings is None:  # rope (positions 0..s-1 rotate q and k) or none
            if position_ids is not None:
                raise ValueError(f"position_ids need learned positions; this model's position_embedding_type is "
                                 f"{self.config.position_embedding_type} (positions are 0..s-1)")
            return self.embedding_dropout(x)
        if position_ids is None:  # made on the device: a copy from pageable host memory would sync
            device = input_ids.device
            positions = torch.arange(s, device=device) if cp == 1 else context_parallel_positions(
                s * cp, state.get_context_parallel_rank(), cp, device)
            position_ids = positions.unsqueeze(0).expand_as(input_ids)
        return self.embedding_dropout(self.add_replicated(x, self.position_embeddings(position_ids.t())))

    def embed_shifted(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        """Multi-token prediction's input: tokens further on, embedded as the first stage embeds (a last
        stage that is not also the first holds a copy of the word embedding; positions are rotary)."""
        if self.pre_process:
            return self.embed(input_ids, position_ids)
        return self.embedding_dropout(self.word_embeddings(input_ids.t()))

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, labels=None, loss_mask=None,
                mtp_labels=None, mtp_loss_mask=None, inference_context=None):
        if inference_context is not None:
            return self.generation_step(input_ids, inference_context)
        if isinstance(attention_mask, PackedDocuments):
            if position_ids is None and getattr(self, "position_embeddings", None) is not None:
                position_ids = attention_mask.position_ids  # learned positions; rope reads them in attention
        x = self.embed(input_ids, position_ids) if self.pre_process else self.received_input()
        if attention_mask is not None and not isinstance(attention_mask, PackedDocuments):
            s = attention_mask.shape[-1]
            causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
            attention_mask = ~attention_mask & causal  # SDPA's convention: True = attend
        x = self.run_layers(x, attention_mask)
        if not self.post_process:
            return x
        hidden = self.final_layernorm(x)
        logits = self.output_logits(hidden)
        if labels is None:
            return logits.transpose(0, 1)
        per_token = vocab_parallel_cross_entropy(logits, labels.t()).t()
        if loss_mask is None:
            return per_token
        sums = [(per_token * loss_mask).sum()]
        if self.config.mtp_num_layers:
            if mtp_labels is None or mtp_loss_mask is None:
                raise ValueError("a model with multi-token prediction needs mtp_labels and mtp_loss_mask with its "
                                 "loss_mask (megalite.models.mtp.with_mtp_targets makes them from the batch)")
            for k, module in enumerate(self.mtp, 1):  # depth k reads t_{i+k} and predicts t_{i+k+1}
                shifted = labels if k == 1 else mtp_labels[..., k - 2]
                hidden = module(hidden, self.embed_shifted(shifted, position_ids), attention_mask)
                per_token = vocab_parallel_cross_entropy(self.output_logits(hidden), mtp_labels[..., k - 1].t()).t()
                sums.append((per_token * mtp_loss_mask[..., k - 1]).sum())
        return torch.stack(sums)

    def generation_step(self, input_ids: torch.Tensor | None, cache) -> torch.Tensor:
        """One step of generation (megalite.generation): this step's tokens [b, s] (the first stage;
        others read set_input_tensor) run against `cache` (a KVCache: positions after the cached
        tokens, keys and values kept). Returns hidden states [s, b, h] (sequence-sharded under SP) on
        a stage without post_process, else logits [b, n, padded_vocab / tp] for the positions
        `cache.logits_positions()` picks (the last real token's, or all of them)."""
        if self.pre_process:
            positions = cache.position_ids() if self.position_embeddings is not None else None
            x = self.embed(input_ids, positions)
        else:
            x = self.received_input()
        x = self.run_layers(x, None, cache)
        if not self.post_process:
            return x
        hidden = self.final_layernorm(x)
        if self.config.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, output_grad_is_parallel=True)
        hidden = hidden[cache.logits_positions()]
        return self.output_logits(hidden, sequence_gathered=True).transpose(0, 1)
