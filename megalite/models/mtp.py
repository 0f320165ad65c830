"""Multi-token prediction (MTP, DeepSeek-V3 arXiv 2412.19437 section 2.2): D sequential modules on
the last pipeline stage that each predict one token further ahead.

Depth k (1..D) at position i combines the previous depth's hidden state h^{k-1}_i (h^0: the main
model's output after its final norm) with the embedding of token t_{i+k}:
    h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])        (2h -> h, no bias)
    h^k  = final_layernorm_k(TransformerLayer_k(h'))
and predicts t_{i+k+1} through the main model's output head (the word embedding or the output layer,
shared). Its loss is the cross-entropy summed over the tokens whose target is real, divided by the
global batch's token count like the main loss (the paper's 1/T), and the training loss is
    main + mtp_loss_scaling_factor / D * (mtp_1 + ... + mtp_D),
each depth logged on its own as `mtp_k_loss`. The loss printed as `loss` stays the main model's.

The shifted tokens come with the batch (`with_mtp_targets`, before the sequence is split over
context parallelism), so nothing is rolled across ranks: position i reads t_{i+k} wherever it sits.
Under tensor parallelism eh_proj is column-parallel, its output gathered (and re-split along the
sequence under sequence parallelism) for the layer; the layer of depth k is the global layer
num_layers + k - 1 (its initialization, its MoE statistics), MoE when the model's last layer is.
"""
from __future__ import annotations

import torch
from torch import nn

from megalite.models.config import TransformerConfig
from megalite.models.norms import norm_layer
from megalite.models.rng import MTP_FIRST_COMPONENT, init_generator, weight_init
from megalite.models.transformer import TransformerLayer, run_layers
from megalite.parallel.layers import ColumnParallelLinear
from megalite.parallel.mappings import gather_from_tensor_model_parallel_region, scatter_to_sequence_parallel_region


def mtp_term_names(depth: int) -> tuple[str, ...]:
    """The logged loss terms of `depth` MTP modules."""
    return tuple(f"mtp_{k}_loss" for k in range(1, depth + 1))


class MTPModule(nn.Module):
    """Depth k of multi-token prediction: the two norms, the projection and one transformer layer
    (and the norm before the shared output head)."""

    def __init__(self, config: TransformerConfig, depth: int, seed: int, device):
        super().__init__()
        self.config = config
        self.enorm = norm_layer(config, device)
        self.hnorm = norm_layer(config, device)
        h = config.hidden_size
        init = weight_init(config, init_generator(seed, MTP_FIRST_COMPONENT + depth - 1, device))
        # Under SP its input is gathered along the sequence here and its output re-split below.
        self.eh_proj = ColumnParallelLinear(2 * h, h, bias=False, gather_output=not config.sequence_parallel,
                                            init_method=init, sequence_parallel=config.sequence_parallel,
                                            params_dtype=config.params_dtype, device=device,
                                            **config.tp_comm_options())
        self.layer = TransformerLayer(config, config.num_layers + depth - 1, seed, device)
        self.final_layernorm = norm_layer(config, device)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, attention_mask) -> torch.Tensor:
        """h^{k-1} [s, b, h] and the embedded tokens t_{i+k} [s, b, h] (both sequence-sharded under SP)
        -> h^k [s, b, h], normed."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        if self.config.sequence_parallel:  # [s, b, h / tp] -> the whole features, this rank's tokens
            x = scatter_to_sequence_parallel_region(gather_from_tensor_model_parallel_region(x))
        x = run_layers([self.layer], x, attention_mask, self.config, self.training)
        return self.final_layernorm(x)


class _SameGradient(torch.autograd.Function):
    """`main` unchanged; backward sends its gradient to `extra` too: gradients of main + extra,
    the value of main alone."""

    @staticmethod
    def forward(ctx, main, extra):
        return main.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


def with_mtp_gradient(main_loss: torch.Tensor, mtp_loss_sums: torch.Tensor, scaling_factor: float) -> torch.Tensor:
    """The main summed loss, trained as main + scaling_factor / D * (sum of the D depths' sums)."""
    depth = mtp_loss_sums.numel()
    return _SameGradient.apply(main_loss, mtp_loss_sums.sum() * (scaling_factor / depth))


def with_mtp_targets(batch: dict, depth: int) -> dict:
    """A GPT batch with what `depth` MTP modules read, made from whole sequences: `mtp_labels`
    [b, s, depth], column k-1 the labels k positions further on (t_{i+k+1}; zeros past the end), and
    `mtp_loss_mask` [b, s, depth], the loss mask moved likewise (zeros past the end)."""
    labels, mask = batch["labels"], batch["loss_mask"]
    s = labels.shape[1]
    if depth >= s:
        raise ValueError(f"--mtp-num-layers {depth} predicts beyond the sequence of {s} tokens: use fewer MTP layers")
    shifted_labels = labels.new_zeros(*labels.shape, depth)
    shifted_mask = mask.new_zeros(*mask.shape, depth)
    for k in range(1, depth + 1):
        shifted_labels[:, :s - k, k - 1] = labels[:, k:]
        shifted_mask[:, :s - k, k - 1] = mask[:, k:]
    return {**batch, "mtp_labels": shifted_labels, "mtp_loss_mask": shifted_mask}


class WithMTPTargets:
    """A GPT dataset whose batches carry multi-token prediction's targets (`with_mtp_targets`);
    every other attribute is the dataset's."""

    def __init__(self, dataset, depth: int):
        self.dataset, self.depth = dataset, depth

    def batch(self, sample_indices: range) -> dict:
        return with_mtp_targets(self.dataset.batch(sample_indices), self.depth)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name):
        return getattr(self.dataset, name)
