"""One generation step through this rank's model chunks at any layout: tokens in on the first
pipeline stage, hidden states [tokens (/tp under SP), b, h] sent stage to stage, logits gathered
over TP on the last stage, and the token it picks broadcast to every stage.

Virtual stages run in order (chunk c of pipeline rank r runs virtual stage
`megalite.pipeline.partition.virtual_stage(pp, r, c, v_shape)`), each rank running the ones it
holds: no micro-batches, one batch a step. Under sequence parallelism (tensor-parallel MoE layers
need it) a step's tokens are padded at the end to a multiple of the TP size; the cache keeps the
real ones only (megalite.generation.cache).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.generation.cache import KVCache
from megalite.parallel import state
from megalite.parallel.mappings import gather_from_tensor_model_parallel_region
from megalite.pipeline import p2p
from megalite.pipeline.partition import stage_rank, virtual_stage


_STREAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def chunks_device(chunks) -> torch.device:
    """The device of this rank's weights; where its virtual stages hold none (a layout's empty stages),
    the rank's current device."""
    weight = next((p for chunk in chunks for p in chunk.parameters()), None)
    if weight is not None:
        return weight.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _stream_dtype(chunks, device: torch.device, pp: int) -> torch.dtype:
    """The hidden states' dtype between stages: fp32 under --fp32-residual-connection, else the weights'
    (not the config's params_dtype: a training run builds its model in fp32 and trains it in bf16). Over
    pipeline ranks it is agreed on once (a rank whose stages hold no weight, a layout's, takes the others')."""
    if chunks[0].config.fp32_residual_connection:
        return torch.float32
    mine = next((p.dtype for chunk in chunks for p in chunk.parameters()
                 if p.dtype.is_floating_point and p.dtype.itemsize >= 2), None)
    if pp == 1:
        return mine
    code = torch.tensor([_STREAM_DTYPES.index(mine) if mine is not None else -1], device=device)
    dist.all_reduce(code, op=dist.ReduceOp.MAX, group=state.get_pipeline_model_parallel_group())
    return _STREAM_DTYPES[int(code.item())]


class Stages:
    """This rank's model chunks and where they sit in the pipeline."""

    def __init__(self, model_chunks, v_shape: bool = False):
        self.chunks = list(model_chunks)
        if not self.chunks:
            raise ValueError("generation needs this rank's model chunks (none given)")
        self.config = self.chunks[0].config
        if state.get_context_parallel_world_size() > 1:
            raise ValueError("generation runs without context parallelism: drop --cp (the cache is per sequence)")
        self.pp, self.rank = state.get_pipeline_model_parallel_world_size(), state.get_pipeline_model_parallel_rank()
        self.v_shape, self.virtual = v_shape, len(self.chunks)
        self.by_stage = {virtual_stage(self.pp, self.rank, c, v_shape): chunk for c, chunk in enumerate(self.chunks)}
        self.last_stage = self.pp * self.virtual - 1
        self.last_rank = stage_rank(self.pp, self.last_stage, v_shape)
        self.tp = state.get_tensor_model_parallel_world_size()
        self.sequence_parallel = self.config.sequence_parallel and self.tp > 1
        self.vocab_size = self.config.vocab_size
        self.device = chunks_device(self.chunks)
        self.dtype = _stream_dtype(self.chunks, self.device, self.pp)

    @property
    def samples(self) -> bool:
        """Whether this rank holds the last stage (it has the logits)."""
        return self.rank == self.last_rank

    def _global(self, pipeline_rank: int) -> int:
        return state.get_pipeline_model_parallel_ranks()[pipeline_rank]

    def forward(self, ids: torch.Tensor | None, cache: KVCache, tokens: int) -> torch.Tensor | None:
        """This step's `tokens` new tokens of every row, ids [b, tokens] (every rank may pass them; the
        first stage reads them) -> logits [b, n, vocab] (fp32, whole vocabulary, padding cut) on the
        last stage's ranks, None elsewhere; n as `cache.logits_positions()` says."""
        padded = -(-tokens // self.tp) * self.tp if self.sequence_parallel else tokens
        if ids is not None and padded > tokens:
            ids = torch.nn.functional.pad(ids, (0, padded - tokens))
        cache.begin(padded, tokens)
        shape = (padded // self.tp if self.sequence_parallel else padded, cache.batch, self.config.hidden_size)
        x = None
        for vs in range(self.last_stage + 1):
            if stage_rank(self.pp, vs, self.v_shape) != self.rank:
                continue
            chunk = self.by_stage[vs]
            if not chunk.pre_process:
                before = stage_rank(self.pp, vs - 1, self.v_shape)
                if before != self.rank:
                    recv = p2p.Recv("hidden", self._global(before), p2p.FORWARD_TAG)
                    x = p2p.exchange([], [recv], shape, self.dtype, self.device)["hidden"]
                chunk.set_input_tensor(x)
            x = chunk(ids if chunk.pre_process else None, inference_context=cache)
            if not chunk.post_process:
                after = stage_rank(self.pp, vs + 1, self.v_shape)
                if after != self.rank:
                    p2p.exchange([p2p.Send(x, self._global(after), p2p.FORWARD_TAG)], [], None, None, None)
        cache.advance()
        if not self.samples:
            return None
        if self.tp > 1:
            x = gather_from_tensor_model_parallel_region(x.contiguous())
        return x[..., :self.vocab_size].float()

    def share(self, token: torch.Tensor | None, batch: int) -> torch.Tensor:
        """The last stage's token ids [b] on every rank of the pipeline."""
        if self.pp == 1:
            return token
        if token is None:
            token = torch.empty(batch, dtype=torch.long, device=self.device)
        return self.from_last_stage(token)

    def from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` as the last stage's ranks hold it, on every rank of the pipeline (the others pass
        a buffer of its shape and dtype)."""
        if self.pp > 1:
            dist.broadcast(tensor, self._global(self.last_rank), group=state.get_pipeline_model_parallel_group())
        return tensor
