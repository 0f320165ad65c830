"""--optimizer muon over a built MegaliteOptimizer: which masters Muon takes (megalite.optim.muon), how
each matrix's rows split and shard, and AdamW for the rest."""
from __future__ import annotations

from megalite import parallel
from megalite.models.attention import ParallelAttention
from megalite.optim import MegaliteOptimizer
from megalite.optim.grads import is_expert
from megalite.optim.low_precision_adam import adamw
from megalite.optim.muon import Matrix, Muon, MuonAndAdamW, Rows, is_muon_matrix


def _fused_rows(chunks, split_qkv: bool):
    """{id(weight): Rows} of the fused query/key/value weights split into q, k and v, and {id(query
    weight): key/value weight} of the pairs joined into one [q; k; v] matrix (--muon-no-split-qkv)."""
    rows, joins = {}, {}
    for chunk in chunks:
        for m in chunk.modules():
            if not isinstance(m, ParallelAttention):
                continue
            d = m.config.head_dim
            if hasattr(m, "qkv"):  # rows [heads, (q, k, v), d]
                if split_qkv:
                    rows[id(m.qkv.weight)] = Rows((d, d, d))
            elif split_qkv:  # q whole; kv rows [groups, (k, v), d]
                rows[id(m.kv.weight)] = Rows((d, d), aligned=not m.groups_replicated)
            else:
                joins[id(m.q.weight)] = m.kv.weight
    return rows, joins


def _sharding(p) -> dict:
    if is_expert(p):
        size = parallel.get_expert_tensor_parallel_world_size()
        group, rank = parallel.get_expert_tensor_parallel_group(), parallel.get_expert_tensor_parallel_rank()
    elif getattr(p, "tensor_model_parallel", False):
        size = parallel.get_tensor_model_parallel_world_size()
        group, rank = parallel.get_tensor_model_parallel_group(), parallel.get_tensor_model_parallel_rank()
    else:
        return {}
    if size == 1:
        return {}
    dim = p.partition_dim - p.ndim  # -2: rows, -1: columns (of each expert's matrix too)
    return dict(dim=dim, blocks=getattr(p, "partition_blocks", 1), group=group, size=size, rank=rank)


def use_muon(optimizer: MegaliteOptimizer, cfg, chunks) -> None:
    """Replace the optimizer's AdamW by Muon for the matrices and AdamW for the rest (same groups)."""
    o = cfg.optimizer
    master_of, param_of = {}, {}
    for piece in optimizer.pieces:
        if piece.master.shape != piece.param.shape:
            raise ValueError("--optimizer muon orthogonalizes whole matrices: every master must be a whole "
                             "parameter (no ZeRO sharding)")
        master_of[id(piece.param)], param_of[id(piece.master)] = piece.master, piece.param
    rows, joins = _fused_rows(chunks, o.muon_split_qkv)
    joined = {id(kv) for kv in joins.values()}
    matrices = []
    for piece in optimizer.pieces:
        p = piece.param
        if not is_muon_matrix(p) or id(p) in joined:
            continue
        masters = [piece.master] + ([master_of[id(joins[id(p)])]] if id(p) in joins else [])
        matrices.append(Matrix(masters, rows.get(id(p)), **_sharding(p)))
    muon_groups, adam_groups = [], []
    for group in optimizer.plain_groups():
        base = {k: v for k, v in group.items() if k != "params"}
        mine = [m for m in group["params"] if id(m) in param_of and is_muon_matrix(param_of[id(m)])]
        taken = {id(m) for m in mine}
        rest = [m for m in group["params"] if id(m) not in taken]
        muon_groups += [dict(base, params=mine)] if mine else []
        adam_groups += [dict(base, params=rest)] if rest else []
    muon = Muon(muon_groups, matrices, lr=o.lr, momentum=o.muon_momentum, nesterov=o.muon_use_nesterov,
                steps=o.muon_num_ns_steps, precision=o.muon_fp32_matmul_prec, scale_mode=o.muon_scale_mode,
                extra_scale=o.muon_extra_scale_factor, tp_mode=o.muon_tp_mode) if muon_groups else None
    adam = adamw(adam_groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                 exp_avg_dtype=o.exp_avg_dtype, exp_avg_sq_dtype=o.exp_avg_sq_dtype) if adam_groups else None
    optimizer.inner = MuonAndAdamW(muon, adam)


def layer_wise_owners(chunks, buffers) -> dict[int, int]:
    """--optimizer dist_muon (Megatron-LM's layer-wise distributed optimizer): {id(param): the rank of
    its buffer's data-parallel group that updates it}. The units are whole transformer layers and every
    other parameter alone (the embedding, output layer, final norm...), largest first to the least
    loaded rank of the group (one load over all the buffers reduced over that group: the dense ones,
    the experts' over expert data parallelism), so a rank holds about 1/dp of the optimizer's elements
    and every matrix (q and kv together) whole. The same on every rank of a group and on its TP and ETP
    peers, whose shards are alike."""
    groups: dict[bool, list] = {}  # the dense buffers' units, and the experts' (another group)
    size = {}
    for buf in buffers:
        params = [p for bucket in buf.buckets for p in bucket.params]
        held, units = {id(p) for p in params}, []
        for layer in getattr(chunks[buf.chunk_index], "layers", []):
            members = [p for p in layer.parameters() if id(p) in held]
            if members:
                units.append(members)
        in_layers = {id(p) for u in units for p in u}
        groups.setdefault(buf.experts, []).extend(units + [[p] for p in params if id(p) not in in_layers])
        size[buf.experts] = buf.dp_size
    owners = {}
    for experts, units in groups.items():
        load = [0] * size[experts]
        for unit in sorted(units, key=lambda u: -sum(p.numel() for p in u)):  # (stable: ties in order)
            rank = min(range(size[experts]), key=lambda r: (load[r], r))
            load[rank] += sum(p.numel() for p in unit)
            owners.update({id(p): rank for p in unit})
    return owners
