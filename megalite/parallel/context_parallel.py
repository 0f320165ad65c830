"""Context parallelism: attention over a sequence split across the ranks of a context-parallel group.

Causal load balancing: the sequence is cut into 2N chunks (N = CP size) and CP rank i holds chunks i
and 2N-1-i, concatenated, so under a causal mask every rank attends to the same number of keys.

Two ways to attend (docs/context-parallel.md):
- `ring_attention` (p2p): keys and values travel around the ring of `ranks`, the next block's
  exchange in flight while the current block is computed; partial outputs merge with an online
  softmax in fp32. The backward pass walks the same ring; dK/dV travel back to their owner.
- `a2a_attention` (DeepSpeed-Ulysses style; megalite.parallel.context_parallel_a2a): all-to-all
  trades the sequence split for a head split, plain causal attention on the whole sequence,
  all-to-all back.
- both (`--cp-comm-type a2a+p2p`; megalite.parallel.context_parallel_hierarchy): the all-to-all
  inside groups of consecutive CP ranks, then this ring across them.
Every collective takes the CP group explicitly; `ranks` are its global ranks, CP rank 0 first.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from megalite.parallel import lanes, traffic

# Tags keep the two kinds of ring message apart when next and previous rank coincide (cp = 2).
_KV_TAG, _GRAD_TAG = 100, 200


# ---------------------------------------------------------------------------------------------
# causal load balancing


def _check_divisible(seq_len: int, cp_size: int) -> None:
    if seq_len % (2 * cp_size):
        raise ValueError(f"context parallelism cuts the sequence into 2 x cp = {2 * cp_size} chunks, but the "
                         f"sequence length {seq_len} is not divisible by {2 * cp_size}: choose a sequence length "
                         f"that is a multiple of {2 * cp_size} or a smaller --cp")


def context_parallel_positions(seq_len: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions (int64, length seq_len / cp_size) of CP rank `cp_rank`'s tokens: chunks cp_rank
    and 2 cp_size - 1 - cp_rank of a sequence of `seq_len` tokens, in the order the rank holds them
    (made on `device`: no copy from the host)."""
    _check_divisible(seq_len, cp_size)
    chunk = seq_len // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)])


def split_for_context_parallel(x: torch.Tensor, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """CP rank `cp_rank`'s share of x along `dim` (the whole sequence): its two chunks, concatenated."""
    if cp_size == 1:
        return x
    _check_divisible(x.shape[dim], cp_size)
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


def _rank_order(seq_len: int, cp_size: int) -> torch.Tensor:
    """Global position of each token when the ranks' shares are concatenated in CP-rank order."""
    return torch.cat([context_parallel_positions(seq_len, r, cp_size) for r in range(cp_size)])


def gather_from_context_parallel(shares: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of `split_for_context_parallel`: every CP rank's share (CP-rank order) -> the whole
    sequence along `dim` in global order."""
    joined = torch.cat(shares, dim=dim)
    order = _rank_order(joined.shape[dim], len(shares)).to(joined.device)
    return joined.index_select(dim, torch.argsort(order))


# ---------------------------------------------------------------------------------------------
# one block of attention, forward and backward, in fp32 (grouped-query: q [b, g, r, s, d], k/v [b, g, s, d])


def _block_forward(q, k, v, scale, causal, allowed=None):
    """(output [b, g, r, sq, d], log-sum-exp [b, g, r, sq]) of q against one key/value block; `allowed`
    [b, 1, 1, sq, sk] (True = attend) masks it further. A query that sees no key of the block gets
    output 0 and log-sum-exp -inf (nothing to merge)."""
    scores = _masked_scores(q, k, scale, causal, allowed)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    return torch.einsum("bgrqk,bgkd->bgrqd", probs, v), lse


def _masked_scores(q, k, scale, causal, allowed, offset=0):
    scores = torch.einsum("bgrqd,bgkd->bgrqk", q, k) * scale
    if causal:
        scores = scores.masked_fill(_future(scores, offset), float("-inf"))
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (a query that saw no key yet) as 0, so exp(x - lse) stays 0 instead of NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def _block_backward(q, k, v, d_out, lse, delta, scale, causal, allowed=None, offset=0):
    """(dq, dk, dv) of one block, its probabilities recomputed from the final log-sum-exp; under
    `causal`, query row i is key `offset + i` (rows from the middle of the diagonal block)."""
    scores = _masked_scores(q, k, scale, causal, allowed, offset)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    dv = torch.einsum("bgrqk,bgrqd->bgkd", probs, d_out)
    d_probs = torch.einsum("bgrqd,bgkd->bgrqk", d_out, v)
    d_scores = probs * (d_probs - delta.unsqueeze(-1))
    dq = torch.einsum("bgrqk,bgkd->bgrqd", d_scores, k) * scale
    dk = torch.einsum("bgrqk,bgrqd->bgkd", d_scores, q) * scale
    return dq, dk, dv


def _future(scores: torch.Tensor, offset: int = 0) -> torch.Tensor:
    sq, sk = scores.shape[-2:]
    return torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(1 + offset)


def _merge(out, lse, block_out, block_lse):
    """Online softmax: two partial results over disjoint keys -> their combination (fp32)."""
    new_lse = torch.logaddexp(lse, block_lse)
    safe = _finite(new_lse)  # both -inf: neither part has a key yet
    merged = out * torch.exp(lse - safe).unsqueeze(-1) + block_out * torch.exp(block_lse - safe).unsqueeze(-1)
    return merged, new_lse


def _with_sink(out, lse, sink):
    """(output, log-sum-exp) once an attention sink joins the finished online softmax: sink logits
    [1, g, r, 1] as one more key of value zero. out * exp(lse - lse') = out * sigmoid(lse - s)."""
    total = torch.logaddexp(lse, sink.float())
    return out * torch.exp(lse - total).unsqueeze(-1), total


def _sink_grad(lse, delta, sink):
    """d s [g, r] from the sink-inclusive lse and delta = rowsum(dO * O) [b, g, r, sq]: the sink's
    probability times (its value's gradient, 0, minus delta), summed over batch and queries."""
    return -(torch.exp(sink.float() - lse) * delta).sum(dim=(0, 3))


def _block_plan(my_rank: int, owner: int, local_len: int, causal: bool):
    """(query rows, key rows, causal diagonal?) this rank attends to in the key/value block of CP rank
    `owner`. Under the causal mask with load-balanced chunks: the own block is the diagonal; an earlier
    rank's block is seen by all queries but only its first chunk; a later rank's block by the second
    chunk of queries only, wholly. Each is half the diagonal's work, so ranks stay in step."""
    whole, half = slice(0, local_len), local_len // 2
    if not causal:
        return whole, whole, False
    if owner == my_rank:
        return whole, whole, True
    if owner < my_rank:
        return whole, slice(0, half), False
    return slice(half, local_len), whole, False


# ---------------------------------------------------------------------------------------------
# ring point-to-point


def _start_exchange(send: torch.Tensor, recv: torch.Tensor, next_rank: int, prev_rank: int, group, tag: int):
    """Send `send` to the next rank of the ring and receive into `recv` from the previous one, without
    waiting: returns the requests. Every ring message goes through here (tests count bytes on it)."""
    # the receive first: on gloo a receive posted after a send waits behind its bytes (pipeline.p2p)
    ops = [dist.P2POp(dist.irecv, recv, prev_rank, group, tag), dist.P2POp(dist.isend, send, next_rank, group, tag)]
    traffic.send("cp", send.nbytes)
    return dist.batch_isend_irecv(ops)


def _wait(requests) -> None:
    lanes.wait_all(requests, "cp")


class _Ring:
    """This rank's place in the ring: CP rank, size, neighbours (global ranks) and the group."""

    def __init__(self, group, ranks):
        self.group, self.ranks = group, list(ranks)
        self.size = len(self.ranks)
        if self.size > 1 and dist.get_rank() not in self.ranks:
            raise ValueError(f"rank {dist.get_rank()} is not in the context-parallel ranks {self.ranks}: pass the "
                             f"global ranks of this rank's own CP group (state.get_context_parallel_ranks())")
        self.rank = self.ranks.index(dist.get_rank()) if self.size > 1 else 0
        self.next = self.ranks[(self.rank + 1) % self.size]
        self.prev = self.ranks[(self.rank - 1) % self.size]

    def owner(self, step: int) -> int:
        """CP rank whose key/value block this rank holds at `step` (blocks move to the next rank)."""
        return (self.rank - step) % self.size


def _grouped_sink(sink: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-head sinks [heads] as [1, groups, heads / groups, 1], against the grouped lse [b, g, r, s]."""
    return sink.view(1, groups, -1, 1)


def _grouped(q: torch.Tensor, groups: int) -> torch.Tensor:
    """q [b, heads, s, d] -> [b, groups, heads / groups, s, d] (query heads of a group are adjacent)."""
    b, heads, s, d = q.shape
    return q.reshape(b, groups, heads // groups, s, d)


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, ring, causal, scale, query_starts, live, window_left, sink):
        kv = torch.stack([k, v]).contiguous()  # one message per step; the KV groups only
        qg = _grouped(q, k.shape[1]).float()
        local = q.shape[2]
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(ring.size):
            incoming = torch.empty_like(kv) if step < ring.size - 1 else None
            requests = _start_exchange(kv, incoming, ring.next, ring.prev, ring.group, _KV_TAG + step) \
                if incoming is not None else None
            rows, keys, diagonal = _block_plan(ring.rank, ring.owner(step), local, causal)
            if live is None or live[step]:  # a block no query may attend adds nothing: merging it changes no bit
                allowed = _block_allowed(query_starts, window_left, ring, step, rows, keys, local, q.device)
                block_k, block_v = kv[0, :, :, keys].float(), kv[1, :, :, keys].float()
                block_out, block_lse = _block_forward(qg[:, :, :, rows], block_k, block_v, scale,
                                                      diagonal and allowed is None, allowed)
                out[:, :, :, rows], lse[:, :, :, rows] = _merge(out[:, :, :, rows], lse[:, :, :, rows], block_out,
                                                                block_lse)
            _wait(requests)
            kv = incoming
        if sink is not None:  # the sink joins once every block has: the backward reads the final lse
            out, lse = _with_sink(out, lse, _grouped_sink(sink, k.shape[1]))
        result = out.reshape(q.shape).to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse, sink)
        ctx.ring, ctx.causal, ctx.scale, ctx.query_starts, ctx.live = ring, causal, scale, query_starts, live
        ctx.window_left = window_left
        return result

    @staticmethod
    def backward(ctx, d_result):
        """The ring again, with both transfers behind compute: the own (diagonal) block's backward is
        cut in two halves of its query rows. The first runs while the first K/V block arrives, the
        second while the last dK/dV block travels home, which otherwise had nothing to hide behind."""
        q, k, v, result, lse, sink = ctx.saved_tensors
        ring, causal, scale, query_starts, live = ctx.ring, ctx.causal, ctx.scale, ctx.query_starts, ctx.live
        window_left = ctx.window_left
        groups, local = k.shape[1], q.shape[2]
        qg = _grouped(q, groups).float()
        d_out = _grouped(d_result, groups).float()
        delta = (d_out * _grouped(result, groups).float()).sum(-1)  # rowsum(dO * O)
        dq = torch.zeros_like(qg)
        own_kv = kv = torch.stack([k, v]).contiguous()
        own_dkv = torch.zeros((2,) + k.shape, dtype=torch.float32, device=k.device)

        def block(step, block_kv, rows, keys, diagonal, offset=0):
            """This block's dq added into dq's `rows`; returns its (dK, dV) for key rows `keys` (fp32)."""
            allowed = _block_allowed(query_starts, window_left, ring, step, rows, keys, local, q.device)
            block_dq, block_dk, block_dv = _block_backward(
                qg[:, :, :, rows], block_kv[0, :, :, keys].float(), block_kv[1, :, :, keys].float(),
                d_out[:, :, :, rows], lse[:, :, :, rows], delta[:, :, :, rows], scale, diagonal and allowed is None,
                allowed, offset)
            dq[:, :, :, rows] += block_dq
            return block_dk, block_dv

        _, own_keys, own_diagonal = _block_plan(ring.rank, ring.rank, local, causal)

        def own_half(part):
            rows = slice(0, local // 2) if part == 0 else slice(local // 2, local)
            if live is None or live[0]:
                dk, dv = block(0, own_kv, rows, own_keys, own_diagonal, offset=rows.start)
                own_dkv[0, :, :, own_keys] += dk
                own_dkv[1, :, :, own_keys] += dv

        travelling, grad_requests = None, None  # dK/dV of the block held, on its way back to its owner
        for step in range(ring.size):
            incoming = torch.empty_like(kv) if step < ring.size - 1 else None
            requests = _start_exchange(kv, incoming, ring.next, ring.prev, ring.group, _KV_TAG + step) \
                if incoming is not None else None
            if step == 0:
                own_half(0)  # the own block's first query rows: behind the first K/V block's arrival
            else:
                rows, keys, diagonal = _block_plan(ring.rank, ring.owner(step), local, causal)
                dkv = torch.zeros((2,) + k.shape, dtype=torch.float32, device=k.device)
                if live is None or live[step]:  # a masked block's gradients are zeros: they still travel home
                    dkv[0, :, :, keys], dkv[1, :, :, keys] = block(step, kv, rows, keys, diagonal)
                _wait(grad_requests)
                if travelling is not None:
                    dkv += travelling
                travelling = torch.empty_like(dkv)
                grad_requests = _start_exchange(dkv, travelling, ring.next, ring.prev, ring.group, _GRAD_TAG + step)
            _wait(requests)
            kv = incoming
        own_half(1)  # the own block's last query rows: behind the last dK/dV block's trip home
        if ring.size > 1:
            _wait(grad_requests)
            own_dkv += travelling  # every other rank's part of this rank's dK/dV
        dq = dq.reshape(q.shape).to(q.dtype)
        d_sink = None  # this rank's queries' share: summed over CP with the other weights' gradients
        if sink is not None and ctx.needs_input_grad[9]:  # (off-by-one's zero needs none)
            d_sink = _sink_grad(lse, delta, _grouped_sink(sink, groups)).reshape(sink.shape).to(sink.dtype)
        return dq, own_dkv[0].to(k.dtype), own_dkv[1].to(v.dtype), None, None, None, None, None, None, d_sink


def live_blocks(bounds: torch.Tensor, ring_rank: int, ring_size: int, local: int) -> list[bool]:
    """Per ring step, whether any query this rank holds may attend a key of the block it holds then,
    documents packed into the sequence with boundaries `bounds` (host int64, every row's over b x the
    whole sequence, rows one after the other: megalite.data.documents.document_bounds). Worked out
    on the host from the bounds alone: no device work, no sync. A query at position p of a document
    starting at s sees a key range [a, e] iff max(s, a) <= min(p, e)."""
    whole = local * ring_size
    bounds = bounds.to(torch.int64)
    rows = int(bounds[-1]) // whole
    starts = torch.repeat_interleave(bounds[:-1] % whole, bounds[1:] - bounds[:-1]).view(rows, whole)
    q_pos = context_parallel_positions(whole, ring_rank, ring_size)
    q_start = starts[:, q_pos]  # [b, local]
    live = []
    for step in range(ring_size):
        owner = (ring_rank - step) % ring_size
        rows_seen, keys, _ = _block_plan(ring_rank, owner, local, True)
        # A rank holds two chunks of local / 2 positions, each contiguous: one key range per chunk.
        ranges = context_parallel_positions(whole, owner, ring_size)[keys].split(local // 2)
        p, s = q_pos[rows_seen], q_start[:, rows_seen]
        live.append(any(bool((s.clamp_min(int(k[0])) <= p.clamp_max(int(k[-1]))).any()) for k in ranges))
    return live


@functools.lru_cache(maxsize=64)  # the same for every windowed layer of a shape: worked out once
def window_live_blocks(ring_rank: int, ring_size: int, local: int, left: int) -> tuple[bool, ...]:
    """Per ring step, whether any query this rank holds has a key of the block it holds then within a
    sliding window of `left` earlier positions (causal). From the chunks' position ranges alone: a
    query range [q0, q1] and a key range [k0, k1] meet iff q1 - k0 >= 0 and q0 - k1 <= left."""
    whole, half = local * ring_size, local // 2
    q_pos = context_parallel_positions(whole, ring_rank, ring_size)
    live = []
    for step in range(ring_size):
        owner = (ring_rank - step) % ring_size
        rows, keys, _ = _block_plan(ring_rank, owner, local, True)
        k_pos = context_parallel_positions(whole, owner, ring_size)[keys]  # one or two contiguous chunks
        live.append(any(int(q[-1]) >= int(k[0]) and int(q[0]) - int(k[-1]) <= left
                        for q in q_pos[rows].split(half) for k in k_pos.split(half)))
    return tuple(live)


def _block_allowed(query_starts, window_left, ring: _Ring, step: int, rows: slice, keys: slice, local: int, device):
    """[b or 1, 1, 1, queries, keys] True where a query of `rows` may attend a key of `keys` in the block of
    CP rank ring.owner(step): an earlier (or the same) position, no more than `window_left` back where
    the layer has a sliding window, of its own document, which starts at `query_starts` [b, s_local]
    (global positions). None with neither (the block plan's causal diagonal says all)."""
    if query_starts is None and window_left is None:
        return None
    whole = local * ring.size
    q_pos = context_parallel_positions(whole, ring.rank, ring.size, device)[rows]
    k_pos = context_parallel_positions(whole, ring.owner(step), ring.size, device)[keys]
    back = q_pos[:, None] - k_pos[None, :]  # [queries, keys]: how far back each key is
    allowed = (back >= 0 if window_left is None else (back >= 0) & (back <= window_left))[None]
    if query_starts is not None:
        allowed = allowed & (k_pos[None, None, :] >= query_starts[:, rows, None])
    return allowed[:, None, None]


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"attention expects q [b, heads, s, d] and k, v [b, groups, s, d] alike; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not divide into {k.shape[1]} KV groups: "
                         f"choose a number of query heads that is a multiple of the KV groups")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, ranks, causal: bool = True,
                   softmax_scale: float | None = None, query_starts: torch.Tensor | None = None,
                   document_bounds: torch.Tensor | None = None, window_left: int | None = None,
                   sink: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of this rank's tokens against the whole sequence, keys and values passed around the
    ring of `ranks` (global ranks of `group`, CP rank 0 first). q [b, heads, s_local, d], k and v
    [b, groups, s_local, d] hold this rank's load-balanced share (`split_for_context_parallel`);
    returns [b, heads, s_local, d] in q's dtype. Accumulates in fp32; differentiable.
    `query_starts` [b, s_local] (causal only): the global position where each query's document
    starts, for documents packed into one sequence; a query then attends only within its own.
    `document_bounds` (host, with query_starts): their boundaries, from which blocks that no query
    may attend are found and skipped (`live_blocks`); without them every block is computed.
    `window_left` (causal only): a sliding window, each query attending to itself and that many keys
    before it; blocks wholly outside it are skipped (`window_live_blocks`). `sink` [heads]: attention
    sinks' logits (megalite.models.softmax_sink), added to the merged log-sum-exp."""
    _check_shapes(q, k, v)
    ring = _Ring(group, ranks)
    if causal and q.shape[2] % 2:
        raise ValueError(f"causal context parallelism holds two chunks per rank, but this rank holds "
                         f"{q.shape[2]} tokens (odd): make the sequence length a multiple of 2 x cp = {2 * ring.size}")
    if (query_starts is not None or window_left is not None) and not causal:
        raise ValueError("packed documents and sliding windows are attended causally here: drop query_starts and "
                         "window_left, or use causal")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    live = None
    if query_starts is not None and document_bounds is not None and ring.size > 1:
        # The same for every layer of the micro-batch: worked out once, kept on its bounds tensor.
        memo = document_bounds.__dict__.setdefault("_megalite_live_blocks", {})
        key = (ring.rank, ring.size, q.shape[2])
        if key not in memo:
            memo[key] = live_blocks(document_bounds, *key)
        live = memo[key]
    if window_left is not None and ring.size > 1:  # a block some query sees on both counts may be live
        in_window = window_live_blocks(ring.rank, ring.size, q.shape[2], window_left)
        live = in_window if live is None else [a and b for a, b in zip(live, in_window)]
    return _RingAttention.apply(q, k, v, ring, causal, scale, query_starts, live, window_left, sink)


# ---------------------------------------------------------------------------------------------
# traffic


def ring_bytes_per_layer(batch: int, kv_groups: int, local_seq: int, head_dim: int, cp_size: int,
                         element_size: int = 4, grad_element_size: int = 4) -> dict[str, int]:
    """Bytes one rank sends for one attention layer with `ring_attention`: forward, N-1 K/V blocks of
    2 b groups s_local d elements; backward, the K/V blocks again plus N-1 dK/dV blocks (fp32)."""
    block = 2 * batch * kv_groups * local_seq * head_dim
    steps = cp_size - 1
    forward = steps * block * element_size
    backward = steps * block * (element_size + grad_element_size)
    return {"forward": forward, "backward": backward, "total": forward + backward}
