"""Hugging Face's YaRN rope_parameters <-> megalite's yarn_* fields, for every family that has them
(DeepSeek-V3, the Llama family, gpt-oss).

Hugging Face multiplies cos and sin by `attention_factor` when given, else m(mscale) / m(mscale_all_dim)
when both are non-zero, else m(1), with m(k) = 1 + 0.1 k ln(factor); megalite by m(yarn_mscale) /
m(yarn_mscale_all_dim). `truncate` (default true) rounds the ramp's ends outwards to whole dims:
megalite's yarn_correction_range_round_to_int.
"""
from __future__ import annotations

import math
from typing import Mapping

from megalite.models.rope import yarn_attention_factor, yarn_mscale


def hf_yarn_attention_factor(rope: Mapping, factor: float) -> float:
    """What Hugging Face multiplies cos and sin by under YaRN (mscale alone is ignored)."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return yarn_mscale(factor, 1.0)


def _yarn_mscale_for(wanted: float, factor: float, all_dim: float, given: float, problems: list[str]) -> float:
    """megalite's yarn_mscale giving cos/sin the factor `wanted` beside `all_dim`: `given` when it
    does (DeepSeek's configs), else solved from m(mscale) = wanted * m(all_dim)."""
    if math.isclose(yarn_mscale(factor, given) / yarn_mscale(factor, all_dim), wanted, rel_tol=1e-12):
        return given
    if factor <= 1.0:
        problems.append(f"yarn attention_factor={wanted} with factor={factor} (megalite's is 1 when the factor is at "
                        f"most 1)")
        return given
    return (wanted * yarn_mscale(factor, all_dim) - 1.0) / (0.1 * math.log(factor))


def yarn_fields(rope: Mapping, problems: list[str]) -> dict:
    """megalite's yarn_* fields of Hugging Face's yarn `rope` parameters; problems appended."""
    factor, original = rope.get("factor"), rope.get("original_max_position_embeddings")
    if factor is None or original is None:
        problems.append("yarn rope scaling without factor or original_max_position_embeddings")
        return {}
    if factor < 1.0:
        problems.append(f"yarn factor={factor} (below 1 it shortens wavelengths; megalite's YaRN needs >= 1)")
        return {}
    all_dim = float(rope.get("mscale_all_dim") or 0.0)  # Hugging Face scales the softmax only when it is non-zero
    given = float(rope.get("mscale") or 1.0)  # tried first: what an export wrote beside its attention_factor
    mscale = _yarn_mscale_for(hf_yarn_attention_factor(rope, factor), factor, all_dim, given, problems)
    return dict(yarn_factor=float(factor), yarn_original_max_position_embeddings=int(original),
                yarn_beta_fast=float(rope.get("beta_fast") or 32.0), yarn_beta_slow=float(rope.get("beta_slow") or 1.0),
                yarn_mscale=mscale, yarn_mscale_all_dim=all_dim,
                yarn_correction_range_round_to_int=bool(rope.get("truncate", True)))


def hf_yarn_parameters(c) -> dict:
    """The yarn entries of Hugging Face's rope_parameters for a megalite config ({} without YaRN);
    an explicit attention_factor where mscale and mscale_all_dim alone would not say it."""
    if getattr(c, "yarn_factor", None) is None:
        return {}
    rope = dict(rope_type="yarn", factor=c.yarn_factor,
                original_max_position_embeddings=c.yarn_original_max_position_embeddings, beta_fast=c.yarn_beta_fast,
                beta_slow=c.yarn_beta_slow, mscale=c.yarn_mscale, mscale_all_dim=c.yarn_mscale_all_dim)
    if not c.yarn_correction_range_round_to_int:  # (Hugging Face's default truncates, as DeepSeek's configs say)
        rope["truncate"] = False
    ours = yarn_attention_factor(c)
    if not math.isclose(hf_yarn_attention_factor(rope, c.yarn_factor), ours, rel_tol=1e-12):
        rope["attention_factor"] = ours  # e.g. an mscale without mscale_all_dim, which Hugging Face ignores
    return rope
