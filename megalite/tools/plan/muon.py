"""The optimizer's choices in the planner: Adam's moments in bf16 (2 bytes each), and --optimizer muon: Muon's matrices keep one fp32 moment (AdamW two), and each step
orthogonalizes every matrix a rank holds by Newton-Schulz (megalite.optim.newton_schulz), each step of
which, for the matrix seen wide (g rows, the smaller side; k columns), is X X^T (2 g^2 k FLOPs), A A
(2 g^3) and B X (2 g^2 k). --muon-tp-mode sets what one rank computes of a TP-sharded matrix: blockwise
its shard, duplicated the whole, distributed the whole's Gram matrices from its shard (the Gram side
is then the unsharded one: g the unsharded dim, k the shard's). The q/k/v split is counted as one
matrix, and the TP collectives of duplicated and distributed are not counted."""
from __future__ import annotations

from dataclasses import replace

from megalite.tools.plan.costs import LayoutCosts
from megalite.tools.plan.inputs import _rank_stages


def optimizer_of(section) -> dict | None:
    """Run's optimizer fields from an optimizer section (or the planner's namespace): Muon's, and the
    bytes of Adam's two moments (bf16 ones: 2 each); None for AdamW with fp32 moments."""
    out = {}
    if getattr(section, "optimizer", "adam") in ("muon", "dist_muon"):  # (dist_muon's sharding not counted)
        out.update(muon_tp_mode=section.muon_tp_mode, muon_ns_steps=section.muon_num_ns_steps)
    for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(section, name, "fp32") != "fp32":
            out[name] = getattr(section, name)
    return out or None


def _held(costs: LayoutCosts, r: int, experts: bool | None = None):
    """Muon's matrices pipeline rank r holds (experts True: the experts' only)."""
    layout, run = costs.layout, costs.run
    for stage, numbers in _rank_stages(costs.config, layout.pp, layout.vpp, r, run.seq_length, run.pipeline_layers,
                                       layout.v_shape):
        yield from (x for x in (*stage.head, *(y for n in numbers for y in stage.layer_params(costs.config, n)),
                                *stage.tail) if x.matrix is not None and experts in (None, x.expert))


def muon_state_saving(costs: LayoutCosts, r: int, experts: bool | None = None) -> int:
    """Bytes pipeline rank r's optimizer holds less than AdamW's: 4 an element of every matrix (experts
    True: of the experts' matrices)."""
    layout = costs.layout
    return 4 * sum(x.per_rank(costs.config, layout.tp, layout.ep, layout.etp) for x in _held(costs, r, experts))


def with_optimizer_choices(costs: LayoutCosts, r: int, st):
    """Rank r's StateBytes (and its experts' part) with Muon's one moment and bf16 moments counted."""
    run = costs.run
    if not run.muon_tp_mode and run.adam_moment_bytes == 8:
        return st

    def less(part, experts):
        saving = muon_state_saving(costs, r, experts) if run.muon_tp_mode else 0
        return replace(part, optimizer=part.optimizer - saving
                       - (8 - run.adam_moment_bytes) * (part.owned_numel - saving // 4))

    if st.experts is not None:
        return replace(less(st, None), experts=less(st.experts, True))
    return less(st, None)


def ns_flops(rows: int, cols: int, split_dim: int | None, ranks: int, mode: str, steps: int) -> float:
    """One rank's Newton-Schulz FLOPs for one rows x cols matrix sharded along split_dim over `ranks`."""
    if split_dim is None or ranks == 1 or mode == "duplicated":
        g, k = min(rows, cols), max(rows, cols)
    elif mode == "blockwise":
        shard = (rows // ranks, cols) if split_dim == 0 else (rows, cols // ranks)
        g, k = min(shard), max(shard)
    else:  # distributed: the Gram matrix over the unsharded side
        g, k = (cols, rows // ranks) if split_dim == 0 else (rows, cols // ranks)
    return steps * (4.0 * g * g * k + 2.0 * g ** 3)


def muon_seconds(costs: LayoutCosts, r: int) -> float:
    """Pipeline rank r's Newton-Schulz time a step, at the GPU's sustained rate."""
    layout, run = costs.layout, costs.run
    total = 0.0
    for x in _held(costs, r):
        rows, cols = x.matrix
        if x.expert:  # each local expert's matrix alone, sharded over ETP
            local = x.numel // (rows * cols) // layout.ep
            total += local * ns_flops(rows, cols, x.split_dim, layout.etp or layout.tp, run.muon_tp_mode,
                                      run.muon_ns_steps)
        else:
            total += ns_flops(rows, cols, x.split_dim if x.tp_split else None, layout.tp, run.muon_tp_mode,
                              run.muon_ns_steps)
    return total / costs.rate
