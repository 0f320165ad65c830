"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Initialization is layout-free: every rank initializes the *full* weight from the same RNG
(`init_method` receives the full fp32 matrix) and keeps its contiguous block, so a model built
at any TP size from one seed holds the same full weights.

A weight may be `partition_blocks` equal blocks stacked along its TP dimension (a gated MLP's
gate rows, then its up rows): then each block is split over TP separately and a rank's shard is
its part of every block, in order, so the rank computes on contiguous halves (`tp_shard`,
`tp_unshard`; the checkpoint records the blocks, so its full tensors stay layout-free).
"""
from __future__ import annotations

import math
import os
from typing import Callable

import torch
from torch import nn

from megalite.parallel import state, tp_overlap, weight_grad
from megalite.parallel.fp8_linear import FP8Linear, amax_groups, fp8_linear
from megalite.parallel.grad_accumulation import embedding, linear
from megalite.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megalite.errors import UsageError

InitMethod = Callable[[torch.Tensor], object]
DEBUG_IDS_ENV = "MEGALITE_DEBUG_IDS"


class TokenIdError(UsageError):
    """An input token id the embedding table does not have (data from another tokenizer)."""


def normal_init(std: float = 0.02, generator: torch.Generator | None = None) -> InitMethod:
    """N(0, std) init; with `generator`, draws from it instead of the global RNG. A meta tensor
    (a shapes-only build) has nothing to draw and is left alone."""
    def init(w: torch.Tensor) -> torch.Tensor:
        return w if w.is_meta else w.normal_(0.0, std, generator=generator)
    return init


class XavierUniform:
    """Xavier/Glorot uniform init (Megatron-LM's --init-method-xavier-uniform): U(-a, a) with
    a = sqrt(6 / (fan_in + fan_out)) of the full matrix [out, in], or of each matrix of a stack
    [experts, out, in]; drawn from `generator` (else the global RNG). `fan_out` overrides the rows
    where the matrix is one part of a larger one (`part_of_rows`)."""

    def __init__(self, generator: torch.Generator | None = None, fan_out: int | None = None):
        self.generator, self.fan_out = generator, fan_out

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        if w.is_meta:
            return w
        bound = math.sqrt(6.0 / (w.shape[-1] + (self.fan_out or w.shape[-2])))
        return w.uniform_(-bound, bound, generator=self.generator)


def part_of_rows(init_method: InitMethod, rows: int) -> InitMethod:
    """`init_method` for a matrix that is part of one of `rows` rows (megalite's separate q and kv of
    Megatron-LM's one fused qkv): the same draws, with that matrix's fans where they matter."""
    return XavierUniform(init_method.generator, rows) if isinstance(init_method, XavierUniform) else init_method


def divide(numerator: int, denominator: int, what: str, by: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by {by} ({denominator}): choose sizes so that it divides"
        )
    return numerator // denominator


def pad_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Smallest size >= vocab_size divisible by multiple * tp (fast matmuls, even shards)."""
    step = multiple * tp
    return int(math.ceil(vocab_size / step) * step)


def init_device(device) -> torch.device:
    """Where full weights are generated: the target device when it is a GPU (the draws of a large
    stage take minutes on a CPU and seconds on a GPU), else the CPU. Either way every TP size draws
    the same full matrix, so layouts agree; a GPU-built model's draws are the GPU RNG's. A meta
    build (shapes only: the planner counts parameters that way) draws nothing."""
    device = torch.device(device if device is not None else "cpu")
    return device if device.type in ("cuda", "meta") else torch.device("cpu")


def tp_shard(full: torch.Tensor, dim: int, tp: int, rank: int, blocks: int = 1) -> torch.Tensor:
    """TP rank `rank`'s shard of `full` along `dim`: its contiguous block, or, with `blocks` > 1,
    its part of each of the `blocks` equal blocks, concatenated (a view when blocks == 1)."""
    if blocks == 1:
        return full.chunk(tp, dim=dim)[rank]
    return torch.cat([b.chunk(tp, dim=dim)[rank] for b in full.chunk(blocks, dim=dim)], dim=dim)


def tp_unshard(shards, dim: int, blocks: int = 1) -> torch.Tensor:
    """The inverse of `tp_shard`: the full tensor from every TP rank's shard, in rank order."""
    if blocks == 1:
        return torch.cat(list(shards), dim=dim)
    parts = [s.chunk(blocks, dim=dim) for s in shards]
    return torch.cat([p[b] for b in range(blocks) for p in parts], dim=dim)


def partition_blocks(p: torch.Tensor) -> int:
    """How many blocks a TP-sharded parameter stacks along its partition dimension (1: a plain shard)."""
    return getattr(p, "partition_blocks", 1)


def sharded_parameter(full_shape, shard_dim, init_method, dtype, device, real_rows=None,
                      blocks: int = 1) -> nn.Parameter:
    """Initialize the full matrix in fp32 (on `init_device`), keep this TP rank's shard (its
    contiguous block, or its part of each of `blocks` blocks). The init method's generator must
    live on that device (`megalite.models` builds it there)."""
    tp, rank = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()
    rows = full_shape[0] if real_rows is None else real_rows
    full = torch.zeros(full_shape, dtype=torch.float32, device=init_device(device))
    init_method(full[:rows])  # padding rows (vocab) stay zero whatever the padding is
    shard = tp_shard(full, shard_dim, tp, rank, blocks)
    param = nn.Parameter(shard.to(device=device, dtype=dtype).contiguous())
    param.tensor_model_parallel = True
    param.partition_dim = shard_dim
    if blocks > 1:
        param.partition_blocks = blocks
    return param


def default_device(device=None):
    """`device`, or where new modules go by default: the current GPU if there is one, else the CPU."""
    return device if device is not None else (torch.cuda.current_device() if torch.cuda.is_available() else "cpu")


def _per_rank(size: int, what: str) -> int:
    """`size` split evenly over the TP ranks; a ValueError naming both numbers when it does not split."""
    return divide(size, state.get_tensor_model_parallel_world_size(), what, "the tensor-parallel size")


class _ParallelLinear(nn.Module):
    """What the column- and row-parallel linear layers share: the full weight [output_size,
    input_size] initialized layout-free and sharded along `partition_dim` (0: output features,
    1: input features), and a bias of the weight shard's rows, sharded with them when they are."""

    def __init__(self, input_size: int, output_size: int, partition_dim: int, bias: bool,
                 init_method: InitMethod | None, sequence_parallel: bool, params_dtype: torch.dtype, device,
                 blocks: int = 1, tp_comm_overlap: bool = False, tp_comm_overlap_splits: int = 1):
        super().__init__()
        if tp_comm_overlap and not sequence_parallel:
            raise ValueError(f"{type(self).__name__}: tp_comm_overlap pipelines sequence parallelism's all-gather "
                             f"and reduce-scatter with the GEMM: it needs sequence_parallel=True")
        if tp_comm_overlap_splits < 1 or (tp_comm_overlap_splits > 1 and not sequence_parallel):
            raise ValueError(f"{type(self).__name__}: tp_comm_overlap_splits cuts each sequence shard's GEMM into "
                             f"that many pieces: it needs sequence_parallel=True and a value >= 1 "
                             f"(got {tp_comm_overlap_splits})")
        self.input_size, self.output_size = input_size, output_size
        self.sequence_parallel, self.tp_comm_overlap = sequence_parallel, tp_comm_overlap
        self.tp_comm_overlap_splits = tp_comm_overlap_splits
        self.partition_dim = partition_dim
        self.fp8: FP8Linear | None = None  # `use_fp8`: the GEMMs in FP8
        device = default_device(device)
        self.weight = sharded_parameter(
            (output_size, input_size), partition_dim, init_method or normal_init(), params_dtype, device,
            blocks=blocks,
        )
        if not bias:
            self.register_parameter("bias", None)
            return
        self.bias = nn.Parameter(torch.zeros(self.weight.shape[0], dtype=params_dtype, device=device))
        if partition_dim == 0:
            self.bias.tensor_model_parallel, self.bias.partition_dim = True, 0
            if blocks > 1:
                self.bias.partition_blocks = blocks
        else:
            # Added to a sequence shard, its gradient is partial per TP rank and must be summed.
            self.bias.sequence_parallel = sequence_parallel

    def use_fp8(self, recipe) -> None:
        """Run this layer's GEMMs in FP8 as `recipe` (a megalite.precision.Recipe) says; None: not."""
        self.fp8 = None if recipe is None else FP8Linear(recipe, amax_groups(("column", "row")[self.partition_dim]),
                                                          self.weight.device)

    def gemm(self, x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
             into_main_grad: bool = True) -> torch.Tensor:
        """This layer's GEMM alone, x W^T + bias, on an input already where the layer's forward puts
        it (for models that share one gathered input between layers, or use the weight gathered:
        `weight`); in FP8 when `use_fp8` gave a recipe."""
        weight = self.weight if weight is None else weight
        if self.fp8 is not None:
            return fp8_linear(x, weight, bias, self.fp8)
        return linear(x, weight, bias, into_main_grad=into_main_grad)

    def _per_shard(self) -> bool:
        """The forward's GEMMs run one sequence shard at a time, their collectives pipelined with them
        under `tp_comm_overlap` (megalite.parallel.tp_overlap; overlapped or not, the same GEMMs, so
        the same numbers), each shard in `tp_comm_overlap_splits` row pieces. FP8 GEMMs and compiled
        layers keep one GEMM over the whole sequence."""
        return (self.sequence_parallel and self.fp8 is None and not torch.compiler.is_compiling()
                and state.get_tensor_model_parallel_world_size() > 1)


class ColumnParallelLinear(_ParallelLinear):
    """Y = X A^T + b with A split by rows (output features) over TP ranks.

    Input is replicated across TP (or, with `sequence_parallel`, sharded along the sequence,
    dim 0, and all-gathered here). Output is this rank's slice of the features unless
    `gather_output`. `partition_blocks` > 1: the output features are that many equal blocks
    (gate, up), each split over TP, so this rank's output is its part of each block, in order.
    `tp_comm_overlap` (with `sequence_parallel`): the all-gather runs shard by shard beside the GEMM;
    `tp_comm_overlap_splits`: in that many pieces a shard.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False,
                 init_method: InitMethod | None = None, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None, partition_blocks: int = 1,
                 tp_comm_overlap: bool = False, tp_comm_overlap_splits: int = 1):
        output_size_per_partition = _per_rank(output_size, "output_size")
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output and sequence_parallel cannot be combined")
        if partition_blocks < 1 or output_size % (partition_blocks * state.get_tensor_model_parallel_world_size()):
            raise ValueError(f"ColumnParallelLinear: output_size ({output_size}) must split into {partition_blocks} "
                             f"blocks, each divisible by the tensor-parallel size")
        if gather_output and partition_blocks > 1:
            raise ValueError("ColumnParallelLinear: gather_output needs partition_blocks=1 (the gathered "
                             "features would interleave the blocks' parts)")
        super().__init__(input_size, output_size, 0, bias, init_method, sequence_parallel, params_dtype, device,
                         blocks=partition_blocks, tp_comm_overlap=tp_comm_overlap,
                         tp_comm_overlap_splits=tp_comm_overlap_splits)
        self.output_size_per_partition, self.gather_output = output_size_per_partition, gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._per_shard():
            return tp_overlap.gather_linear(x, self.weight, self.bias, self.tp_comm_overlap,
                                            pieces=self.tp_comm_overlap_splits)
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, output_grad_is_parallel=True)
        else:
            x = copy_to_tensor_model_parallel_region(x)
        y = self.gemm(x, bias=self.bias)
        return gather_from_tensor_model_parallel_region(y) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, out_per_rank={self.output_size_per_partition}"


class RowParallelLinear(_ParallelLinear):
    """Y = X A^T + b with A split by columns (input features) over TP ranks.

    Input is this rank's slice of the features (`input_is_parallel`) or is split here. The
    partial products are summed over TP (all-reduce, or reduce-scatter along the sequence with
    `sequence_parallel`); the whole bias is added once, after the sum. `tp_comm_overlap` (with
    `sequence_parallel`): the reduce-scatter runs shard by shard beside the GEMM;
    `tp_comm_overlap_splits`: in that many pieces a shard.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = True,
                 init_method: InitMethod | None = None, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None, tp_comm_overlap: bool = False,
                 tp_comm_overlap_splits: int = 1):
        input_size_per_partition = _per_rank(input_size, "input_size")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        super().__init__(input_size, output_size, 1, bias, init_method, sequence_parallel, params_dtype, device,
                         tp_comm_overlap=tp_comm_overlap, tp_comm_overlap_splits=tp_comm_overlap_splits)
        self.input_size_per_partition, self.input_is_parallel = input_size_per_partition, input_is_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x)
        if self._per_shard():
            y = tp_overlap.linear_reduce_scatter(x, self.weight, self.tp_comm_overlap,
                                                 pieces=self.tp_comm_overlap_splits)
            return y + weight_grad.defer_delivery(self.bias) if self.bias is not None else y
        y = self.gemm(x)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y)
        else:
            y = reduce_from_tensor_model_parallel_region(y)
        return y + weight_grad.defer_delivery(self.bias) if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in={self.input_size}, in_per_rank={self.input_size_per_partition}, out={self.output_size}"


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by rows (vocabulary) over TP ranks.

    `num_embeddings` is the table size, divisible by TP (use `pad_vocab_size`); rows from
    `num_real_embeddings` on are padding, initialized to zero. Each rank looks up the ids it
    owns, zeros the rest, and the partial results are summed over TP (reduce-scattered along
    dim 0, the sequence, with `sequence_parallel`, which expects ids shaped [seq, batch]).

    An id outside [0, num_real_embeddings) is a data error that tp>1 would hide (it looks up as
    zeros). `check_ids=True`, or MEGALITE_DEBUG_IDS=1 when `check_ids` is None, refuses it with
    an error naming the id; off by default: the check costs a reduction and a host sync a step.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        init_method: InitMethod | None = None,
        num_real_embeddings: int | None = None,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device=None,
        check_ids: bool | None = None,
    ):
        super().__init__()
        rank = state.get_tensor_model_parallel_rank()
        # Its gradient may go straight into the gradient buffer: lookups only (an untied table, or a
        # tied one on a stage without the output layer), or `tied_output` too (the output layer
        # multiplies by it in the same forward, through grad_accumulation.linear(tied=True)).
        self.fuse_weight_grad = False
        self.tied_output = False
        self.check_ids = os.environ.get(DEBUG_IDS_ENV, "") not in ("", "0") if check_ids is None else check_ids
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_real_embeddings = num_real_embeddings or num_embeddings
        if self.num_real_embeddings > num_embeddings:
            raise ValueError(
                f"num_real_embeddings ({self.num_real_embeddings}) exceeds num_embeddings ({num_embeddings})"
            )
        self.num_embeddings_per_partition = _per_rank(num_embeddings, "num_embeddings (vocabulary after padding)")
        self.vocab_start_index = rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.sequence_parallel = sequence_parallel
        self.weight = sharded_parameter(
            (num_embeddings, embedding_dim),
            0,
            init_method or normal_init(),
            params_dtype,
            default_device(device),
            real_rows=self.num_real_embeddings,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.check_ids:
            self._check_ids(ids)
        if state.get_tensor_model_parallel_world_size() > 1:
            outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
            local = (ids - self.vocab_start_index).masked_fill(outside, 0)
            out = embedding(local, self.weight, self.fuse_weight_grad, self.tied_output)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            out = embedding(ids, self.weight, self.fuse_weight_grad, self.tied_output)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out)
        return reduce_from_tensor_model_parallel_region(out)

    def _check_ids(self, ids: torch.Tensor) -> None:
        """Every TP rank holds all the ids, so each finds a bad one alone: no collective needed."""
        if ids.numel() == 0:
            return
        low, high = (int(v) for v in torch.stack(ids.aminmax()).tolist())  # one host sync
        bad = high if high >= self.num_real_embeddings else low if low < 0 else None
        if bad is not None:
            raise TokenIdError(f"token id {bad} is outside the vocabulary of {self.num_real_embeddings} ids "
                               f"(0..{self.num_real_embeddings - 1}): the data was made with another tokenizer; "
                               f"give the right --tokenizer or --vocab-size")

    def mask_padding_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Set, in place, the logit columns of padding rows of this rank's shard to -inf, so that
        padding never takes probability. `logits` [..., num_embeddings / tp]."""
        first_padding = self.num_real_embeddings - self.vocab_start_index
        if first_padding < self.num_embeddings_per_partition:
            logits[..., max(first_padding, 0):].fill_(float("-inf"))
        return logits

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows {self.vocab_start_index}:{self.vocab_end_index}"
