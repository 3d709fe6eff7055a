"""Rotary-embedding frequencies for the 64 (qk_rope_head_dim) rope dims, incl. YaRN.

The frequencies are computed once into a cos/sin table indexed by position; the rotation itself is
an op (`specmla.ops.rope`).
"""

from __future__ import annotations

import math

import torch

from specmla.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Inverse frequencies [dim/2] (fp32), YaRN-blended when rope.type == "yarn" (as transformers)."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.type != "yarn":
        return 1.0 / pos_freqs

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1.0 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_cos_sin_cache(rope: RopeConfig, dim: int, max_positions: int, device=None) -> torch.Tensor:
    """[max_positions, dim] fp32 table: first half cos, second half sin (both × YaRN's cos/sin scale)."""
    inv_freq = rope_inv_freq(rope, dim)
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    scale = rope.cos_sin_scale
    return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1).to(device)
