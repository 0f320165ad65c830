"""GPT-2 model for one pipeline stage: learned positions, pre-LayerNorm, tanh-GELU MLP,
biases, input and output embeddings tied."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megalite.models.config import TransformerConfig
from megalite.models.transformer import TransformerLayer, hidden_dropout, init_generator, norm_layer, run_layers
from megalite.parallel import state
from megalite.parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.parallel.layers import VocabParallelEmbedding, default_device, init_device, normal_init, pad_vocab_size
from megalite.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

WORD_EMBEDDING_COMPONENT, POSITION_EMBEDDING_COMPONENT = 0, 1


class GPTModel(nn.Module):
    """The part of a GPT that one pipeline stage holds.

    pre_process: this stage embeds tokens (the first stage); post_process: it holds the final
    norm and the output layer (the last stage), whose weight is the word embedding: the last
    stage keeps its own copy, initialized identically, and its gradient is summed with the
    first stage's over the embedding group each step. `layer_numbers` are the global indices
    (0-based) of the layers held here; each layer's initialization depends on `seed` and its
    number only, so every split of the model holds the same weights.

    forward(input_ids [b, s], position_ids=None, attention_mask=None, labels=None) returns the
    per-token loss [b, s] (fp32) with labels, else logits [b, s, padded_vocab / tp] (padding
    columns -inf). A stage without pre_process reads its input from `set_input_tensor`; one
    without post_process returns hidden states [s, b, h].
    attention_mask: optional bool [b, 1, s, s], True = masked out, applied on top of causality.
    """

    def __init__(
        self,
        config: TransformerConfig,
        pre_process: bool = True,
        post_process: bool = True,
        layer_numbers: Sequence[int] | None = None,
        seed: int | None = None,
        device=None,
    ):
        super().__init__()
        tp = state.get_tensor_model_parallel_world_size()
        config.check_tensor_parallel(tp)
        self.config, self.pre_process, self.post_process = config, pre_process, post_process
        seed = torch.initial_seed() if seed is None else seed
        device = default_device(device)
        self.padded_vocab_size = pad_vocab_size(config.vocab_size, tp, config.make_vocab_size_divisible_by)
        self.layer_numbers = list(range(config.num_layers) if layer_numbers is None else layer_numbers)
        std, dtype, sp = config.init_method_std, config.params_dtype, config.sequence_parallel

        if pre_process or post_process:
            self.word_embeddings = VocabParallelEmbedding(
                self.padded_vocab_size, config.hidden_size,
                init_method=normal_init(std, init_generator(seed, WORD_EMBEDDING_COMPONENT, device)),
                num_real_embeddings=config.vocab_size, sequence_parallel=sp, params_dtype=dtype, device=device,
            )
            # Tied: its gradient is summed over the first and last stage (when they differ). The
            # copy on a last stage that is not also the first is the same weight, counted once.
            self.word_embeddings.weight.tied_embedding = True
            self.word_embeddings.weight.shared_embedding = not pre_process
        if pre_process:
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                    dtype=dtype, device=device)
            with torch.no_grad():
                full = torch.empty(self.position_embeddings.weight.shape, device=init_device(device))
                normal_init(std, init_generator(seed, POSITION_EMBEDDING_COMPONENT, device))(full)
                self.position_embeddings.weight.copy_(full)
        self.layers = nn.ModuleList(TransformerLayer(config, n, seed, device) for n in self.layer_numbers)
        if post_process:
            self.final_layernorm = norm_layer(config, device)
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Hidden states [s, b, h] received from the previous pipeline stage."""
        self.input_tensor = tensor

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        s = input_ids.shape[1]
        if s > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length ({s}) exceeds max_position_embeddings ({self.config.max_position_embeddings})"
            )
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand_as(input_ids)
        x = self.word_embeddings(input_ids.t())  # [s, b, h], sequence-sharded under SP
        pos = self.position_embeddings(position_ids.t())
        if self.config.sequence_parallel:
            pos = scatter_to_sequence_parallel_region(pos)
        return hidden_dropout(x + pos, self.config.hidden_dropout, self.training, self.config.sequence_parallel)

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[s, b, h] -> vocab-sharded logits [s, b, padded_vocab / tp], padding columns at -inf."""
        if self.config.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, output_grad_is_parallel=True)
        else:
            x = copy_to_tensor_model_parallel_region(x)
        logits = F.linear(x, self.word_embeddings.weight)
        self.word_embeddings.mask_padding_logits(logits)  # padding never wins
        return logits

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, labels=None):
        if self.pre_process:
            x = self.embed(input_ids, position_ids)
        else:
            if self.input_tensor is None:
                raise RuntimeError("a non-first pipeline stage needs set_input_tensor() before forward")
            x = self.input_tensor
        if attention_mask is not None:
            s = attention_mask.shape[-1]
            causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
            attention_mask = ~attention_mask & causal  # SDPA's convention: True = attend
        x = run_layers(self.layers, x, attention_mask, self.config, self.training)
        if not self.post_process:
            return x
        logits = self.output_logits(self.final_layernorm(x))
        if labels is None:
            return logits.transpose(0, 1)
        return vocab_parallel_cross_entropy(logits, labels.t()).t()
