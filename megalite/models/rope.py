"""Rotary position embedding (RoPE), applied to queries and keys inside attention.

Hugging Face's "rotate half" convention: within the rotated dims of a head, dim i pairs with dim
i + rotated / 2, so q/k weights of Hugging Face Llama-family checkpoints apply unchanged. The
angles are computed in fp32; dims past `config.rotary_dims` pass through. With
`config.rotary_interleaved` (Megatron-LM's --rotary-interleaved) dim 2i pairs with 2i + 1 instead, at
the same frequency i: the same rotation, of the dims taken in another order. No parameters: every
stage builds the same table from the config, whatever it holds.

Contexts longer than the model was first trained at: linear position interpolation
(`rotary_seq_len_interpolation_factor`, arXiv 2306.15595: every position divided by the factor), or
frequency scaling, Llama 3.1's (`rope_scaling_factor`) or YaRN's (`yarn_factor`, arXiv 2309.00071,
in the form DeepSeek-V3 and Hugging Face use): each frequency is kept, divided by the factor, or
blended by where its wavelength falls against the original context, and YaRN scales cos and sin by
an attention factor.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from megalite.models.config import TransformerConfig
from megalite.parallel import state
from megalite.parallel.context_parallel import context_parallel_positions


def inverse_frequencies(config: TransformerConfig, device=None) -> torch.Tensor:
    """base^(-2i / rotated) for i < rotated / 2 (fp32, on `device`, CPU by default), with Llama 3.1 or
    YaRN scaling when configured."""
    dims = config.rotary_dims
    # fp32 throughout, as Hugging Face computes it, so long positions rotate by the same angles.
    inv_freq = 1.0 / config.rotary_base ** (torch.arange(0, dims, 2, dtype=torch.float32, device=device) / dims)
    if config.rope_scaling_factor is not None:
        inv_freq = _llama3_scaled(inv_freq, config)
    if config.yarn_factor is not None:
        inv_freq = _yarn_scaled(inv_freq, config)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """Long wavelengths slowed by the factor, short ones kept, a linear blend (in 1/wavelength) between."""
    factor, low, high = config.rope_scaling_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
    original = config.rope_original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    blend = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: slowed, 1: kept
    return (1.0 - blend) * inv_freq / factor + blend * inv_freq


def _yarn_correction_dim(rotations: float, config: TransformerConfig) -> float:
    """The (fractional) dim index whose frequency turns `rotations` times over the original context:
    base^(-d / dims) * original = 2 pi * rotations, solved for d."""
    dims, original = config.rotary_dims, config.yarn_original_max_position_embeddings
    return dims * math.log(original / (2 * math.pi * rotations)) / (2 * math.log(config.rotary_base))


def yarn_ramp(config: TransformerConfig, device=None) -> torch.Tensor:
    """Per frequency i < rotary_dims / 2: 0 where it is kept (more than beta_fast turns over the
    original context), 1 where it is divided by the factor (fewer than beta_slow), linear between.
    The bounds are rounded outwards to whole dims, as YaRN's reference and Hugging Face do, unless
    `yarn_correction_range_round_to_int` is off (Hugging Face's truncate=False: gpt-oss)."""
    low = _yarn_correction_dim(config.yarn_beta_fast, config)
    high = _yarn_correction_dim(config.yarn_beta_slow, config)
    if config.yarn_correction_range_round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, config.rotary_dims - 1)
    width = high - low if high != low else 0.001  # one step at `low` when the two meet
    i = torch.arange(config.rotary_dims // 2, dtype=torch.float32, device=device)
    return ((i - low) / width).clamp(0.0, 1.0)


def _yarn_scaled(inv_freq: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    ramp = yarn_ramp(config, inv_freq.device)
    return (1.0 - ramp) * inv_freq + ramp * inv_freq / config.yarn_factor


def yarn_mscale(factor: float, scale: float) -> float:
    """YaRN's magnitude correction 1 + 0.1 scale ln(factor) (1 when the context is not stretched)."""
    return 1.0 if factor <= 1.0 else 1.0 + 0.1 * scale * math.log(factor)


def yarn_attention_factor(config: TransformerConfig) -> float:
    """What YaRN multiplies cos and sin by (so the rotated dims' part of every score by its square):
    m(mscale) / m(mscale_all_dim); 1 without YaRN."""
    if config.yarn_factor is None:
        return 1.0
    f = config.yarn_factor
    return yarn_mscale(f, config.yarn_mscale) / yarn_mscale(f, config.yarn_mscale_all_dim)


def yarn_softmax_scale(config: TransformerConfig) -> float:
    """The factor DeepSeek's MLA multiplies its softmax scale 1/sqrt(d_n + d_r) by under YaRN:
    m(mscale_all_dim)^2, on every dim of the scores (DeepSeek-V3's mscale = mscale_all_dim leaves cos
    and sin unscaled and puts the whole correction here); 1 without YaRN."""
    if config.yarn_factor is None:
        return 1.0
    return yarn_mscale(config.yarn_factor, config.yarn_mscale_all_dim) ** 2


# cos/sin tables by (inverse frequencies, length, device): one copy for all the layers of a process
# (each layer's attention keeps a reference for its backward, not a table of its own).
_TABLES: dict = {}
_MAX_TABLES = 8  # lengths and devices in use at once (training uses one; evaluation may add another)


class RotaryEmbedding(nn.Module):
    """cos/sin of positions 0..s-1, shared by every layer with the same frequencies, and their
    rotation of q and k."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config, self.rotary_dims = config, config.rotary_dims
        self.inv_freq = inverse_frequencies(config)  # a plain attribute: not in the state dict
        self.attention_factor = yarn_attention_factor(config)
        self._key = (config.rotary_dims, config.rotary_base, config.rope_scaling_factor, config.rope_low_freq_factor,
                     config.rope_high_freq_factor, config.rope_original_max_position_embeddings, config.yarn_factor,
                     config.yarn_original_max_position_embeddings, config.yarn_beta_fast, config.yarn_beta_slow,
                     self.attention_factor, config.rotary_seq_len_interpolation_factor,
                     config.yarn_correction_range_round_to_int)

    def cos_sin(self, s: int, device, cp_rank: int = 0, cp: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """[s, 1, 1, rotary_dims] each (fp32), broadcast over batch and heads: positions 0..s-1, or
        with context parallelism the global positions of CP rank `cp_rank`'s s tokens. The sine's
        first half is negated: rotate_half(x) * sin is then x.roll(half) * sin, with no cat. Under
        YaRN both are times its attention factor."""
        if torch.compiler.is_compiling():
            # Made in the graph, on the device (as transformers' rotary embedding makes them each
            # forward): filling the cache would be a side effect, guarded on, recompiled for, and
            # not allowed inside a checkpointed region; a copy from the host would sync.
            return self._tables(s, inverse_frequencies(self.config, device), device, cp_rank, cp)
        key = (self._key, s, str(device), cp_rank, cp)
        if key not in _TABLES:
            if len(_TABLES) >= _MAX_TABLES:
                _TABLES.clear()
            _TABLES[key] = self._tables(s, self.inv_freq, device, cp_rank, cp)
        return _TABLES[key]

    def _tables(self, s: int, inv_freq: torch.Tensor, device, cp_rank: int,
                cp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The angles made where inv_freq is, their cos and signed sin on `device`."""
        positions = (torch.arange(s, device=inv_freq.device) if cp == 1
                     else context_parallel_positions(s * cp, cp_rank, cp, inv_freq.device))
        angles = torch.outer(self._interpolated(positions.to(torch.float32)), inv_freq)
        return self._signed(torch.cat([angles, angles], dim=-1)[:, None, None, :].to(device))

    def cos_sin_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[s, b, 1, rotary_dims] each for per-token positions [b, s] (documents packed into a
        sequence, each counted from 0): made on the positions' device, for one batch."""
        inv_freq = self.inv_freq.to(positions.device)
        positions = self._interpolated(positions.t().to(torch.float32))
        angles = positions[..., None] * inv_freq  # [s, b, rotary_dims / 2]
        return self._signed(torch.cat([angles, angles], dim=-1)[:, :, None, :])

    def _interpolated(self, positions: torch.Tensor) -> torch.Tensor:
        """fp32 positions times 1 / `rotary_seq_len_interpolation_factor` (linear position interpolation),
        computed as Megatron-Core computes it; unchanged without one."""
        factor = self.config.rotary_seq_len_interpolation_factor
        return positions if factor is None else positions * (1 / factor)

    def _signed(self, angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = angles.cos(), angles.sin()
        sin[..., :self.rotary_dims // 2].neg_()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [s, b, heads, head_dim] -> the same with its first rotary_dims dims rotated by position
        (0..s-1 or this CP rank's share of them; else `cos_sin`, from `cos_sin_at`)."""
        if cos_sin is None:
            cp = state.get_context_parallel_world_size()
            cos_sin = self.cos_sin(x.shape[0], x.device, state.get_context_parallel_rank() if cp > 1 else 0, cp)
        if not self.config.rotary_interleaved:
            return apply_rotary(x, *cos_sin, self.rotary_dims)
        # Interleaved pair (2i, 2i + 1) is rotate-half's (i, i + dims / 2): taken into that order, rotated by
        # the same tables and put back, so each value meets the same cos and sin as in Megatron-LM's form.
        dims = self.rotary_dims
        rotary = x[..., :dims]
        halves = apply_rotary(torch.cat([rotary[..., 0::2], rotary[..., 1::2]], dim=-1), *cos_sin, dims)
        pairs = halves.unflatten(-1, (2, dims // 2)).transpose(-1, -2).flatten(-2)
        return torch.cat([pairs, x[..., dims:]], dim=-1) if dims < x.shape[-1] else pairs


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, dims: int) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin on the first `dims` dims of the last axis (in fp32), where
    rotate_half(x) = [-second half, first half]: computed as x.roll(half) * signed_sin (the sine
    with its first half negated, as `cos_sin` returns it), the same numbers with no cat."""
    rotated, rest = x[..., :dims].float(), x[..., dims:]
    out = rotated * cos + rotated.roll(dims // 2, dims=-1) * signed_sin
    return torch.cat([out.to(x.dtype), rest], dim=-1) if rest.shape[-1] else out.to(x.dtype)


def rotary_embedding(config: TransformerConfig) -> RotaryEmbedding | None:
    """The rotation attention applies to q and k, or None when positions are not rotary."""
    return RotaryEmbedding(config) if config.position_embedding_type == "rope" else None
