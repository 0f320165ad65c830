"""Llama 4's attention variants, as Megatron-LM's flags name them: --qk-l2-norm (each query and key
head scaled to unit root-mean-square, no weight) and --no-rope-freq (layers that skip rope).

Megatron-Core's L2Norm: x * rsqrt(mean(x^2) + eps) over each head's dims in fp32, back in x's dtype,
eps the norms' epsilon, applied where its q/k layernorm sits (before rope; rope turns pairs of dims
and keeps the root-mean-square, so the order changes nothing but rounding). --no-rope-freq N skips
rope in every N-th layer (1-based: N, 2N, ...; the layers must be a multiple of N), or a list says
it per layer, 1 = no rope (Megatron-Core's `no_rope_freq`).
"""
from __future__ import annotations

import torch

from megalite.models.layer_pattern import layer_pattern


def l2_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head of x [..., head_dim] at unit root-mean-square (fp32 inside, x's dtype out)."""
    wide = x.float()
    return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def no_rope_pattern(freq, num_layers: int) -> list[int] | None:
    """One 1 (no rope) or 0 (rope) per layer, 0-based, from an int N, a list, or its Megatron-LM
    spelling; None for None or 0 (off, as in Megatron-Core)."""
    if freq in (None, 0, "0"):
        return None

    def every(n: int, layers: int) -> list[int]:
        if n < 1 or layers % n:
            raise ValueError(f"--no-rope-freq {n} skips rope in every {n}-th layer: it must be >= 1 and divide the "
                             f"{layers} layers")
        return ([0] * (n - 1) + [1]) * (layers // n)
    return layer_pattern(freq, num_layers, "--no-rope-freq", every, "1 (no rope) or 0 (rope)")


def normalized_qk_variants(config) -> tuple[bool, list[int] | None]:
    """A TransformerConfig's (qk_layernorm, no_rope_freq) as it keeps them (one 0/1 per layer; None:
    rope everywhere), after refusing the settings these variants do not combine with. Beside
    --qk-layernorm the L2 norm is the queries' and keys' norm, as Megatron-Core chooses it (the
    layernorm's weights are then not built), and --no-rope-freq 0 is off, as there."""
    if config.qk_l2_norm and config.multi_latent_attention:  # as Megatron-Core refuses it
        raise ValueError("--qk-l2-norm does not apply to --multi-latent-attention: drop it")
    qk_layernorm = config.qk_layernorm and not config.qk_l2_norm
    pattern = no_rope_pattern(config.no_rope_freq, config.num_layers)
    if pattern is None:
        return qk_layernorm, None
    if config.position_embedding_type != "rope" or config.multi_latent_attention or config.mtp_num_layers:
        raise ValueError("--no-rope-freq skips rope in some layers of a rope model without MLA or multi-token "
                         "prediction (whose layers it does not number): add --position-embedding-type rope, or "
                         "drop it")
    return qk_layernorm, pattern if any(pattern) else None
