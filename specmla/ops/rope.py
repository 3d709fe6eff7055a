"""Rotary position embedding applied to q_pe / k_pe (torch reference; a fused kernel comes later).

Layouts (`interleave=True`, DeepSeek's default): the input holds pairs (x0, x1), (x2, x3), ... each
rotated by one frequency; the output is written de-interleaved, [rotated evens | rotated odds], as
transformers' DeepSeek-V3 does. DeepSeek-V2 in transformers keeps the output interleaved (complex
multiply); q_pe and k_pe pass through the same permutation, so every q·k score is identical and
specmla uses the V3 layout for both families. `interleave=False` is the GPT-NeoX rotate-half form.
"""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, interleave: bool = True) -> torch.Tensor:
    """Rotate x [..., T, (heads,) dim] by the angles of `positions` [T]; computed in fp32, returned in x.dtype.

    x's token axis must be the one that `positions` indexes: x is [T, dim] or [T, H, dim].
    """
    half = x.shape[-1] // 2
    cs = cos_sin.index_select(0, positions.reshape(-1).long())
    cos, sin = cs[:, :half], cs[:, half:]
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    xf = x.float()
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)
