"""--qk-clip: QK-clip (MuonClip, Kimi K2's; Megatron-Core's `clip_qk`), and --log-max-attention-logit.

After each update, a key group (every head under MLA, each its own) whose largest attention logit in
the step's forwards exceeded --qk-clip-threshold t has its query and key weights shrunk so that logit
would be t: with eta = t / max (1 where the max is t or less) and alpha = --qk-clip-alpha, the group's
query rows times eta^alpha and key rows times eta^(1 - alpha) (MLA: the heads' no-rope query rows times
eta^alpha and rope rows times eta, their no-rope key rows in kv_up times eta^(1 - alpha); the rope key,
shared by all heads, alone). Values, biases and the output projection stay. The maxima come from
megalite.models.max_logit, taken over data parallelism and gathered over tensor parallelism, so every
copy of a weight is clipped alike. As Megatron-Core's, it scales weights, not biases: with q/k biases
(--add-qkv-bias) the clipped logit stays somewhat above t. Refused with --qk-layernorm / --qk-l2-norm,
whose norms after the projections would undo it. The clip multiplies the fp32 masters after the
update and before they are published (cast, gathered); a step with inf/NaN gradients, which leaves
every weight as it was, clips nothing. No host sync: the factors are 1 where nothing is clipped.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megalite import parallel
from megalite.models.attention import ParallelAttention
from megalite.models.mla import MultiLatentAttention
from megalite.parallel import traffic


class QKClip:
    """The clip (or, `clip` False, only the max logit's record) over this rank's attention layers."""

    def __init__(self, chunks, optimizer, alpha: float, threshold: float, clip: bool):
        self.alpha, self.threshold, self.clip = alpha, threshold, clip
        self.layers = [m for chunk in chunks for m in chunk.modules()
                       if isinstance(m, (ParallelAttention, MultiLatentAttention))]
        self.pieces: dict[int, list] = {}
        for piece in optimizer.pieces:
            self.pieces.setdefault(id(piece.param), []).append(piece)
        device = optimizer.buffers[0].device if optimizer.buffers else torch.device("cpu")
        self.device = device
        self.largest = torch.full((), float("-inf"), device=device)  # the last step's, over this stage's layers
        self._reset()

    def _reset(self) -> None:
        for m in self.layers:
            m.max_logits = torch.full((m.heads_per_rank,), float("-inf"), device=self.device)

    def __call__(self, found_inf: torch.Tensor) -> None:
        """After the update, before the masters are published: clip (where the step was not skipped)."""
        if not self.layers:
            return
        local = torch.cat([m.max_logits for m in self.layers])
        dp = parallel.get_data_parallel_group(with_context_parallel=True)
        if dist.is_initialized() and dist.get_world_size(dp) > 1:
            traffic.counted_all_reduce("metrics", local, dp, op=dist.ReduceOp.MAX)
        tp = parallel.get_tensor_model_parallel_world_size()
        if tp > 1:  # every head's maximum on every TP rank (a key group's heads may sit on several)
            shards = [torch.empty_like(local) for _ in range(tp)]
            traffic.gather_or_scatter("metrics", local.nbytes * tp, tp)
            dist.all_gather(shards, local, group=parallel.get_tensor_model_parallel_group())
            every = torch.stack(shards)  # [tp, this rank's heads of every layer]
        else:
            every = local[None]
        self.largest = every.max()  # every head's, over this stage's layers
        if self.clip:
            offset = 0
            with torch.no_grad():
                for m in self.layers:
                    heads = every[:, offset:offset + m.heads_per_rank].reshape(-1)  # all the layer's heads
                    offset += m.heads_per_rank
                    self._clip(m, heads, found_inf)
        self._reset()

    def _eta(self, logits: torch.Tensor, found_inf: torch.Tensor) -> torch.Tensor:
        clip = torch.isfinite(logits) & (logits > self.threshold) & (found_inf == 0)
        return torch.where(clip, self.threshold / logits, torch.ones_like(logits))

    def _clip(self, m, heads: torch.Tensor, found_inf: torch.Tensor) -> None:
        a = self.alpha
        if isinstance(m, MultiLatentAttention):
            eta = self._eta(heads, found_inf)[:, None]  # [heads, 1]
            q = m.q if m.config.q_lora_rank is None else m.q_up
            self._scale(q.weight, torch.cat([eta.pow(a).expand(-1, m.nope), eta.expand(-1, m.rope)], 1))
            self._scale(m.kv_up.weight, torch.cat([eta.pow(1 - a).expand(-1, m.nope),
                                                   torch.ones_like(eta).expand(-1, m.v_dim)], 1))
            return
        d, groups = m.config.head_dim, m.config.num_query_groups or m.config.num_attention_heads
        eta = self._eta(heads.view(groups, -1).amax(1), found_inf)[:, None]  # [groups, 1]
        per_head = eta.repeat_interleave(heads.numel() // groups, dim=0)
        if hasattr(m, "qkv"):  # rows [heads, (q, k, v), d]
            ones = torch.ones_like(per_head)
            self._scale(m.qkv.weight, torch.cat([x.expand(-1, d) for x in (per_head.pow(a), per_head.pow(1 - a),
                                                                            ones)], 1))
            return
        self._scale(m.q.weight, per_head.pow(a).expand(-1, d))
        self._scale(m.kv.weight, torch.cat([eta.pow(1 - a).expand(-1, d), torch.ones_like(eta).expand(-1, d)], 1))

    def _scale(self, weight: torch.nn.Parameter, rows: torch.Tensor) -> None:
        """Multiply this rank's rows of `weight` (its block of the whole weight's, `rows` [.., ..] read
        row-major as one factor a row) in every master piece of it."""
        whole = rows.reshape(-1)
        tp = parallel.get_tensor_model_parallel_world_size()
        mine = whole.chunk(tp)[parallel.get_tensor_model_parallel_rank()] if tp > 1 else whole
        cols = weight.shape[1]
        for piece in self.pieces.get(id(weight), []):
            start = piece.buffer.param_range(weight)[0]
            lo, hi = piece.lo - start, piece.hi - start
            if lo == 0 and hi == weight.numel():  # a whole master: a factor a row, broadcast
                piece.master.view(-1, cols).mul_(mine[:, None])
            else:  # a ZeRO shard's run of elements: the factor of each one's row
                piece.master.view(-1).mul_(mine[torch.arange(lo, hi, device=mine.device) // cols])
