"""What one pipeline stage of a language model (GPT, BERT) holds apart from its heads: the word
embedding tied to the output logits (or an output layer of its own), the position embedding, this
stage's transformer layers, and the hidden states received from the previous stage."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from megalite.models.config import TransformerConfig
from megalite.models.embeddings import position_embedding
from megalite.models.norms import norm_layer
from megalite.models.rng import (OUTPUT_LAYER_COMPONENT, WORD_EMBEDDING_COMPONENT, embedding_init, hidden_dropout,
                                 init_generator, weight_init)
from megalite.models.transformer import TransformerLayer, run_layers
from megalite.parallel import state
from megalite.parallel.grad_accumulation import linear
from megalite.parallel.layers import VocabParallelEmbedding, default_device, pad_vocab_size
from megalite.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)


class LanguageModelStage(nn.Module):
    """The base of GPTModel and BERTModel, built for one pipeline stage.

    pre_process (the first stage) embeds tokens: `word_embeddings` and `position_embeddings`;
    post_process (the last stage) computes logits through the same word embedding, of which it
    keeps its own copy when it is not also the first stage (initialized identically; the weight is
    marked `tied_embedding`, and `shared_embedding` on that copy, so its gradient is summed over
    the embedding group and the weight counted once). `layer_numbers` are the global indices
    (0-based) of the layers held here; every component is initialized from `seed` and its own
    identity alone, so every TP size and pipeline split holds the same full weights.

    With `untie_embeddings_and_output_weights` the first stage alone holds `word_embeddings` and
    the last stage an `output_layer` [padded_vocab, h] of its own (vocab-parallel, drawn from its
    own component generator), nothing shared between them; with multi-token prediction the last
    stage also keeps a copy of `word_embeddings`, shared as a tied one is.

    A subclass adds its own modules after this constructor, in the order its parameters were
    always created, calling `build_layers()` where the layers go.
    """

    def __init__(self, config: TransformerConfig, pre_process: bool, post_process: bool,
                 layer_numbers: Sequence[int] | None, seed: int | None, device):
        super().__init__()
        tp = state.get_tensor_model_parallel_world_size()
        config.check_tensor_parallel(tp)
        self.config, self.pre_process, self.post_process = config, pre_process, post_process
        # Kept for the subclass's own components.
        self._seed = torch.initial_seed() if seed is None else seed
        self._device = default_device(device)
        self.padded_vocab_size = pad_vocab_size(config.vocab_size, tp, config.make_vocab_size_divisible_by)
        self.layer_numbers = list(range(config.num_layers) if layer_numbers is None else layer_numbers)
        if config.untie_embeddings_and_output_weights:
            # Multi-token prediction looks tokens up on the last stage: one that is not also the
            # first keeps a copy of the word embedding, summed with the first stage's as a tied one is.
            lookup_copy = config.mtp_num_layers > 0 and pre_process != post_process
            if pre_process or (post_process and lookup_copy):
                self.word_embeddings = self._vocab_parallel(WORD_EMBEDDING_COMPONENT)
                self.word_embeddings.fuse_weight_grad = True  # untied: looked up, never multiplied
                self.word_embeddings.weight.tied_embedding = lookup_copy
                self.word_embeddings.weight.shared_embedding = lookup_copy and not pre_process
            if post_process:
                self.output_layer = self._vocab_parallel(OUTPUT_LAYER_COMPONENT)
        elif pre_process or post_process:
            self.word_embeddings = self._tied_word_embedding()
        if pre_process:
            self.position_embeddings = position_embedding(config, self._seed, self._device)
        self.input_tensor: torch.Tensor | None = None

    def _vocab_parallel(self, component: int) -> VocabParallelEmbedding:
        """A [padded_vocab, h] table sharded by vocabulary rows, drawn from `component`'s generator: as an
        embedding (the word table, tied or not), or as a weight (the untied output layer)."""
        c = self.config
        init = embedding_init if component == WORD_EMBEDDING_COMPONENT else weight_init
        table = VocabParallelEmbedding(
            self.padded_vocab_size, c.hidden_size,
            init_method=init(c, init_generator(self._seed, component, self._device)),
            num_real_embeddings=c.vocab_size, sequence_parallel=c.sequence_parallel, params_dtype=c.params_dtype,
            device=self._device,
        )
        table.weight.is_embedding_or_output_parameter = True  # Megatron-LM's name: --decoupled-lr applies to it
        return table

    def _tied_word_embedding(self) -> VocabParallelEmbedding:
        embedding = self._vocab_parallel(WORD_EMBEDDING_COMPONENT)
        # Tied: its gradient is summed over the first and last stage (when they differ). The
        # copy on a last stage that is not also the first is the same weight, counted once.
        embedding.weight.tied_embedding = True
        embedding.weight.shared_embedding = not self.pre_process
        # Its gradient goes straight into the buffer: looked up here, multiplied here, or both
        # (then the two parts are summed as autograd sums them; see grad_accumulation).
        embedding.fuse_weight_grad = True
        embedding.tied_output = self.pre_process and self.post_process
        return embedding

    def build_layers(self) -> nn.ModuleList:
        return nn.ModuleList(TransformerLayer(self.config, n, self._seed, self._device) for n in self.layer_numbers)

    def norm(self) -> nn.Module:
        """A new norm over the hidden size, of the config's kind."""
        return norm_layer(self.config, self._device)

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Hidden states [s, b, h] received from the previous pipeline stage."""
        self.input_tensor = tensor

    def received_input(self) -> torch.Tensor:
        if self.input_tensor is None:
            raise RuntimeError("a non-first pipeline stage needs set_input_tensor() before forward")
        return self.input_tensor

    def add_replicated(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        """Word embeddings [s, b, h] (sequence-sharded under SP) plus `extra` [s, 1 or b, h], whole on
        every rank: under sequence parallelism each rank adds its slice of the sequence."""
        if self.config.sequence_parallel:
            extra = scatter_to_sequence_parallel_region(extra)
        return x + extra

    def embedding_dropout(self, x: torch.Tensor) -> torch.Tensor:
        """The embedded tokens as they enter the layers: in fp32 under --fp32-residual-connection (summed in
        the model's dtype first, then widened, as Megatron-LM does), dropped out."""
        if self.config.fp32_residual_connection:
            x = x.float()
        return hidden_dropout(x, self.config.hidden_dropout, self.training, self.config.sequence_parallel)

    def run_layers(self, x: torch.Tensor, attention_mask: torch.Tensor | None,
                   inference_context=None) -> torch.Tensor:
        return run_layers(self.layers, x, attention_mask, self.config, self.training, inference_context)

    def output_logits(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                      sequence_gathered: bool = False) -> torch.Tensor:
        """[s, b, h] -> vocab-sharded logits [s, b, padded_vocab / tp] through the output layer or the
        tied word embedding (plus a vocab-sharded `bias`), padding columns at -inf. `sequence_gathered`:
        x is whole along the sequence already (under sequence parallelism it is else this rank's part)."""
        if self.config.sequence_parallel and not sequence_gathered:
            x = gather_from_sequence_parallel_region(x, output_grad_is_parallel=True)
        else:
            x = copy_to_tensor_model_parallel_region(x)
        untied = self.config.untie_embeddings_and_output_weights
        output = self.output_layer if untied else self.word_embeddings
        logits = linear(x, output.weight, bias, into_main_grad=True, tied=output.tied_output)
        output.mask_padding_logits(logits)  # padding never wins
        return logits
