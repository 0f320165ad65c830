"""`--tp-comm-overlap` in the planner, linear by linear: each of a layer's four TP exchanges is
pipelined with its own linear's GEMM (exposed.tp_exposure), and the linears differ in size (the
output projection is a third of the QKV projection's, a quarter of an MLP projection's at ffn 4h).
A shard transfer exposes what its GEMM does not cover, max(0, transfer - GEMM): taken at the layer's
average GEMM it understates the small linears' exposure where the large ones cover theirs (the max is
convex), and it gives the column linears' backward (QKV, fc1: the larger) the average weight GEMM.
On the emulated link of docs/slow-links.md (f) ("The waits on the timeline") the output
projection's pieces waited about 11 ms each where the average linear covered them."""
from __future__ import annotations

# The layer's TP linears in the order of their exchanges in a forward: the column-parallel QKV
# projection (an all-gather before it), the row-parallel output projection (a reduce-scatter
# after), the column-parallel first MLP projection, the row-parallel second.
COLUMN = (True, False, True, False)


def linear_shares(config) -> tuple[float, float, float, float]:
    """Each TP linear's share of a dense layer's projection FLOPs (`metrics.layer_forward_flops`):
    QKV (grouped-query: the key/value groups'), output, first MLP (gate and up when gated),
    second MLP. Multi-latent attention: equal shares (its projections are not TP-split alike)."""
    if config.multi_latent_attention:
        return (0.25, 0.25, 0.25, 0.25)
    h, f = config.hidden_size, config.ffn_hidden_size
    q = config.num_attention_heads * config.head_dim
    kv = 2 * config.query_groups * config.head_dim
    macs = (h * (q + kv), q * h, h * f * (2 if config.gated_linear_unit else 1), f * h)
    return tuple(m / sum(macs) for m in macs)


def per_exchange(rest, shard_gemms: list[float], t: int) -> tuple[float, float, float, float]:
    """Exposed seconds of one exchange, averaged over a dense layer's linears: (a forward's; a
    backward's of a row linear; of a column linear; of a column linear with its weight GEMM, t shard
    GEMMs, beside its last sums). `rest(g)`: what an exchange behind a shard GEMM of g seconds leaves
    uncovered; `shard_gemms`: the four linears' shard GEMMs."""
    rests = [rest(g) for g in shard_gemms]
    rows = [max(0.0, r) for r, col in zip(rests, COLUMN) if not col]
    cols = [(max(0.0, r), max(0.0, r - t * g)) for r, g, col in zip(rests, shard_gemms, COLUMN) if col]
    return (sum(max(0.0, r) for r in rests) / 4, sum(rows) / len(rows), sum(c for c, _ in cols) / len(cols),
            sum(b for _, b in cols) / len(cols))
