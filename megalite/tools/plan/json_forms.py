"""The planner's JSON forms (--json): a prediction, the model's shape, the rejections."""
from __future__ import annotations

from dataclasses import asdict

from megalite.models.config import TransformerConfig
from megalite.tools.plan.command import SHAPE_FIELDS
from megalite.tools.plan.inputs import GIB


def prediction_json(pred, model_flags: list[str] | None, zero_stage_makes_it_fit: bool) -> dict:
    """A Prediction as JSON (Prediction.to_dict, which says whether its ZeRO stage is what makes it
    fit: predict.stage_that_makes_it_fit predicts the lower stages)."""
    memory, time, layout = asdict(pred.memory), asdict(pred.time), asdict(pred.layout)
    if pred.layout.cp == 1:  # without context parallelism the JSON stays as it was
        del layout["cp"], time["cp_comm"]
    if not pred.config.is_moe:  # nor for a dense model
        del layout["ep"], layout["etp"], time["ep_comm"], memory["experts"]
    if not pred.config.mtp_num_layers:  # nor without multi-token prediction
        del memory["mtp"]
    if pred.layout.schedule == "1f1b":  # nor with the default schedule
        del layout["schedule"]
    return {
        "layout": layout, "fits": pred.fits, "reason": pred.reason,
        "micro_batches": pred.micro_batches, "peak_stage": pred.peak_stage,
        "memory_bytes": {k: int(v) for k, v in memory.items()},
        "memory_gib": {k: round(v / GIB, 3) for k, v in memory.items()},
        "build_peak_gib": round(pred.build_peak / GIB, 3), "peak_gib": round(pred.peak_bytes / GIB, 3),
        "time_s": {k: round(v, 6) for k, v in time.items()},
        "dp_traffic_bytes": {k: int(v) for k, v in pred.dp_parts[pred.dp_stage].traffic.items()},
        # per dimension: exchanges, bytes, communication and exposed seconds a step (exposed.py)
        "exposed_comm": {dim: {"exchanges": x.exchanges, "bytes": int(x.bytes), "comm_s": round(x.comm, 6),
                               "exposed_s": round(x.exposed, 6)} for dim, x in pred.exposed.items()},
        "zero_stage_makes_it_fit": zero_stage_makes_it_fit,
        "bubble_fraction": round(pred.bubble_fraction, 6), "mfu": round(pred.mfu, 4),
        "tokens_per_s": round(pred.tokens_per_s, 1), "model_flops": pred.model_flops,
        "hardware_flops": pred.hardware_flops, "command": pred.command(model_flags),
    }


def config_json(config: TransformerConfig) -> dict:
    return {k: getattr(config, k) for k in (*SHAPE_FIELDS, "max_position_embeddings")}


def rejected_json(result) -> list:
    """A PlanResult's rejections, the most common first."""
    return [{"reason": kind, "count": r.count, "example": r.example} for kind, r in by_count(result)]


def by_count(result) -> list:
    return sorted(result.rejected.items(), key=lambda kv: -kv[1].count)
