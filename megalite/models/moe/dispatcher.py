"""Token dispatchers: carry each routed token to the rank holding its expert and the expert's
output back, weighted by the router, summed per token. Dropless: every assignment is computed, an
expert that gets no tokens computes nothing, the exchanges' sizes vary by rank.

alltoall (the default): a rank sorts its assignments by expert, sends each rank of its EP group the
rows of that rank's experts (variable all-to-all), gathers its ETP peers' received rows (the
expert's shards need the same tokens), sorts them by local expert, runs the experts, and undoes
each step: ETP partial outputs summed (reduce-scatter), rows sent home, weighted and added per token.
allgather: every rank of the ETP x EP group gathers all of the group's tokens and routing, runs its
experts on the rows routed to them, and a reduce-scatter sums each token's outputs over the group.

Both need the number of rows per expert on the host to size their GEMMs and exchanges: one device
to host copy a layer (inherent to dropless routing; the capacity path's sizes are static).
Exchanges are counted in the traffic accounting as kind "ep".
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.models.moe.capacity import count_per_expert, padded_slots
from megalite.models.moe.chunked import dispatch_in_chunks, expert_groups
from megalite.parallel import lanes, state, traffic
from megalite.parallel.mappings import (
    all_gather_single,
    all_to_all_rows,
    gather_from_sequence_parallel_region,
    gather_rows_v,
    reduce_scatter_rows_v,
    reduce_scatter_to_sequence_parallel_region,
)


def _sort_by_expert(indices: torch.Tensor, num_experts: int):
    """(the assignments in expert order, rows per expert [E]): assignments are the flattened [T, k]
    indices; the sort is stable, so an expert's rows keep token order; dropped assignments (index
    num_experts, see capacity.py) sort last and are not counted."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, count_per_expert(flat, num_experts + 1)[:num_experts]


class _Rows:
    """The assignments a rank sends, as rows: which assignment (of the flattened [T, k]) each row
    holds, its token, and a 0/1 weight (0 for a padding row), with the rows per expert."""

    def __init__(self, indices: torch.Tensor, num_experts: int, pad_to: int | None, counts_on_host=None):
        k = indices.shape[1]
        order, counts = _sort_by_expert(indices, num_experts)
        if pad_to is None:
            self.counts = counts_on_host(counts) if counts_on_host else counts.tolist()
            self.assignment = order[:sum(self.counts)]
            self.valid = None
        else:  # every expert exactly pad_to rows: static sizes, no host copy
            slots = padded_slots(indices.reshape(-1)[order], counts, num_experts, pad_to)
            n = num_experts * pad_to
            self.assignment = torch.zeros(n + 1, dtype=order.dtype, device=order.device).scatter_(0, slots, order)[:n]
            self.valid = torch.zeros(n + 1, device=order.device).scatter_(0, slots, 1.0)[:n]
            self.counts = [pad_to] * num_experts
        self.token = self.assignment // k

    def take(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = tokens.index_select(0, self.token)
        return rows if self.valid is None else rows * self.valid.unsqueeze(-1).to(rows.dtype)

    def weights(self, weights: torch.Tensor) -> torch.Tensor:
        w = weights.reshape(-1).index_select(0, self.assignment)
        return w if self.valid is None else w * self.valid


def _combine(rows: torch.Tensor, weights: torch.Tensor, tokens_of_rows: torch.Tensor, num_tokens: int):
    """sum over a token's rows of weight * row: [num_tokens, hidden] (the row order fixes the order of sums)."""
    weighted = rows * weights.unsqueeze(-1).to(rows.dtype)
    out = rows.new_zeros((num_tokens, rows.shape[-1]))
    return out.index_add(0, tokens_of_rows, weighted)


def _gather_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Every rank's per-expert counts over `group` ([group size, experts], rank order)."""
    if group is None or dist.get_world_size(group) == 1:
        return counts.unsqueeze(0)
    out = counts.new_empty(dist.get_world_size(group) * counts.numel())
    # a few bytes: waited for in place, the pair's turn kept (lanes.collective)
    lanes.collective(all_gather_single, out, counts, group=group, kind="ep", hand_over=False)
    return out.view(-1, counts.numel())


class AllToAllDispatcher:
    def __init__(self, num_experts: int, chunks: int = 1):
        self.num_experts = num_experts
        self.ep, self.etp = state.get_expert_model_parallel_world_size(), state.get_expert_tensor_parallel_world_size()
        self.local = num_experts // self.ep
        self.chunks = min(chunks, self.local) if self.ep > 1 else 1  # (over one rank nothing travels)

    def __call__(self, tokens, weights, indices, experts, pad_to: int | None = None):
        """tokens [T, hidden], weights [T, k], indices [T, k] -> [T, hidden]. `pad_to`: every
        expert's rows padded to this many on every rank (static sizes)."""
        group = state.get_expert_tensor_and_model_parallel_group()
        size = 1 if group is None else dist.get_world_size(group)
        me = 0 if group is None else dist.get_rank(group)
        # counts[g][e] of every rank g of the ETP x EP group (g = ep_rank * etp + etp_rank): one host
        # copy, or known to every rank when padded
        gathered = {}

        def counts_on_host(counts):
            gathered["table"] = _gather_counts(counts, group).tolist()
            return gathered["table"][me]

        sent = _Rows(indices, self.num_experts, pad_to, counts_on_host)
        table = gathered.get("table") or [[pad_to] * self.num_experts for _ in range(size)]
        rows = sent.take(tokens)
        # Inside an overlapped pair the other lane's compute hides the exchanges: there the groups'
        # extra exchanges and hand-overs cost more than they hide (docs/communication.md)
        if self.chunks > 1 and lanes.lane() is None and not torch.compiler.is_compiling():
            y = self._in_chunks(rows, table, experts)
            return _combine(y, sent.weights(weights), sent.token, tokens.shape[0])
        send, recv, block = self._sizes(table, 0, self.local)
        rows = all_to_all_rows(rows, state.get_expert_model_parallel_group(), recv, send)
        y = self._experts(rows, block, experts)
        y = all_to_all_rows(y, state.get_expert_model_parallel_group(), send, recv)
        return _combine(y, sent.weights(weights), sent.token, tokens.shape[0])

    def _sizes(self, table, lo: int, hi: int):
        """For local experts lo..hi-1: the rows this rank sends each EP rank, receives from each, and
        block[q][j][e], the rows from source EP rank j received by ETP peer q for local expert lo + e.
        Each EP rank's experts are contiguous, so rows sorted by expert are grouped by destination."""
        ep, etp, local = self.ep, self.etp, self.local
        me_ep, me_etp = state.get_expert_model_parallel_rank(), state.get_expert_tensor_parallel_rank()
        send = [sum(table[me_ep * etp + me_etp][j * local + lo:j * local + hi]) for j in range(ep)]
        block = [[[table[j * etp + q][me_ep * local + e] for e in range(lo, hi)] for j in range(ep)]
                 for q in range(etp)]
        return send, [sum(per_expert) for per_expert in block[me_etp]], block

    def _experts(self, rows: torch.Tensor, block, experts, *group) -> torch.Tensor:
        """Received rows in (source, expert) order -> their experts' outputs in the same order: the
        ETP peers' rows gathered, every row put in (local expert, ETP peer, source) order, the experts,
        then back, partial sums reduce-scattered over ETP. `group`: the experts' (lo, hi, shared)."""
        peer_rows = [sum(sum(b) for b in block[q]) for q in range(self.etp)]
        rows = gather_rows_v(rows, state.get_expert_tensor_parallel_group(), peer_rows)
        perm, per_expert = self._by_expert(block, rows.device)
        y = experts(rows.index_select(0, perm), per_expert, *group)
        y = y.index_select(0, torch.argsort(perm))  # back to (peer, source, expert) order
        return reduce_scatter_rows_v(y, state.get_expert_tensor_parallel_group(), peer_rows)

    def _in_chunks(self, rows: torch.Tensor, table, experts) -> torch.Tensor:
        """The exchanges and experts above, a group of local experts at a time (megalite.models.moe.chunked):
        rows in expert order in, their outputs in the same order out."""
        ep, etp, local = self.ep, self.etp, self.local
        groups = expert_groups(local, self.chunks)
        mine = table[state.get_expert_model_parallel_rank() * etp + state.get_expert_tensor_parallel_rank()]
        starts = [0]
        for n in mine:
            starts.append(starts[-1] + n)
        # the rows, grouped by chunk, then destination, then expert (each row once: an exact permutation)
        order = [torch.arange(starts[j * local + lo], starts[j * local + hi]) for lo, hi in groups for j in range(ep)]
        order = torch.cat(order).to(rows.device)
        sizes = [self._sizes(table, lo, hi) for lo, hi in groups]
        shared = experts.shared_gradients(len(groups))

        def compute(g: int, received: torch.Tensor) -> torch.Tensor:
            return self._experts(received, sizes[g][2], experts, (*groups[g], shared))

        y = dispatch_in_chunks(rows.index_select(0, order), state.get_expert_model_parallel_group(),
                               [send for send, _, _ in sizes], [recv for _, recv, _ in sizes], compute)
        return y.index_select(0, torch.argsort(order))

    @staticmethod
    def _by_expert(block, device):
        """The permutation taking (peer, source, expert)-ordered rows to expert order, and the rows
        per local expert."""
        starts, start = {}, 0
        for q, per_source in enumerate(block):
            for j, per_expert in enumerate(per_source):
                for e, n in enumerate(per_expert):
                    starts[q, j, e], start = start, start + n
        local = len(block[0][0]) if block and block[0] else 0
        pieces, counts = [], []
        for e in range(local):
            total = 0
            for q, per_source in enumerate(block):
                for j, per_expert in enumerate(per_source):
                    n = per_expert[e]
                    if n:
                        pieces.append(torch.arange(starts[q, j, e], starts[q, j, e] + n))
                        total += n
            counts.append(total)
        perm = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
        return perm.to(device), counts


class AllGatherDispatcher:
    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.local = num_experts // state.get_expert_model_parallel_world_size()

    def __call__(self, tokens, weights, indices, experts, pad_to: int | None = None):
        group = state.get_expert_tensor_and_model_parallel_group()
        size = 1 if group is None else dist.get_world_size(group)
        if size > 1:
            tokens = gather_from_sequence_parallel_region(tokens, True, group)
            weights = gather_from_sequence_parallel_region(weights, True, group)
            gathered = indices.new_empty(size * indices.numel())
            traffic.gather_or_scatter("ep", gathered.nbytes, size)
            lanes.collective(all_gather_single, gathered, indices.contiguous().view(-1), group=group, kind="ep")
            indices = gathered.view(-1, *indices.shape[1:])
        first = state.get_expert_model_parallel_rank() * self.local
        mine = indices - first  # this rank's experts as 0..local-1; the rest (and dropped ones): none
        mine = torch.where((mine >= 0) & (mine < self.local), mine, self.local)
        rows = _Rows(mine, self.local, None if pad_to is None else pad_to * size)
        y = experts(rows.take(tokens), rows.counts)
        out = _combine(y, rows.weights(weights), rows.token, tokens.shape[0])
        return reduce_scatter_to_sequence_parallel_region(out, group) if size > 1 else out


def make_dispatcher(kind: str, num_experts: int, chunks: int = 1):
    """`chunks` (the all-to-all's): its exchanges a group of local experts at a time."""
    if kind == "allgather":
        return AllGatherDispatcher(num_experts)
    return AllToAllDispatcher(num_experts, chunks)
